"""bench/band_fit.py: the band's allocator and traced-CUDA sigmas fitted on GPU results files.
A synthetic results file with known residuals checks the statistics against figures worked out
by hand; the committed files (bench/results/gpu) must give a finite sigma for every term."""

from __future__ import annotations

import json
import math
import sys

import pytest

from hf_memkit._cuda.runtime import CALIBRATION
from tests.helpers import ROOT

BENCH = ROOT / "bench"
sys.path.insert(0, str(BENCH))

import band_fit  # noqa: E402

MiB, GiB = 2**20, 2**30
# cuBLAS workspaces on sm_90 (CublasHandlePool.cpp ":4096:8:16:8"): 32 MiB + 128 KiB per
# thread, forward and autograd threads
WORKSPACES = 2 * (32 * MiB + 128 * 1024)
PEAK = 10 * GiB
CONTEXT = 1 * GiB


def _record(rid: str, *, traced: int, resid: float, frag_pred: int, frag_meas: int,
            frag_fit: int, used: int, emulated: bool = True, capped: bool = False,
            status: str = "ok", flags: dict | None = None) -> dict:
    """A gpu_truth record whose estimate has ``traced`` traced bytes, predicts ``resid`` x
    traced more allocated than was measured, and the given fragmentations; its margin_terms are
    shares of the band the estimate would carry (emulated: CUDA sigma 10%, else 3%)."""
    cuda = 0.10 if emulated else 0.03
    sigmas = {"activations (traced)": traced * math.hypot(0.005, cuda),
              "CUDA context": 100 * MiB, "allocator": 0.35 * frag_fit}
    total = sum(s * s for s in sigmas.values())
    margin = int(2 * math.sqrt(total))
    measured_alloc = PEAK - round(resid * traced)
    measured = {"steady": {"max_allocated": measured_alloc,
                           "max_reserved": measured_alloc + frag_meas},
                "device_used": used, "device_used_basis": "nvml_used - nvml_used_before_cuda"}
    if capped:
        measured["at_required"] = {"cap": 0}
    return {
        "id": rid, "status": status, "flags": flags or {}, "measured": measured,
        "estimate": {"peak_allocated": PEAK, "peak_reserved": PEAK + frag_pred,
                     "device_used": used, "to_dict": {
                         "peak_allocated": PEAK, "peak_reserved": PEAK + frag_pred,
                         "device_used": used, "required": PEAK + frag_fit + CONTEXT,
                         "margin": margin,
                         "margin_terms": {k: int(margin * s * s / total)
                                          for k, s in sigmas.items()},
                         "device": {"compute_capability": [9, 0]},
                         "breakdown": {"weights": PEAK - traced - WORKSPACES
                                       - CALIBRATION.alloc_const,
                                       "activations": traced,
                                       "temporaries": WORKSPACES + CALIBRATION.alloc_const,
                                       "fragmentation": frag_pred, "context": CONTEXT}}}}


FIT_RUNS = [
    # fragmentation +50 MiB: +50% of the predicted, +100% of the at-fit, +1% of 5000 MiB
    _record("a", traced=GiB, resid=0.02, frag_pred=100 * MiB, frag_meas=150 * MiB,
            frag_fit=50 * MiB, used=5000 * MiB),
    # -20 MiB: -10%, -10%, -0.5% of 4000 MiB; the emulation does not act (floor)
    _record("b", traced=2 * GiB, resid=-0.01, frag_pred=200 * MiB, frag_meas=180 * MiB,
            frag_fit=200 * MiB, used=4000 * MiB, emulated=False),
    # left out: skipped, and a window without an optimizer step
    _record("skipped", traced=GiB, resid=0.5, frag_pred=MiB, frag_meas=900 * MiB,
            frag_fit=MiB, used=GiB, status="skipped"),
    _record("no-step", traced=GiB, resid=0.5, frag_pred=MiB, frag_meas=900 * MiB,
            frag_fit=MiB, used=GiB, flags={"window_without_optimizer_step": True}),
]
HOLDOUT_RUNS = [
    _record("c", traced=GiB, resid=0.0, frag_pred=100 * MiB, frag_meas=150 * MiB,
            frag_fit=100 * MiB, used=5000 * MiB),
    _record("d", traced=GiB, resid=0.0, frag_pred=100 * MiB, frag_meas=220 * MiB,
            frag_fit=100 * MiB, used=5000 * MiB),
    # reserved capped on purpose: its allocated counts, its fragmentation does not
    _record("e", traced=GiB, resid=0.03, frag_pred=100 * MiB, frag_meas=0,
            frag_fit=100 * MiB, used=5000 * MiB, capped=True),
]


def _rows(tmp_path) -> list[dict]:
    rows = []
    for name, side, runs in (("fit.json", "fit", FIT_RUNS), ("hold.json", "holdout",
                                                               HOLDOUT_RUNS)):
        path = tmp_path / name
        path.write_text(json.dumps({"environment": {"cuda": "13.0"}, "runs": runs}))
        got, failed = band_fit.read_rows(path, side)
        assert failed == []
        rows += got
    return rows


