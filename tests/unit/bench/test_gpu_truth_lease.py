"""bench/gpu_truth.py inside one device lease (issue 43): the priority order a deadline cuts from
the tail of, ``--deadline-s``'s bookkeeping, and the allocator options a case carries into its
processes and its estimate. The whole deadline-cut run: tests/integration/test_gpu_truth_runs.py.
"""

from __future__ import annotations

import json
import os
import sys
import time

import pytest

from tests.helpers import ROOT

sys.path.insert(0, str(ROOT / "bench"))

import _gpu_cases  # noqa: E402
import gpu_truth  # noqa: E402
from _gpu_cases import Case, priority, select  # noqa: E402

EXPANDABLE = "expandable_segments:True"


def test_priority_puts_the_answers_we_lack_first_and_keeps_matrix_order_within_a_group():
    ordered = select(order="priority")
    assert sorted(c.id for c in ordered) == sorted(c.id for c in select())
    ranks = [priority(c)[0] for c in ordered]
    assert ranks == sorted(ranks)
    head = [priority(c)[1] for c in ordered]
    # every smallest-capacity measurement (bisections, then the at-required fit tests) first
    n_capacity = sum(c.bisect or c.at_required for c in _gpu_cases.CASES)
    assert n_capacity >= 6 + 4 and set(head[:n_capacity]) == {"smallest capacity"}
    assert ordered[0].bisect and ordered[5].bisect
    # then QLoRA / 8-bit, TRL (GRPO included), Liger, expandable segments, and the rest last
    later = [g for g in head[n_capacity:]]
    firsts = list(dict.fromkeys(later))
    assert firsts == ["bitsandbytes", "TRL", "Liger", "expandable segments",
                      "long context / pretrained load", "the rest"], firsts
    grpo = [i for i, c in enumerate(ordered) if c.trainer == "grpo"]
    rest = head.index("the rest")
    assert grpo and max(grpo) < rest
    # inside a group, the matrix's order
    matrix = [c.id for c in _gpu_cases.CASES]
    for name in set(head):
        ids = [c.id for c in ordered if priority(c)[1] == name]
        assert ids == sorted(ids, key=matrix.index), name


def test_select_refuses_an_unknown_order():
    with pytest.raises(ValueError, match="order `fastest`"):
        select(order="fastest")


def test_deadline_expects_the_longest_case_of_its_kind_and_cuts_the_timeout():
    bisect = next(c for c in _gpu_cases.CASES if c.bisect)
    plain = next(c for c in _gpu_cases.CASES if not c.bisect)
    clock = gpu_truth.Deadline(100.0, time.perf_counter() - 70.0)  # 30 s left
    assert 29.0 < clock.left() <= 30.0
    assert clock.allows(plain) and not clock.allows(bisect)  # first guesses: 20 s and 40 s
    clock.took(plain, 12.0)
    clock.took(plain, 31.0)
    clock.took(plain, 8.0)
    assert clock.expected(plain) == 31.0 and not clock.allows(plain)
    clock.took(bisect, 5.0)
    assert clock.expected(bisect) == 5.0 and clock.allows(bisect)
    assert 29.0 < clock.timeout(120.0) <= 30.0 and clock.timeout(10.0) == 10.0
    late = gpu_truth.Deadline(10.0, time.perf_counter() - 60.0)
    assert late.timeout(120.0) == 1.0 and not late.allows(plain)
    free = gpu_truth.Deadline(None, time.perf_counter() - 1e6)
    assert free.allows(bisect) and free.timeout(120.0) == 120.0


@pytest.mark.parametrize("bad", ["0", "-5"])
def test_a_deadline_of_no_time_is_refused_with_exit_2(bad, capsys):
    assert gpu_truth.main(["--deadline-s", bad, "--list"]) == 2
    out = capsys.readouterr().out
    assert f"--deadline-s must be more than 0 seconds, got {bad}" in out and "540" in out


def test_expandable_cases_pair_with_a_step_measured_without_them():
    cases = [c for c in _gpu_cases.CASES if c.alloc_conf]
    assert len(cases) >= 2 and all(c.alloc_conf == EXPANDABLE for c in cases)
    for c in cases:
        assert ".expandable." in c.id
        twin = Case.from_dict({**c.to_dict(), "alloc_conf": None})
        assert twin.id in {x.id for x in _gpu_cases.CASES}, twin.id


def test_child_env_sets_the_case_s_allocator_options_and_no_one_else_s(monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:64")
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "garbage_collection_threshold:0.6")
    plain = gpu_truth.child_env(False, pin="GPU-x")
    assert "PYTORCH_CUDA_ALLOC_CONF" not in plain and "PYTORCH_ALLOC_CONF" not in plain
    env = gpu_truth.child_env(False, pin="GPU-x", alloc_conf=EXPANDABLE)
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == EXPANDABLE and "PYTORCH_ALLOC_CONF" not in env


