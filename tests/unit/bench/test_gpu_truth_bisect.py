"""bench/gpu_truth.py's bisect cases: the smallest allocator capacity at which a step completes
(``bench/_gpu_bisect.py``), on the CPU. The search is driven by predicates of known threshold
(monotone, noisy, never or always completing, failing otherwise); the parent's plumbing by a
fake child process; the child's capped run by ``--cpu-smoke``'s fake OOM. The real cases on a
GPU: ``python bench/gpu_truth.py --only .bisect.`` (DEVELOPERS.md)."""

from __future__ import annotations

import json
import sys

import pytest

from hf_memkit._units import GiB, MiB
from tests.helpers import ROOT

sys.path.insert(0, str(ROOT / "bench"))

import _gpu_bisect as gb  # noqa: E402
import _gpu_cases  # noqa: E402
import gpu_truth  # noqa: E402

LOWER, UPPER = 4 * GiB, 8 * GiB


def threshold(t: int, below: str = gb.OOM):
    """A monotone predicate: completes at ``t`` bytes and above; counts its calls."""
    calls: list[int] = []

    def probe(cap: int) -> dict:
        calls.append(cap)
        return {"outcome": gb.COMPLETED if cap >= t else below}

    probe.calls = calls  # type: ignore[attr-defined]
    return probe


@pytest.mark.parametrize("t", [LOWER + 3 * MiB, 5 * GiB + 123 * MiB, 6 * GiB, 7 * GiB + 1,
                               UPPER - 5 * MiB])
def test_a_monotone_threshold_is_found_within_the_resolution(t):
    probe = threshold(t)
    r = gb.bisect_capacity(probe, LOWER, UPPER, probes=30, resolution=8 * MiB)
    assert r["result"] == gb.FOUND and r["monotone"]
    assert r["largest_failing"] < t <= r["smallest_completing"]
    assert r["resolution"] == r["smallest_completing"] - r["largest_failing"] <= 8 * MiB
    assert all(c % gb.GRANULARITY == 0 for c in probe.calls[:-1])  # midpoints on 2 MiB
    assert len(r["probes"]) == len(probe.calls) <= 30 + 1
    assert [p["capacity"] for p in r["probes"]] == probe.calls
    assert r["lower_bound"] == LOWER and r["upper_bound"] == UPPER


def test_five_probes_halve_the_bracket_five_times():
    r = gb.bisect_capacity(threshold(5 * GiB + 300 * MiB), LOWER, UPPER, probes=5)
    assert r["result"] == gb.FOUND and len(r["probes"]) == 5
    assert r["resolution"] <= (UPPER - LOWER) // 2**5 + gb.GRANULARITY
    assert r["largest_failing"] < 5 * GiB + 300 * MiB <= r["smallest_completing"]


def test_a_step_that_always_completes_is_reported_below_the_lower_bound():
    probe = threshold(0)
    r = gb.bisect_capacity(probe, LOWER, UPPER, probes=5)
    assert r["result"] == gb.BELOW_LOWER
    assert probe.calls[-1] == LOWER and len(probe.calls) == 6  # the lower bound, once
    assert r["smallest_completing"] == LOWER and r["largest_failing"] is None
    assert r["resolution"] is None and r["monotone"]


def test_a_step_that_never_completes_is_reported_above_the_upper_bound():
    probe = threshold(10**15)
    r = gb.bisect_capacity(probe, LOWER, UPPER, probes=5)
    assert r["result"] == gb.ABOVE_UPPER
    assert probe.calls[-1] == UPPER and len(probe.calls) == 6  # the upper bound, once
    assert r["smallest_completing"] is None and r["largest_failing"] == UPPER


def test_timeouts_count_as_not_completing():
    r = gb.bisect_capacity(threshold(6 * GiB, below=gb.TIMEOUT), LOWER, UPPER, probes=30)
    assert r["result"] == gb.FOUND and r["smallest_completing"] >= 6 * GiB
    assert r["timeouts"] == sum(p["outcome"] == gb.TIMEOUT for p in r["probes"]) > 0