def test_rows_recover_traced_bytes_band_and_fragmentation(tmp_path):
    rows = {r["id"]: r for r in _rows(tmp_path)}
    assert set(rows) == {"a", "b", "c", "d", "e"}
    a, b, e = rows["a"], rows["b"], rows["e"]
    assert (a["traced"], b["traced"]) == (GiB, 2 * GiB)
    assert (a["emulated"], b["emulated"]) == (True, False)
    assert a["frag_measured"] == 150 * MiB and a["frag_err_bytes"] == 50 * MiB
    assert a["frag_at_fit"] == 50 * MiB
    assert a["frag_err_rel_frag"] == pytest.approx(0.5)
    assert a["frag_err_rel_at_fit"] == pytest.approx(1.0)
    assert a["frag_err_rel_used"] == pytest.approx(0.01)
    assert b["frag_err_rel_used"] == pytest.approx(-0.005)
    assert a["traced_residual"] == pytest.approx(0.02, abs=1e-9)
    assert a["band_sigmas_then"]["CUDA context"] == pytest.approx(100 * MiB, rel=1e-6)
    assert e["frag_measured"] is None and e["traced_residual"] == pytest.approx(0.03, abs=1e-9)


def test_fit_statistics_by_hand(tmp_path):
    res = band_fit.analyse(_rows(tmp_path))
    fit = res["fit"]
    assert (fit["runs"], fit["frag_compared"], fit["frag_nonzero"]) == (2, 2, 2)
    al = fit["allocator"]
    # RMS of (+0.5, -0.1) = sqrt(0.13); of (+1.0, -0.1) = sqrt(0.505); of (+1%, -0.5%)
    assert al["rel_frag"]["rms"] == pytest.approx(0.3605551, rel=1e-6)
    assert al["rel_frag"]["worst"] == pytest.approx(0.5)
    assert al["rel_frag"]["mean"] == pytest.approx(0.2)
    assert al["rel_at_fit"]["rms"] == pytest.approx(0.7106335, rel=1e-6)
    assert al["rel_used"]["rms"] == pytest.approx(0.0079057, rel=1e-5)
    assert al["rel_used"]["worst"] == pytest.approx(0.01)
    assert al["bytes"]["rms"] == pytest.approx(38.078866 * MiB, rel=1e-6)  # sqrt(1450) MiB
    assert al["bytes"]["positive"] == 1
    # geometric mean of the per-run sigma: sqrt(0.13) x sqrt(100 x 200) MiB
    assert al["rel_frag"]["geo_sigma"] == pytest.approx(50.990195 * MiB, rel=1e-6)
    tr = fit["traced"]
    assert tr["all"]["rms"] == pytest.approx(0.0158114, rel=1e-5)  # sqrt((4e-4 + 1e-4) / 2)
    assert tr["all"]["worst"] == pytest.approx(0.02, abs=1e-9)
    assert (tr["emulated"]["n"], tr["floor"]["n"]) == (1, 1)
    assert tr["floor"]["worst"] == pytest.approx(-0.01, abs=1e-9)
    assert res["fitted"]["traced_cuda_sigma"] == pytest.approx(0.02, abs=1e-9)
    assert res["fitted"]["traced_cuda_floor_sigma"] == pytest.approx(0.01, abs=1e-9)


def test_holdout_coverage_with_the_fitted_values(tmp_path):
    """c and d: 1 GiB traced, CUDA sigma 2% (the fit's) -> 1024 x hypot(0.5%, 2%) = 21.11 MiB;
    allocator sqrt(0.13) x 100 MiB = 36.06 MiB; 2 sigma = 83.6 MiB: +50 MiB within, +120 MiB
    out. With a constant 38.08 MiB: 2 sigma = 87.1 MiB, the same. e (capped) is not compared."""
    res = band_fit.analyse(_rows(tmp_path))
    hold = res["holdout"]
    assert (hold["runs"], hold["frag_compared"]) == (3, 2)
    for name in ("fitted_rel_frag", "fitted_bytes"):
        cov = hold["coverage"][name]
        assert (cov["within"], cov["n"], cov["misses"]) == (1, 2, ["d"]), name
        assert cov["fraction"] == pytest.approx(0.5)
    assert hold["traced"]["all"]["n"] == 3
    assert hold["traced"]["all"]["worst"] == pytest.approx(0.03, abs=1e-9)
    assert hold["allocator"]["rel_frag"]["rms"] == pytest.approx(math.sqrt((0.25 + 1.44) / 2))
    # the holdout never moves the fitted values
    assert res["fitted"]["allocator"]["rel_frag"] == pytest.approx(0.3605551, rel=1e-6)
    assert 0 <= hold["coverage"]["today"]["fraction"] <= 1


def test_committed_files_give_a_finite_sigma_for_each_term(tmp_path, capsys):
    out = tmp_path / "fit.json"
    assert band_fit.main(["--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["source"] == "recorded" and "fit" in doc["files"].values()
    fitted = doc["fitted"]
    for name, sigma in fitted["allocator"].items():
        assert sigma is not None and math.isfinite(sigma) and sigma > 0, name
    for key in ("traced_cuda_sigma", "traced_cuda_floor_sigma"):
        assert math.isfinite(fitted[key]) and 0 < fitted[key] < 1, key
    assert doc["fit"]["frag_compared"] > 10 and doc["holdout"]["runs"] > 0
    text = capsys.readouterr().out
    assert "| fit | allocator |" in text and "Fitted on the fit set" in text


def test_a_missing_results_file_exits_2(tmp_path, capsys):
    assert band_fit.main([str(tmp_path / "nope.json")]) == 2
    assert "nope.json" in capsys.readouterr().err
