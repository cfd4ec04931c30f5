"""Fit the band's allocator term and traced-CUDA sigma on the committed GPU results files
(``bench/results/gpu/``), and report the holdout apart with the fitted values.

    python bench/band_fit.py [FILE ...] [--reestimate] [--only SUBSTR ...] [--out PATH] [--quick]

The band of a CUDA estimate (``hf_memkit/_estimate/device.py``, ``_band``) combines, as
independent errors, the traced term (traced bytes x hypot(CPU sigma, CUDA sigma)) and the
allocator term (``allocator_sigma`` x the fragmentation at the smallest capacity). This reads,
for each measured run (status ok, a window with an optimizer step, as ``_gpu_report.summarise``
keeps), the steady-state ``max_memory_allocated`` / ``max_memory_reserved`` and the estimate
recorded beside it on the GPU (or, with ``--reestimate``, today's estimate of the same setup on
this machine, as ``bench/gpu_reestimate.py`` makes it: slow, it builds every model), and
computes per run:

- measured fragmentation (reserved - allocated) and predicted (the estimate's
  ``breakdown['fragmentation']`` = peak_reserved - peak_allocated); the error of the prediction
  (measured - predicted) in bytes, relative to the predicted fragmentation, relative to the
  fragmentation at the smallest capacity (what ``allocator_sigma`` multiplies in the band) and
  relative to the estimate's device_used;
- the traced residual (estimated - measured allocated) / traced bytes, as the comment of
  ``CudaCalibration.traced_cuda_sigma`` defines it (traced bytes: activations + temporaries
  less the cuBLAS workspaces and ``alloc_const``, the band's "activations (traced)").

It fits on the files ``FIT_SET`` lists only: the allocator 1-sigma as the RMS (and the worst) of
the fragmentation error in each normalisation, and the traced CUDA sigma as the RMS and the worst
of the traced residual. The holdout files get the same statistics, and the fraction of their runs
whose |measured - predicted| reserved lies within the 2-sigma band the fitted terms give (traced
and allocator terms: the context does not enter reserved), for each normalisation of the
allocator term and for today's constants. Reserved is left out where the run capped it on
purpose (``at_required``), as the error table does.

Runs that do not count (``run_row``) are listed with the results (``excluded``), never dropped
unseen. ``--quick``: the recorded estimates already take seconds; with ``--reestimate``, one run
per file (the first that counts).

Deterministic; plain JSON in (no GPU; ``--reestimate`` builds models on the CPU). Exit status 0,
or 1 where ``--reestimate`` failed for some run, 2 for a missing file.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _gpu_report import measured_values  # noqa: E402
from _quick import add_flag, guard  # noqa: E402
from gpu_reestimate import fit_set  # noqa: E402

from hf_memkit._cuda.runtime import CALIBRATION, cublas_workspaces  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "gpu"
MiB = 2**20
# the normalisations of the allocator term's error: what 1 sigma is a fraction of
ALLOCATOR_SCALES = {
    "rel_frag": "predicted fragmentation (peak_reserved - peak_allocated)",
    "rel_at_fit": "fragmentation at the smallest capacity (what allocator_sigma multiplies)",
    "rel_used": "the estimate's device_used (an absolute-bytes sigma, scaled by the run's size)",
    "bytes": "none: a constant number of bytes",
}
SCALE_KEY = {"rel_frag": "frag_predicted", "rel_at_fit": "frag_at_fit",
             "rel_used": "device_used_predicted", "bytes": None}


# --- one run -------------------------------------------------------------------------------------

def term_sigmas(est: dict[str, Any]) -> dict[str, float]:
    """1-sigma bytes of each band term from the estimate's ``margin_terms``: each is the margin
    split in proportion to the terms' variances (``assemble._shares``), margin = 2 sqrt(sum of
    variances), so sigma_i = sqrt(share_i x margin) / 2."""
    margin = est.get("margin") or 0
    return {k: math.sqrt(max(0, v) * margin) / 2 for k, v in (est.get("margin_terms") or {}).items()}


def workspace_bytes(est: dict[str, Any], env: dict[str, Any]) -> int:
    """The cuBLAS workspaces the estimate adds to temporaries, for the run's GPU and
    ``CUBLAS_WORKSPACE_CONFIG`` (the environment the file recorded)."""
    cc = (est.get("device") or {}).get("compute_capability")
    keep = {k: str(env[k]) for k in ("CUBLAS_WORKSPACE_CONFIG", "TORCH_CUBLASLT_UNIFIED_WORKSPACE",
                                     "CUBLASLT_WORKSPACE_SIZE") if env.get(k) is not None}
    return cublas_workspaces(tuple(cc) if cc else None, env=keep).total


def traced_bytes(est: dict[str, Any], env: dict[str, Any]) -> int:
    """Activations and traced temporaries: the band's traced term (``device_terms`` adds the
    workspaces and ``alloc_const`` to temporaries after the trace)."""
    b = est["breakdown"]
    return (b.get("activations", 0) + b.get("temporaries", 0) - workspace_bytes(est, env)
            - CALIBRATION.alloc_const)


def frag_at_fit(est: dict[str, Any]) -> int:
    """The fragmentation at the smallest capacity, from ``required`` = allocated + it + context
    (+ paged resident state), which holds for every estimate whatever its constants were."""
    b = est["breakdown"]
    return max(0, est["required"] - b.get("context", 0)
               - b.get("optimizer_paged_resident", 0) - est["peak_allocated"])


def emulated(traced: int, sigmas: dict[str, float]) -> bool | None:
    """Whether the CUDA emulation acted on the step, read off the band the estimate carries: its
    traced term is traced x hypot(CPU sigma, CUDA sigma), with the floor sigma where it did not
    act. None where the band does not tell (a calibration's residuals, no traced bytes)."""
    sigma = sigmas.get("activations (traced)")
    if sigma is None or traced <= 0:
        return None
    cuda = math.sqrt(max(0.0, (sigma / traced) ** 2 - CALIBRATION.traced_cpu_sigma ** 2))
    return abs(cuda - CALIBRATION.traced_cuda_floor_sigma) > 0.1 * CALIBRATION.traced_cuda_floor_sigma


def _ratio(num: float, den: float) -> float | None:
    return num / den if den else None


def run_row(rec: dict[str, Any], env: dict[str, Any], file: str, side: str) -> dict[str, Any] | None:
    """The figures of one run, or None where it does not count (not ok, no optimizer step in
    its window, an estimate that failed, no steady allocated)."""
    if rec.get("status") != "ok" or (rec.get("flags") or {}).get("window_without_optimizer_step"):
        return None
    est = (rec.get("estimate") or {}).get("to_dict")
    meas = measured_values(rec)
    if not est or "error" in (rec.get("estimate") or {}) or not meas["allocated"]:
        return None
    traced = traced_bytes(est, env)
    sigmas = term_sigmas(est)
    row: dict[str, Any] = {
        "id": rec["id"], "file": file, "side": side, "emulated": emulated(traced, sigmas),
        "measured_allocated": meas["allocated"], "measured_reserved": meas["reserved"],
        "predicted_allocated": est["peak_allocated"], "predicted_reserved": est["peak_reserved"],
        "device_used_predicted": est["device_used"], "traced": traced,
        "traced_residual": _ratio(est["peak_allocated"] - meas["allocated"], traced),
        "frag_predicted": est["breakdown"].get("fragmentation", 0), "frag_at_fit": frag_at_fit(est),
        "band_sigmas_then": {k: int(v) for k, v in sigmas.items()},
    }
    if meas["reserved"] is None:  # capped on purpose: no fragmentation to compare
        row.update(frag_measured=None, frag_err_bytes=None, reserved_err_bytes=None)
        return row
    row["frag_measured"] = meas["reserved"] - meas["allocated"]
    row["frag_err_bytes"] = err = row["frag_measured"] - row["frag_predicted"]
    row["reserved_err_bytes"] = meas["reserved"] - est["peak_reserved"]
    for name, key in SCALE_KEY.items():
        if key is not None:
            row[f"frag_err_{name}"] = _ratio(err, row[key])
    return row


# --- statistics ----------------------------------------------------------------------------------

def stats(values: list[float]) -> dict[str, Any]:
    """n, RMS (the 1-sigma of zero-mean errors), mean, median, worst (signed, largest
    magnitude), ``p68``: the 68th percentile of |error| (a 1-sigma the tails move less; nearest
    rank), ``positive``: how many are above 0 (measured above predicted, for fragmentation)."""
    if not values:
        return {"n": 0, "rms": None, "mean": None, "median": None, "worst": None, "p68": None,
                "positive": 0}
    mags = sorted(abs(v) for v in values)
    return {"n": len(values), "rms": math.sqrt(sum(v * v for v in values) / len(values)),
            "mean": sum(values) / len(values), "median": statistics.median(values),
            "worst": max(values, key=abs), "p68": mags[math.ceil(0.68 * len(mags)) - 1],
            "positive": sum(v > 0 for v in values)}


def _frag_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in rows if r.get("frag_err_bytes") is not None]


