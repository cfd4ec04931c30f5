"""The estimator against real GPU measurements, in CI: bench/gpu_reestimate.py re-estimates runs
of the committed results files (bench/results/gpu, measured on an H200 by bench/gpu_truth.py) on
this CPU and compares them with what the GPU measured, not with the estimate recorded there."""

from __future__ import annotations

import json
import sys

import pytest

from tests.helpers import ROOT

BENCH = ROOT / "bench"
sys.path.insert(0, str(BENCH))

import gpu_reestimate  # noqa: E402

FIT_FILE = BENCH / "results" / "gpu" / "NVIDIA-H200_torch2.11.0_2026-11-26.json"
# one run per attention path the H200 took: cuDNN attention (bf16 SDPA, sm90 + CUDA 13) and the
# memory-efficient kernel with GPT-2's dropout (fp32 SDPA). T5 is left out: its SDPA mask's
# layout, hence its CUDA kernel, depends on the transformers version (see the bench's docstring).
RUNS = ("llama-160m.amp_bf16.adamw_torch_fused.sdpa.b8s1024",
        "gpt2-124m.fp32.adamw_torch.sdpa.b8s1024")


@pytest.mark.slow
def test_reestimates_are_within_10pct_of_what_the_h200_measured(tmp_path, capsys):
    out = tmp_path / "rows.json"
    assert gpu_reestimate.main([str(FIT_FILE), "--json", str(out)]
                               + [a for r in RUNS for a in ("--only", r)]) == 0
    doc = json.loads(out.read_text())
    rows = {r["id"]: r for r in doc["fit"]["rows"]}
    assert set(rows) == set(RUNS)
    for rid, row in rows.items():
        assert "error" not in row["estimate_now"], row
        for metric in ("allocated", "reserved", "device_used"):
            measured = row["measured"][metric]
            assert measured > 2**30, (rid, metric)  # GPU figures, not the CPU's
            # predicted / measured - 1, today's estimate against the H200's measurement
            assert abs(row["now"][metric]) <= 0.10, (rid, metric, row)
            assert row["estimate_now"][f"peak_{metric}" if metric != "device_used"
                                       else metric] > 2**30
    assert "fit: 2 runs" in capsys.readouterr().out


def test_a_missing_results_file_is_named_with_exit_2(tmp_path, capsys):
    assert gpu_reestimate.main([str(tmp_path / "nope.json")]) == 2
    assert "nope.json" in capsys.readouterr().err


def test_the_fit_set_names_committed_files_only():
    """FIT_SET decides which files constants may be fitted on; each name it lists is a file."""
    names = gpu_reestimate.fit_set(BENCH / "results" / "gpu")
    assert names and all((BENCH / "results" / "gpu" / n).is_file() for n in names)