def test_the_estimate_reads_the_case_s_allocator_options_and_restores_the_user_s(monkeypatch):
    """gpu_truth.estimate (also what bench/gpu_reestimate.py calls in one process) makes the
    estimate under the case's PYTORCH_CUDA_ALLOC_CONF: with expandable segments the allocator
    model maps pages instead of caching blocks, and says so in its notes."""
    import hf_memkit as mk

    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:64")
    device = mk.get_device("H100-80GB").to_dict()
    base = next(c for c in _gpu_cases.CASES if c.alloc_conf).to_dict()
    on = gpu_truth.estimate(Case.from_dict(base), True, device=device)
    off = gpu_truth.estimate(Case.from_dict({**base, "alloc_conf": None}), True, device=device)
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:64"
    assert "error" not in on and "error" not in off, (on.get("error"), off.get("error"))
    assert on["peak_allocated"] == off["peak_allocated"]
    assert on["to_dict"] != off["to_dict"]
    text = str(on["to_dict"]).lower()
    assert "expandable" in text, text[:2000]


def _listed_ids(capsys, *argv: str) -> list[str]:
    assert gpu_truth.main([*argv, "--list"]) == 0
    return [ln.split("  ")[0] for ln in capsys.readouterr().out.splitlines() if " stage=" in ln]


def test_resume_leaves_out_what_an_earlier_file_holds(tmp_path, capsys):
    every = _listed_ids(capsys)
    first = tmp_path / "first.json"
    first.write_text(json.dumps({"runs": [{"id": i, "status": s} for i, s in
                                          zip(every[:5], ["ok", "oom", "error", "timeout",
                                                          "skipped"], strict=True)]}))
    assert _listed_ids(capsys, "--resume", str(first)) == every[5:]
    first.write_text(json.dumps({"runs": [{"id": i, "status": "ok"} for i in every]}))
    assert gpu_truth.main(["--resume", str(first)]) == 0
    assert "nothing left to run" in capsys.readouterr().out
    first.write_text("{not json")
    assert gpu_truth.main(["--resume", str(first)]) == 2
    assert f"--resume {first}: not a result file" in capsys.readouterr().out


def test_a_packed_sft_case_trains_packed_rows_and_estimates_from_their_lengths():
    (case,) = [c for c in _gpu_cases.CASES if c.row_lens]
    assert case.trainer == "sft" and ".packed-700-300-520-180." in case.id
    again = Case.from_dict(json.loads(json.dumps(case.to_dict())))  # as the child gets it
    assert again == case and isinstance(again.row_lens, tuple)
    # enough rows of the shortest length to fill batch x accum x (steps + 1) sequences
    n = gpu_truth.n_rows(case)
    assert n == -(-case.batch * (case.steps + 1) * 1024 // 180) == 92
    assert case.rows(6) == [700, 300, 520, 180, 700, 300]
    assert gpu_truth.memory_args(case, {"max_length", "packing"})["packing"] is True
    kw = gpu_truth.estimate_kwargs(case, False)
    assert kw["seq_len"] is None and kw["lengths"] == case.rows(n) and kw["trainer"] == "sft"
    small = gpu_truth.shrunk(case, True)
    assert small.seq_len == 32 and max(small.row_lens) <= 32


@pytest.mark.parametrize("kw, message", [
    ({"row_lens": (100,)}, "trainer 'sft'"),
    ({"trainer": "sft", "row_lens": (2000,)}, "each row at most seq_len"),
    ({"trainer": "sft", "row_lens": ()}, "row_lens are SFT rows"),
])
def test_packing_needs_sft_rows_that_fit(kw, message):
    with pytest.raises(ValueError, match=message):
        Case("llama-160m", "amp_bf16", **kw)


def test_a_completion_only_sft_case_masks_the_prompt_and_tells_the_estimate():
    (case,) = [c for c in _gpu_cases.CASES if c.completion_only]
    assert case.trainer == "sft" and ".completion256." in case.id
    (row,) = gpu_truth.examples(case, 1000, 1)
    assert row["completion_mask"].tolist() == [0] * 768 + [1] * 256
    assert gpu_truth.memory_args(case, {"max_length"})["completion_only_loss"] is True
    assert gpu_truth.estimate_kwargs(case, False)["completion_len"] == 256
    with pytest.raises(ValueError, match="completion_only is the completion's share"):
        Case("llama-160m", "amp_bf16", trainer="dpo", completion_only=100)
    with pytest.raises(ValueError, match="between 0 and seq_len"):
        Case("llama-160m", "amp_bf16", trainer="sft", completion_only=1024)
