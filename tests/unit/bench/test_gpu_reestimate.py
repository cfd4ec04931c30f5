"""The estimator against real GPU measurements, in CI: bench/gpu_reestimate.py re-estimates every
run of the committed results files (bench/results/gpu, measured on an H200 by bench/gpu_truth.py)
on this CPU and compares each with what the GPU measured, not with the estimate recorded there;
each run's error must stay near the one recorded in bench/results/gpu/reestimate_expected.json
(written by ``gpu_reestimate.py --write-expected``), fit set and holdout apart."""

from __future__ import annotations

import json
import sys

import pytest

from tests.helpers import ROOT

BENCH = ROOT / "bench"
RESULTS = BENCH / "results" / "gpu"
sys.path.insert(0, str(BENCH))

import _reestimate_expected  # noqa: E402
import gpu_reestimate  # noqa: E402

EXPECTED = RESULTS / "reestimate_expected.json"


@pytest.mark.slow
def test_every_committed_gpu_run_keeps_its_recorded_error(tmp_path, capsys):
    """All runs of every results file, re-estimated; a run's error (predicted / measured - 1 per
    metric) may move from its recorded one by max(1 point, half the recorded error): beyond that
    an estimator change moved it, and the expectations are regenerated with the reason."""
    out = tmp_path / "rows.json"
    assert gpu_reestimate.main(["--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    expected = json.loads(EXPECTED.read_text())
    rows = {side: [(f"{r['file']}::{r['id']}", r) for r in doc[side]["rows"]]
            for side in ("fit", "holdout")}
    fits = gpu_reestimate.fit_set(RESULTS)
    for side, pairs in rows.items():
        assert pairs, side
        for key, row in pairs:
            assert (key.split("::")[0] in fits) == (side == "fit"), key
            assert "error" not in row["estimate_now"], row
            assert row["measured"]["allocated"] > 2**30, key  # GPU figures, not the CPU's
    # the committed files' run count, fit and holdout apart (a run added without regenerating
    # the expectations fails below, named)
    said = capsys.readouterr().out
    assert f"fit: {len(rows['fit'])} runs" in said and f"holdout: {len(rows['holdout'])} runs" in said
    made_with = {k: v for k, v in expected["made_with"].items() if v}
    here = _reestimate_expected.expectations({}, {})["made_with"]
    moved = _reestimate_expected.departures(expected, rows)
    assert not moved, (f"re-estimates moved from {EXPECTED.name} (made with {made_with}; here "
                       f"{here}); regenerate with `python bench/gpu_reestimate.py "
                       f"--write-expected {EXPECTED.relative_to(ROOT)}` if the change is meant:\n"
                       + "\n".join(moved))


def test_the_expectations_hold_every_committed_run_and_name_the_large_errors():
    """Cheap twin of the slow test: the expectations name each ok run of each committed file
    once, on the side FIT_SET puts its file, and each recorded error beyond 10% in its notes."""
    expected = json.loads(EXPECTED.read_text())
    fits = gpu_reestimate.fit_set(RESULTS)
    results = [p for p in sorted(RESULTS.glob("*.json")) if "runs" in json.loads(p.read_text())]
    assert {p.name for p in results} >= fits
    for path in results:
        side = "fit" if path.name in fits else "holdout"
        runs = [r for r in json.loads(path.read_text())["runs"] if r.get("status") == "ok"]
        assert runs, path.name
        for r in runs:
            assert f"{path.name}::{r['id']}" in expected[side], (side, path.name, r["id"])
    notes = "\n".join(expected["notes"])
    for side in ("fit", "holdout"):
        for key, rec in expected[side].items():
            for metric, err in rec["error"].items():
                if err is not None and abs(err) > 0.10:
                    assert f"{side} {key}: recorded error" in notes and f"{metric} {err:+.1%}" in notes


def test_a_moved_error_is_named_with_its_allowance():
    """departures: a 2-point move of a 1% error is beyond max(1 point, 0.5%); 10 points of a
    -30% error are within max(1 point, 15 points); a run added or gone is named."""
    rec = {"measured": {"allocated": 3 * 2**30, "reserved": None, "device_used": None},
           "error": {"allocated": 0.01, "reserved": None, "device_used": None}}
    t5 = {"measured": {"allocated": 5 * 2**30, "reserved": None, "device_used": None},
          "error": {"allocated": -0.30, "reserved": None, "device_used": None}}
    expected = {"fit": {"a::x": rec}, "holdout": {"b::t5": t5, "b::gone": t5}}
    now = {"fit": [("a::x", {"measured": rec["measured"],
                             "now": {"allocated": 0.03, "reserved": None, "device_used": None}})],
           "holdout": [("b::t5", {"measured": t5["measured"],
                                  "now": {"allocated": -0.20, "reserved": None,
                                          "device_used": None}}),
                       ("b::new", {"measured": t5["measured"], "now": t5["error"]})]}
    moved = _reestimate_expected.departures(expected, now)
    assert moved == ["fit: a::x: allocated error +3.00%, recorded +1.00% (allowed +-1.00%)",
                     "holdout: b::new is not in the expectations (regenerate them)",
                     "holdout: b::gone was not re-estimated (regenerate the expectations)"]


def test_a_missing_results_file_is_named_with_exit_2(tmp_path, capsys):
    assert gpu_reestimate.main([str(tmp_path / "nope.json")]) == 2
    assert "nope.json" in capsys.readouterr().err


def test_the_fit_set_names_committed_files_only():
    """FIT_SET decides which files constants may be fitted on; each name it lists is a file."""
    names = gpu_reestimate.fit_set(BENCH / "results" / "gpu")
    assert names and all((BENCH / "results" / "gpu" / n).is_file() for n in names)
