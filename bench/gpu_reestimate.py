"""Re-estimate the runs of committed GPU results files (``bench/results/gpu/``) with the estimator
as it is now, on this machine (no GPU needed), and compare with what each run measured there.

    python bench/gpu_reestimate.py [FILE ...] [--only SUBSTR ...] [--json PATH]

A results file keeps each run's setup (``case``), its measurements and the estimate made on the
GPU at the time. This re-runs ``estimate_memory`` for the same setup, device (the file's catalog
GPU) and CUDA version, so an estimator change can be judged against real GPU measurements
without a GPU. Files listed in ``bench/results/gpu/FIT_SET`` are the fit set; every other file is
holdout: the two are reported apart, never pooled.

The model code is this machine's: when the installed transformers (or torch) differs from the one
the file was measured with, the script says so, since model code changes what a step keeps (T5's
attention mask became contiguous after transformers 5.17, which changes its CUDA kernel). To
re-estimate with the file's version, put it first on ``PYTHONPATH``.

Exit status 0 when every run was re-estimated, 1 otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _gpu_cases import Case  # noqa: E402
from _gpu_report import METRICS, measured_values  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "gpu"


def fit_set(directory: Path) -> set[str]:
    path = directory / "FIT_SET"
    if not path.exists():
        return set()
    return {ln.strip() for ln in path.read_text().splitlines() if ln.strip()
            and not ln.startswith("#")}


def version_gaps(env: dict[str, Any]) -> list[str]:
    """The packages whose installed version differs from the file's (model code, kernels)."""
    import importlib.metadata as md

    gaps = []
    for name in ("torch", "transformers", "peft"):
        try:
            here = md.version(name)
        except md.PackageNotFoundError:
            here = None
        there = env.get(name)
        if there and here and here.split("+")[0] != str(there).split("+")[0]:
            gaps.append(f"{name} {here} here, {there} in the file")
    return gaps


def reestimate(case: Case, device: str, cuda_version: str) -> dict[str, Any]:
    """The estimate of ``case`` made now (``gpu_truth.estimate``'s keywords, this device)."""
    import gpu_truth
    import transformers

    import hf_memkit as mk

    fields = {f.name for f in dataclasses.fields(transformers.TrainingArguments)}
    kw = {**gpu_truth.estimate_kwargs(case, False), "cuda_version": cuda_version}
    t0 = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            e = mk.estimate_memory(gpu_truth.model_config(case, False),
                                   gpu_truth.memory_args(case, fields), device=device, **kw)
    except Exception as exc:  # recorded, like the GPU harness does
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {"allocated": e.peak_allocated, "reserved": e.peak_reserved,
            "device_used": e.device_used, "seconds": round(time.perf_counter() - t0, 1)}


def _err(pred: int | None, meas: int | None) -> float | None:
    return pred / meas - 1 if pred is not None and meas else None


def rows_of(path: Path, only: list[str]) -> list[dict[str, Any]]:
    doc = json.loads(path.read_text())
    env = doc.get("environment") or {}
    rows = []
    for rec in doc.get("runs", []):
        if rec.get("status") != "ok" or (only and not any(s in rec["id"] for s in only)):
            continue
        est = rec.get("estimate") or {}
        dev = ((est.get("to_dict") or {}).get("device") or {}).get("catalog_name")
        if dev is None:
            continue
        meas = measured_values(rec)
        then = {"allocated": est.get("peak_allocated"), "reserved": est.get("peak_reserved"),
                "device_used": est.get("device_used")}
        now = reestimate(Case.from_dict(rec["case"]), dev, env.get("cuda") or "13.0")
        rows.append({"file": path.name, "id": rec["id"], "measured": meas, "then": then,
                     "now": now,
                     "err_then": {k: _err(then[k], meas[k]) for k in METRICS},
                     "err_now": {k: None if "error" in now else _err(now[k], meas[k])
                                 for k in METRICS}})
        print(line(rows[-1]), flush=True)
    return rows


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:+.1f}%"


def line(row: dict[str, Any]) -> str:
    if "error" in row["now"]:
        return f"{row['id'][:64]:64s} ERROR {row['now']['error'][:120]}"
    parts = [f"{k} {_pct(row['err_then'][k])} -> {_pct(row['err_now'][k])}" for k in METRICS]
    return f"{row['id'][:64]:64s} " + "  ".join(parts)


def summary(rows: list[dict[str, Any]], key: str) -> dict[str, dict[str, Any]]:
    out = {}
    for k in METRICS:
        errs = [r[key][k] for r in rows if r[key].get(k) is not None]
        out[k] = {"n": len(errs),
                  "median": statistics.median(errs) if errs else None,
                  "median_abs": statistics.median(abs(e) for e in errs) if errs else None,
                  "worst": max(errs, key=abs) if errs else None,
                  "within_10pct": sum(abs(e) <= 0.10 for e in errs)}
    return out


def print_summary(side: str, rows: list[dict[str, Any]]) -> None:
    print(f"\n{side}: {len(rows)} runs (predicted / measured - 1)")
    print(f"  {'metric':12s} {'':5s} {'median':>8s} {'med |e|':>8s} {'worst':>8s} within 10%")
    for key, label in (("err_then", "then"), ("err_now", "now")):
        for k, s in summary(rows, key).items():
            print(f"  {k:12s} {label:5s} {_pct(s['median']):>8s} {_pct(s['median_abs']):>8s} "
                  f"{_pct(s['worst']):>8s} {s['within_10pct']}/{s['n']}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="*", type=Path,
                    help="results files (default: every *.json in bench/results/gpu)")
    ap.add_argument("--only", action="append", default=[], metavar="SUBSTR",
                    help="re-estimate only runs whose id contains SUBSTR (repeatable)")
    ap.add_argument("--json", type=Path, help="also write the rows and summaries here")
    a = ap.parse_args(argv)
    files = a.files or sorted(RESULTS.glob("*.json"))
    missing = [str(f) for f in files if not f.is_file()]
    if missing or not files:
        print(f"no such results file: {', '.join(missing) or RESULTS / '*.json'}; give files "
              "written by bench/gpu_truth.py", file=sys.stderr)
        return 2
    fits = fit_set(RESULTS)
    sides: dict[str, list[dict[str, Any]]] = {"fit": [], "holdout": []}
    for path in files:
        env = json.loads(path.read_text()).get("environment") or {}
        side = "fit" if path.name in fits else "holdout"
        print(f"{path.name} ({side}): {env.get('gpu_name')}, torch {env.get('torch')}, "
              f"transformers {env.get('transformers')}")
        for gap in version_gaps(env):
            print(f"  note: {gap}; model code may differ from what ran", flush=True)
        sides[side] += rows_of(path, a.only)
    for side, rows in sides.items():
        if rows:
            print_summary(side, rows)
    if a.json:
        a.json.write_text(json.dumps({s: {"rows": r, "then": summary(r, "err_then"),
                                          "now": summary(r, "err_now")}
                                      for s, r in sides.items()}, indent=1) + "\n")
    return 0 if all("error" not in r["now"] for rows in sides.values() for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