def test_a_probe_that_fails_otherwise_stops_the_search():
    calls = []

    def probe(cap):
        calls.append(cap)
        return {"outcome": gb.COMPLETED} if len(calls) == 1 else {"outcome": gb.ERROR,
                                                                  "error": "boom"}

    r = gb.bisect_capacity(probe, LOWER, UPPER, probes=5)
    assert r["result"] == gb.FAILED and len(calls) == 2
    assert r["probes"][-1]["error"] == "boom"
    # a probe that says nothing is an error too
    r = gb.bisect_capacity(lambda cap: {}, LOWER, UPPER, probes=5)
    assert r["result"] == gb.FAILED and r["probes"][0]["outcome"] == gb.ERROR


def test_a_noisy_capacity_is_never_the_answer_once_it_failed():
    """Capacities in [5, 6) GiB complete the first time only: the search settles on 5 GiB, the
    confirmation fails there, and the answer is the next capacity that completed above every
    failure (6 GiB), flagged as not monotone."""
    seen: set[int] = set()

    def flaky(cap):
        first = cap not in seen
        seen.add(cap)
        ok = cap >= 6 * GiB or (cap >= 5 * GiB and first)
        return {"outcome": gb.COMPLETED if ok else gb.OOM}

    r = gb.bisect_capacity(flaky, LOWER, UPPER, probes=3, confirm=1)
    caps = [(p["capacity"] / GiB, p["outcome"]) for p in r["probes"]]
    assert caps == [(6, "completed"), (5, "completed"), (4.5, "oom"), (5, "oom")]
    assert r["result"] == gb.FOUND and r["smallest_completing"] == 6 * GiB
    assert r["smallest_seen_completing"] == 5 * GiB and r["largest_failing"] == 5 * GiB
    assert not r["monotone"] and r["contradictions"] == [[5 * GiB, 5 * GiB]]
    # without the confirmation the same search answers 5 GiB, monotone as far as it saw
    seen.clear()
    r = gb.bisect_capacity(flaky, LOWER, UPPER, probes=3)
    assert r["smallest_completing"] == 5 * GiB and r["monotone"]
    # a confirmation that completes changes nothing
    r = gb.bisect_capacity(threshold(6 * GiB), LOWER, UPPER, probes=4, confirm=2)
    assert r["monotone"] and r["probes"][-1]["capacity"] == r["smallest_completing"]
    assert len(r["probes"]) == 5


def test_the_verdict_of_a_non_monotone_record():
    probes = [{"capacity": c, "outcome": o} for c, o in
              ((5, gb.COMPLETED), (6, gb.OOM), (7, gb.COMPLETED), (4, gb.OOM), (9, gb.ERROR))]
    v = gb.verdict(probes)
    assert v["smallest_completing"] == 7 and v["largest_failing"] == 6
    assert v["resolution"] == 1 and v["smallest_seen_completing"] == 5
    assert not v["monotone"] and v["contradictions"] == [[6, 5]]
    v = gb.verdict([{"capacity": 5, "outcome": gb.COMPLETED}, {"capacity": 7, "outcome": gb.OOM}])
    assert v["smallest_completing"] is None and v["largest_failing"] == 7


def _estimate(alloc=5 * GiB, required=6 * GiB, used=6 * GiB + 100 * MiB, upper=7 * GiB,
              context=500 * MiB, margin=900 * MiB):
    d = {"peak_allocated": alloc, "peak_reserved": used - context, "device_used": used,
         "required": required, "upper": upper, "margin": margin,
         "breakdown": {"context": context}, "device": {"total_memory": 80 * GiB}}
    return {"peak_allocated": alloc, "peak_reserved": used - context, "device_used": used,
            "to_dict": d}


