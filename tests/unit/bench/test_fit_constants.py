"""bench/fit_constants.py: every constant fitted on the GPU fit set is what its stated rule gives
on the declared fit file, and nothing outside the fit set moves it."""

from __future__ import annotations

import json
import shutil
import sys

import pytest

from tests.helpers import ROOT

BENCH = ROOT / "bench"
sys.path.insert(0, str(BENCH))

import fit_constants  # noqa: E402

RESULTS = BENCH / "results" / "gpu"
MiB = 2**20


def test_every_held_constant_is_what_the_fit_set_gives(capsys):
    out = fit_constants.compute()
    differ = {k: c for k, c in out["constants"].items() if not c["agrees"]}
    assert not differ, f"refit with `python bench/fit_constants.py`: {differ}"
    assert fit_constants.main([]) == 0
    assert "DIFFERS" not in capsys.readouterr().out


def test_the_rules_by_hand_on_the_fit_file():
    """The H200 fit file: every run's context grew NVML's used memory by 548,995,072 B (523.56
    MiB -> 524 MiB); used after the steps less reserved is 763.56 MiB with a fused attention
    kernel and 747.56 without: 763.56 - 523.56 = 240 MiB. The traced residuals' worst is +4.6%
    (emulated) and -2.4% (not): 5% and 3%."""
    out = fit_constants.compute()["constants"]
    assert out["CONTEXT_LAZY_INIT"]["fitted"] == 524 * MiB
    assert out["LAZY_TRAINING_KERNELS"]["fitted"] == 240 * MiB
    assert out["traced_cuda_sigma"]["fitted"] == pytest.approx(0.05)
    assert out["traced_cuda_floor_sigma"]["fitted"] == pytest.approx(0.03)


def test_a_holdout_file_never_moves_a_constant(tmp_path):
    names = sorted(fit_constants.fit_set(RESULTS))
    for n in names:
        shutil.copy(RESULTS / n, tmp_path / n)
    (tmp_path / "FIT_SET").write_text("\n".join(names) + "\n")
    doc = json.loads((RESULTS / names[0]).read_text())
    for run in (r for r in doc["runs"] if r["status"] == "ok"):  # a holdout: context x 10
        run["context"]["context_bytes"] *= 10
        run.get("measured", {})["device_used_after"] = 10**12
    (tmp_path / "holdout.json").write_text(json.dumps(doc))
    assert fit_constants.compute(tmp_path)["constants"] == fit_constants.compute()["constants"]
    (tmp_path / "FIT_SET").write_text("holdout.json\n")
    moved = fit_constants.compute(tmp_path)["constants"]
    assert moved["CONTEXT_LAZY_INIT"]["fitted"] == 5236 * MiB    # 10 x 523.56 MiB, the file read


def test_a_fit_set_naming_no_file_exits_2(tmp_path, capsys):
    (tmp_path / "FIT_SET").write_text("# nothing yet\nmissing.json\n")
    assert fit_constants.main(["--dir", str(tmp_path)]) == 2
    assert "names no results file" in capsys.readouterr().err