def allocator_stats(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The fragmentation error in each normalisation; with ``geo_sigma``: the geometric mean over
    runs of the per-run 1-sigma in bytes (RMS x the run's scale), which orders the
    normalisations by Gaussian likelihood (the RMS is the maximum-likelihood sigma of each, and
    the log-likelihood is then -sum(log sigma_i) - n/2): the smaller, the better it fits."""
    out = {}
    frows = _frag_rows(rows)
    for name, key in SCALE_KEY.items():
        pairs = [(r["frag_err_bytes"] if key is None else r.get(f"frag_err_{name}"),
                  1 if key is None else r[key]) for r in frows]
        pairs = [(e, s) for e, s in pairs if e is not None and s]
        s = stats([e for e, _ in pairs])
        if s["rms"]:
            s["geo_sigma"] = math.exp(sum(math.log(s["rms"] * sc) for _, sc in pairs) / len(pairs))
        out[name] = s
    return out


def traced_stats(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The traced residual over every run, the emulated ones and the others (floor)."""
    def of(keep: Any) -> dict[str, Any]:
        return stats([r["traced_residual"] for r in rows
                      if r["traced_residual"] is not None and keep(r)])

    return {"all": of(lambda r: True), "emulated": of(lambda r: r["emulated"] is not False),
            "floor": of(lambda r: r["emulated"] is False)}


def reserved_sigma(row: dict[str, Any], cuda_sigma: float, floor_sigma: float,
                   alloc_sigma: float, scale: str) -> float:
    """1-sigma bytes of the run's reserved under these constants: the traced term and the
    allocator term (``scale``: what ``alloc_sigma`` is a fraction of), as independent errors."""
    cuda = cuda_sigma if row["emulated"] is not False else floor_sigma
    traced = row["traced"] * math.hypot(CALIBRATION.traced_cpu_sigma, cuda)
    key = SCALE_KEY[scale]
    alloc = alloc_sigma * (1 if key is None else row[key])
    return math.hypot(traced, alloc)


def coverage(rows: list[dict[str, Any]], cuda_sigma: float, floor_sigma: float,
             alloc_sigma: float | None, scale: str) -> dict[str, Any]:
    """How many runs' |measured - predicted| reserved lies within 2 sigma."""
    frows = _frag_rows(rows)
    if alloc_sigma is None or not frows:
        return {"within": 0, "n": len(frows), "fraction": None, "misses": []}
    misses = [r["id"] for r in frows if abs(r["reserved_err_bytes"]) > 2 * reserved_sigma(
        r, cuda_sigma, floor_sigma, alloc_sigma, scale)]
    return {"within": len(frows) - len(misses), "n": len(frows),
            "fraction": (len(frows) - len(misses)) / len(frows), "misses": misses}


def fitted(fit_rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The constants the fit set gives: each allocator normalisation's RMS, the traced CUDA
    sigma (RMS over the emulated runs; the floor's over the others, today's floor where none)."""
    a, t = allocator_stats(fit_rows), traced_stats(fit_rows)
    return {"allocator": {k: v["rms"] for k, v in a.items()},
            "traced_cuda_sigma": t["emulated"]["rms"],
            "traced_cuda_floor_sigma": t["floor"]["rms"] or CALIBRATION.traced_cuda_floor_sigma}


def coverages(rows: list[dict[str, Any]], consts: dict[str, Any]) -> dict[str, Any]:
    """Coverage of reserved by the 2-sigma band: each fitted allocator normalisation with the
    fitted traced sigma, and today's constants."""
    cuda, floor = consts["traced_cuda_sigma"], consts["traced_cuda_floor_sigma"]
    out = {f"fitted_{k}": coverage(rows, cuda or 0.0, floor, v, k)
           for k, v in consts["allocator"].items()}
    out["today"] = coverage(rows, CALIBRATION.traced_cuda_sigma,
                            CALIBRATION.traced_cuda_floor_sigma, CALIBRATION.allocator_sigma,
                            "rel_at_fit")
    return out


def analyse(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Fit on the fit side, and report both sides with the fitted values."""
    sides = {s: [r for r in rows if r["side"] == s] for s in ("fit", "holdout")}
    consts = fitted(sides["fit"])
    out: dict[str, Any] = {"fitted": consts, "today": {
        "traced_cuda_sigma": CALIBRATION.traced_cuda_sigma,
        "traced_cuda_floor_sigma": CALIBRATION.traced_cuda_floor_sigma,
        "allocator_sigma": CALIBRATION.allocator_sigma, "allocator_scale": "rel_at_fit"}}
    for side, srows in sides.items():
        out[side] = {"runs": len(srows),
                     "frag_nonzero": sum(1 for r in srows if (r.get("frag_measured") or 0) > 0),
                     "frag_compared": len(_frag_rows(srows)),
                     "allocator": allocator_stats(srows), "traced": traced_stats(srows),
                     "coverage": coverages(srows, consts)}
    return out


# --- reading -------------------------------------------------------------------------------------

def read_rows(path: Path, side: str, reestimate: bool = False,
              only: list[str] | None = None) -> tuple[list[dict[str, Any]], list[str]]:
    """The rows of one results file (with today's estimates where ``reestimate``), and the ids
    whose re-estimate failed."""
    doc = json.loads(path.read_text())
    env = doc.get("environment") or {}
    rows, failed = [], []
    for rec in doc.get("runs", []):
        if only and not any(s in rec.get("id", "") for s in only):
            continue
        if reestimate and rec.get("status") == "ok":
            rec = _reestimated(rec, env)
            if "error" in rec["estimate"]:
                failed.append(rec["id"])
        row = run_row(rec, env, path.name, side)
        if row is not None:
            rows.append(row)
    return rows, failed


def _reestimated(rec: dict[str, Any], env: dict[str, Any]) -> dict[str, Any]:
    """The record with today's estimate of its setup, as bench/gpu_reestimate.py makes it."""
    import gpu_truth
    from _gpu_cases import Case

    device = ((rec.get("estimate") or {}).get("to_dict") or {}).get("device")
    if device is None:
        return {**rec, "estimate": {"error": "no recorded device"}}
    now = gpu_truth.estimate(Case.from_dict(rec["case"]), False, device=device,
                             cuda_version=env.get("cuda"))
    print(f"  re-estimated {rec['id']} ({now.get('seconds', 0):.0f} s)"
          + (f": {now['error'][:100]}" if "error" in now else ""), file=sys.stderr, flush=True)
    return {**rec, "estimate": now}


# --- printing ------------------------------------------------------------------------------------

def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:+.1f}%"


def _mib(x: float | None) -> str:
    return "-" if x is None else f"{x / MiB:.0f}"


def render(rows: list[dict[str, Any]], res: dict[str, Any]) -> str:
    """The per-run table and the summary, as markdown."""
    lines = ["| side | run | frag meas / pred / at fit (MiB) | frag err | / pred | / at fit | "
             "/ used | traced resid |", "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(
            f"| {r['side']} | {r['id']}{'' if r['emulated'] is not False else ' (floor)'} | "
            f"{_mib(r['frag_measured'])} / {_mib(r['frag_predicted'])} / {_mib(r['frag_at_fit'])} | "
            f"{_mib(r['frag_err_bytes'])} | {_pct(r.get('frag_err_rel_frag'))} | "
            f"{_pct(r.get('frag_err_rel_at_fit'))} | {_pct(r.get('frag_err_rel_used'))} | "
            f"{_pct(r['traced_residual'])} |")
    lines += ["", *summary_lines(res)]
    return "\n".join(lines)


def _stat_cell(s: dict[str, Any], fmt: Any) -> str:
    return (f"{fmt(s['rms']).lstrip('+')} / {fmt(s['worst'])} | {fmt(s['p68']).lstrip('+')} | "
            f"{fmt(s['mean'])} / {fmt(s['median'])} | {s['positive']}/{s['n']}")


def summary_lines(res: dict[str, Any]) -> list[str]:
    def fmt_for(name: str) -> Any:
        return (lambda x: "-" if x is None else f"{x / MiB:.0f} MiB") if name == "bytes" else _pct

    out = ["| side | term | normalised by | RMS / worst | p68 abs | mean / median | above 0 | "
           "geo-mean 1-sigma |", "| --- | --- | --- | --- | ---: | --- | ---: | ---: |"]
    for side in ("fit", "holdout"):
        for name, s in res[side]["allocator"].items():
            out.append(f"| {side} | allocator | {name}: {ALLOCATOR_SCALES[name]} | "
                       f"{_stat_cell(s, fmt_for(name))} | {_mib(s.get('geo_sigma'))} MiB |")
        for name, s in res[side]["traced"].items():
            out.append(f"| {side} | traced residual | traced bytes ({name}) | "
                       f"{_stat_cell(s, _pct)} | |")
    out += ["", "| side | band (2 sigma of traced + allocator) | reserved within | misses |",
            "| --- | --- | ---: | --- |"]
    for side in ("fit", "holdout"):
        for name, c in res[side]["coverage"].items():
            frac = "-" if c["fraction"] is None else f"{c['fraction']:.0%}"
            out.append(f"| {side} | {name} | {c['within']}/{c['n']} ({frac}) | "
                       f"{', '.join(c['misses']) or '-'} |")
    f = res["fitted"]
    a = f["allocator"]
    out += ["", f"Fitted on the fit set: allocator 1-sigma {_pct(a['rel_frag']).lstrip('+')} of the predicted "
            f"fragmentation, {_pct(a['rel_at_fit']).lstrip('+')} of the fragmentation at the smallest "
            f"capacity, {_pct(a['rel_used']).lstrip('+')} of device_used, or {_mib(a['bytes'])} MiB; traced "
            f"CUDA sigma {_pct(f['traced_cuda_sigma']).lstrip('+')} (RMS of the emulated runs; floor "
            f"{_pct(f['traced_cuda_floor_sigma']).lstrip('+')}). Today: allocator "
            f"{res['today']['allocator_sigma']:.0%} of the fragmentation at the smallest capacity, "
            f"traced CUDA {res['today']['traced_cuda_sigma']:.1%}.",
            f"Measured fragmentation nonzero in {res['fit']['frag_nonzero']}/"
            f"{res['fit']['frag_compared']} fit runs and {res['holdout']['frag_nonzero']}/"
            f"{res['holdout']['frag_compared']} holdout runs with reserved compared."]
    return out


# --- main ----------------------------------------------------------------------------------------

def uncounted(path: Path, kept: set[str], only: list[str]) -> list[str]:
    """The ids of ``path``'s runs (those ``only`` selects) that gave no row.

    Args:
        path: a results file.
        kept: the ids of the rows read from it.
        only: id substrings selecting runs (empty: every run).

    Returns:
        The ids, in the file's order.
    """
    runs = json.loads(path.read_text()).get("runs", [])
    return [r.get("id", "?") for r in runs if r.get("id") not in kept
            and (not only or any(s in r.get("id", "") for s in only))]


def first_counted(path: Path, side: str) -> list[str]:
    """``[id]`` of the first run of ``path`` that counts (its recorded estimate), else ``[]``.

    Args:
        path: a results file.
        side: "fit" or "holdout".

    Returns:
        At most one run id.
    """
    doc = json.loads(path.read_text())
    env = doc.get("environment") or {}
    ids = [r["id"] for r in doc.get("runs", []) if run_row(r, env, path.name, side) is not None]
    return ids[:1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Fit the band's allocator and traced-CUDA sigmas on "
                                 "the FIT_SET GPU results files; report the holdout apart.")
    ap.add_argument("files", nargs="*", type=Path,
                    help="results files (default: every *.json in bench/results/gpu)")
    ap.add_argument("--reestimate", action="store_true",
                    help="use today's estimate of each run (slow: builds every model on the "
                         "CPU) instead of the one recorded on the GPU")
    ap.add_argument("--only", action="append", default=[], metavar="SUBSTR",
                    help="only runs whose id contains SUBSTR (repeatable)")
    ap.add_argument("--out", type=Path, metavar="PATH", help="write the rows and fit as JSON")
    add_flag(ap)
    a = ap.parse_args(argv)
    guard(a.quick, a.out, "--out")
    files = a.files or sorted(RESULTS.glob("*.json"))
    missing = [str(f) for f in files if not f.is_file()]
    if missing or not files:
        print(f"no such results file: {', '.join(missing) or RESULTS / '*.json'}",
              file=sys.stderr)
        return 2
    fits = fit_set(RESULTS)
    rows, failed, excluded = [], [], []
    for path in files:
        side = "fit" if path.name in fits else "holdout"
        only = a.only or (first_counted(path, side) if a.quick and a.reestimate else [])
        got, bad = read_rows(path, side, a.reestimate, only)
        rows += got
        failed += bad
        excluded += uncounted(path, {r["id"] for r in got}, only)
    res = analyse(rows)
    print(render(rows, res))
    if excluded:
        print(f"\n{len(excluded)} runs not counted (not ok, no optimizer step in the window, no "
              f"estimate or no steady allocated): {', '.join(excluded)}")
    if failed:
        print(f"\nre-estimate failed for {len(failed)} runs: {', '.join(failed)}")
    if a.out:
        a.out.write_text(json.dumps({
            "source": "reestimated" if a.reestimate else "recorded",
            "files": {p.name: "fit" if p.name in fits else "holdout" for p in files},
            "scales": ALLOCATOR_SCALES, "failed": failed, "excluded": excluded, **res,
            "rows": rows},
            indent=1) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