def test_search_bounds_bracket_the_estimate_in_allocator_bytes():
    b = gb.search_bounds(_estimate(upper=6 * GiB), 80 * GiB)
    assert b["lower"] == int(5 * GiB * 0.95) // (2 * MiB) * (2 * MiB)
    # max(upper, device_used x 1.1), less the context, rounded up to 2 MiB: here device_used's
    assert b["upper"] == -(-int((6 * GiB + 100 * MiB - 500 * MiB) * 1.1) // (2 * MiB)) * 2 * MiB
    assert b["estimate_context"] == 500 * MiB and b["target_resolution"] >= 2 * MiB
    assert gb.search_bounds(_estimate(upper=20 * GiB), 80 * GiB)["upper"] == 20 * GiB - 500 * MiB
    small = gb.search_bounds(_estimate(), 4 * GiB)  # never above the device
    assert small["upper"] == 4 * GiB and small["lower"] < small["upper"]


def test_compare_adds_the_measured_context_and_says_whether_required_completes():
    search = {"smallest_completing": 5 * GiB + 624 * MiB, "largest_failing": 5 * GiB + 524 * MiB}
    c = gb.compare(search, _estimate(), [520 * MiB, None, 480 * MiB, 500 * MiB])
    assert c["context_measured"] == 500 * MiB and c["context_basis"].startswith("measured")
    assert c["found_device"] == 6 * GiB + 100 * MiB
    assert c["rel_error"] == pytest.approx(6 * GiB / (6 * GiB + 100 * MiB) - 1)
    assert c["estimate_capacity"] == 6 * GiB - 500 * MiB
    assert c["capacity_rel_error"] == pytest.approx((6 * GiB - 500 * MiB) / (5 * GiB + 624 * MiB)
                                                    - 1)
    assert c["required_completes"] is False  # 5 GiB + 524 MiB: a capacity that failed
    assert gb.compare({**search, "smallest_completing": 5 * GiB + 100 * MiB,
                       "largest_failing": 5 * GiB}, _estimate(), [])["required_completes"]
    inside = gb.compare({"smallest_completing": 5 * GiB + 624 * MiB,
                         "largest_failing": 5 * GiB + 400 * MiB}, _estimate(), [])
    assert inside["required_completes"] is None  # in the bracket
    assert c["outside_measured"] is None and c["rel_error_outside"] is None  # no probes given
    done = {"outcome": gb.COMPLETED, "device_used": 6 * GiB, "max_reserved": 5 * GiB + 400 * MiB}
    c = gb.compare({**search, "probes": [done, {**done, "outcome": gb.OOM}]}, _estimate(), [])
    assert c["outside_measured"] == 624 * MiB
    assert c["rel_error_outside"] == pytest.approx(6 * GiB / (6 * GiB + 224 * MiB) - 1)
    assert inside["context_measured"] is None and inside["found_device"] == 6 * GiB + 100 * MiB
    assert gb.compare({"smallest_completing": None, "largest_failing": 9 * GiB},
                      _estimate(), [])["rel_error"] is None


# ---------------------------------------------------------------------------- the harness
def test_bisect_cases_come_first_and_cover_what_they_should():
    cases = _gpu_cases.CASES
    n = sum(c.bisect for c in cases)
    assert 5 <= n <= 8 and all(c.bisect for c in cases[:n])
    b = cases[:n]
    assert all(c.steps == 2 and ".bisect." in c.id for c in b)
    assert any(c.precision == "fp32" and c.method == "full" for c in b)
    assert any(c.precision == "amp_bf16" and c.ckpt for c in b)
    assert any(c.method == "lora" for c in b) and any(c.family == "qwen2" for c in b)
    assert any(c.accum > 1 for c in b)
    assert all(not c.needs or c.needs == ("peft",) for c in b)  # run on the bare GPU machine
    assert [c.id for c in _gpu_cases.select([".bisect."])] == [c.id for c in b]
    with pytest.raises(ValueError, match="not both"):
        _gpu_cases.Case("llama-160m", "fp32", bisect=True, at_required=True)


CASE = "llama-160m.amp_bf16.adamw_torch_fused.sdpa.ckpt.2steps.bisect.b8s1024"


def _fake_child(t: int, context: int = 500 * MiB, errors: dict | None = None):
    """run_child of a probe: completes at ``t`` and above, OOM below; ``errors``: capacity ->
    (returncode, stderr) of a child that dies without a record."""
    seen = []

    def run_child(flag, *, timeout, smoke, pin=None, alloc_conf=None):
        cap = int(flag[flag.index("--capacity") + 1])
        seen.append((cap, flag, pin))
        if errors and cap in errors:
            rc, err = errors[cap]
            return {"context": {"context_bytes": context}}, rc, err, 1.0
        parts = {"context": {"context_bytes": context, "nvml_source": "fake"}}
        if cap >= t:
            parts["measured"] = {"steady": {"max_allocated": 5 * GiB, "max_reserved": cap,
                                            "num_alloc_retries": 2, "num_ooms": 0},
                                 "whole_run": {"max_allocated": 5 * GiB, "max_reserved": cap},
                                 "device_used": cap + context}
        else:
            parts["oom"] = {"oom": {"error": "CUDA out of memory. Tried to allocate 2.00 GiB.",
                                    "during": "step 2 of 2"},
                            "peak_so_far": {"max_allocated": 5 * GiB, "max_reserved": cap},
                            "device_used_so_far": None}
        return parts, 0, "", 5.0

    run_child.seen = seen  # type: ignore[attr-defined]
    return run_child


def _args(*extra):
    return gpu_truth.parser().parse_args(["--probe-timeout", "30", *extra])


def test_a_bisect_case_records_probes_capacity_and_the_estimate(monkeypatch, capsys):
    case = _gpu_cases.select([CASE])[0]
    t = 5 * GiB + 700 * MiB
    child = _fake_child(t)
    monkeypatch.setattr(gpu_truth, "run_child", child)
    env = {"total_memory": 80 * GiB, "device": {}}
    pin = {"cuda_visible_devices": "GPU-x", "uuid": "GPU-x", "name": "H"}
    rec = gpu_truth.run_bisect_case(case, env, _args(), pin=pin, ready=_estimate())
    assert rec["status"] == "ok" and rec["kind"] == "bisect" and rec["measured"] is None
    b = rec["bisect"]
    assert b["result"] == gb.FOUND and b["largest_failing"] < t <= b["smallest_completing"]
    assert len(b["probes"]) == 5 and b["probe_timeout"] == 30
    for p, (cap, flag, seen_pin) in zip(b["probes"], child.seen, strict=True):
        assert p["capacity"] == cap and p["fraction"] == pytest.approx(cap / (80 * GiB))
        assert p["outcome"] in (gb.COMPLETED, gb.OOM) and "_context" not in p
        assert json.loads(flag[flag.index("--probe-one") + 1]) == case.to_dict()
        assert seen_pin == "GPU-x" and "--fake-threshold" not in flag
    assert {p["outcome"] for p in b["probes"]} == {gb.COMPLETED, gb.OOM}
    oom = next(p for p in b["probes"] if p["outcome"] == gb.OOM)
    assert oom["error"].startswith("CUDA out of memory") and oom["oom_during"] == "step 2 of 2"
    for k in ("required", "device_used", "upper", "margin"):
        assert b[k] == _estimate()["to_dict"][k]
    assert b["context_measured"] == 500 * MiB
    assert b["found_device"] == b["smallest_completing"] + 500 * MiB
    assert b["rel_error"] == pytest.approx(6 * GiB / b["found_device"] - 1)
    # device_used less max_reserved of the completed probes: 500 MiB here too
    assert b["outside_measured"] == 500 * MiB and b["rel_error_outside"] == b["rel_error"]
    assert [p["outside_allocator"] for p in b["probes"]] == [
        500 * MiB if p["outcome"] == gb.COMPLETED else None for p in b["probes"]]
    assert b["smallest_completing_fraction"] == pytest.approx(b["smallest_completing"] / 80 / GiB)
    assert rec["context"]["nvml_source"] == "fake"
    # the error table leaves it out; the bisect table and summary have it
    assert gpu_truth.summarise([rec])["allocated"]["n"] == 0
    s = gpu_truth.bisect_summary([rec])
    assert s["n"] == 1 and s["results"] == {"found": 1} and s["probes"] == 5
    assert s["median"] == pytest.approx(b["rel_error"])
    text = gpu_truth.render_bisect([rec])
    assert CASE in text and "found" in text and "required" in text
    assert "bisect found in 5 probes" in gpu_truth.progress_line(1, 1, rec)
    assert gpu_truth.render_bisect([]) == ""
    assert capsys.readouterr().out.count("      probe ") == 5  # one line a probe


def test_a_child_that_dies_of_a_cublas_alloc_failure_is_an_oom_others_stop_it(monkeypatch):
    case = _gpu_cases.select([CASE])[0]
    est = _estimate()
    b = gb.search_bounds(est, 80 * GiB)
    first = (b["lower"] + b["upper"]) // 2 // gb.GRANULARITY * gb.GRANULARITY
    cublas = (1, "RuntimeError: CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate")
    monkeypatch.setattr(gpu_truth, "run_child", _fake_child(0, errors={first: cublas}))
    rec = gpu_truth.run_bisect_case(case, {"total_memory": 80 * GiB}, _args(), ready=est)
    p = rec["bisect"]["probes"][0]
    assert p["outcome"] == gb.OOM and "CUBLAS_STATUS_ALLOC_FAILED" in p["error"]
    assert "stderr_tail" in p and rec["status"] == "ok"
    killed = (None, "")  # no returncode: the probe's timeout
    monkeypatch.setattr(gpu_truth, "run_child", _fake_child(0, errors={first: killed}))
    p = gpu_truth.run_bisect_case(case, {"total_memory": 80 * GiB}, _args(),
                                  ready=est)["bisect"]["probes"][0]
    assert p["outcome"] == gb.TIMEOUT and p["error"] == "timed out after 30 s"
    crash = (1, "Traceback ...\nValueError: bad config\n")
    monkeypatch.setattr(gpu_truth, "run_child", _fake_child(0, errors={first: crash}))
    rec = gpu_truth.run_bisect_case(case, {"total_memory": 80 * GiB}, _args(), ready=est)
    assert rec["status"] == "error" and rec["bisect"]["result"] == gb.FAILED
    assert "ValueError: bad config" in rec["error"] and len(rec["bisect"]["probes"]) == 1
    assert "-" in gpu_truth.render_bisect([rec])


def test_a_bisect_case_without_an_estimate_probes_nothing(monkeypatch):
    case = _gpu_cases.select([CASE])[0]
    monkeypatch.setattr(gpu_truth, "run_child", lambda *a, **k: pytest.fail("probed"))
    rec = gpu_truth.run_bisect_case(case, {"total_memory": 80 * GiB}, _args(),
                                    ready={"error": "TypeError: x"})
    assert rec["status"] == "error" and "no estimate" in rec["error"] and rec["bisect"] is None
    assert "no estimate" in gpu_truth.progress_line(1, 1, rec)
    assert gpu_truth.bisect_summary([rec])["cases"] == 1
    assert CASE in gpu_truth.render_bisect([rec])


def test_cpu_smoke_fakes_the_oom_below_its_threshold(monkeypatch, capsys, tmp_path):
    """The child of a probe under --cpu-smoke: the shrunk steps run on the CPU, then a capacity
    below the fake threshold raises torch's OutOfMemoryError through the OOM record."""
    monkeypatch.setenv("HF_MEMKIT_CACHE", str(tmp_path))
    case = _gpu_cases.select([CASE])[0]
    gpu_truth.probe_one(case, 1000, smoke=True, fake_threshold=2000)
    parts = gpu_truth.parse_markers(capsys.readouterr().out)
    assert set(parts) == {"context", "oom"}
    assert "fake OOM" in parts["oom"]["oom"]["error"] and parts["oom"]["oom"]["exception"] == \
        "OutOfMemoryError" and parts["oom"]["oom"]["during"] == "step 2 of 2"
    gpu_truth.probe_one(case, 2000, smoke=True, fake_threshold=2000)
    parts = gpu_truth.parse_markers(capsys.readouterr().out)
    assert set(parts) == {"context", "measured"} and parts["measured"]["steady"]["steps"] == 1


def test_negative_bisect_probes_are_refused_with_exit_2():
    assert gpu_truth.main(["--bisect-probes", "-1", "--list"]) == 2
