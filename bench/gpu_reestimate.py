"""Re-estimate the runs of committed GPU results files (``bench/results/gpu/``) with the estimator
as it is now, on this machine (no GPU needed), and compare with what each run measured there.

    python bench/gpu_reestimate.py [FILE ...] [--only SUBSTR ...] [--json PATH] [--quick]
    python bench/gpu_reestimate.py --write-expected bench/results/gpu/reestimate_expected.json

A results file keeps each run's setup (``case``), its measurements and the estimate made on the
GPU at the time. This makes the harness's estimate (``gpu_truth.estimate``) again for the same
setup, on the device and CUDA version the run recorded, so an estimator change can be judged against real GPU measurements
without a GPU. Files listed in ``bench/results/gpu/FIT_SET`` are the fit set; every other file is
holdout: the two are reported apart, never pooled.

The model code is this machine's: when the installed transformers (or torch) differs from the one
the file was measured with, the script says so, since model code changes what a step keeps (T5's
attention mask became contiguous after transformers 5.17, which changes its CUDA kernel). To
re-estimate with the file's version, put it first on ``PYTHONPATH``.

``--write-expected`` records every committed run's error today, with the versions it was made
with (``_reestimate_expected``): tests/unit/bench/test_gpu_reestimate.py fails when a run's error
moves away from it, so regenerate it with each estimator change that moves one, and say why.

``--quick``: the first ok run of each file only (seconds); never with ``--write-expected``.

Exit status 0 when every run was re-estimated, 1 otherwise (a run without a recorded device
counts as not re-estimated).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import _reestimate_expected  # noqa: E402
import gpu_truth  # noqa: E402
from _gpu_cases import Case  # noqa: E402
from _gpu_report import METRICS, measured_values, rel_errors, summarise  # noqa: E402
from _quick import add_flag, guard  # noqa: E402

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


def reestimated(path: Path, only: list[str],
                quick: bool = False) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(the record as measured, the same record with today's estimate) for each ok run of
    ``path``: the estimate the harness makes (``gpu_truth.estimate``), for the device and CUDA
    version the run recorded."""
    doc = json.loads(path.read_text())
    cuda = (doc.get("environment") or {}).get("cuda")
    pairs = []
    for rec in doc.get("runs", []):
        if rec.get("status") != "ok" or (only and not any(s in rec["id"] for s in only)):
            continue
        device = ((rec.get("estimate") or {}).get("to_dict") or {}).get("device")
        now = {"error": "no recorded device"} if device is None else gpu_truth.estimate(
            Case.from_dict(rec["case"]), False, device=device, cuda_version=cuda)
        pairs.append((rec, {**rec, "estimate": now}))
        print(line(pairs[-1]), flush=True)
        if quick:
            break
    return pairs


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:+.1f}%"


def line(pair: tuple[dict[str, Any], dict[str, Any]]) -> str:
    then, now = pair
    if "error" in now["estimate"]:
        return f"{then['id'][:64]:64s} ERROR {now['estimate']['error'][:120]}"
    e0, e1 = rel_errors(then), rel_errors(now)
    return f"{then['id'][:64]:64s} " + "  ".join(
        f"{k} {_pct(e0.get(k))} -> {_pct(e1.get(k))}" for k in METRICS)


def print_summary(side: str, pairs: list[tuple[dict[str, Any], dict[str, Any]]]) -> None:
    print(f"\n{side}: {len(pairs)} runs (predicted / measured - 1)")
    print(f"  {'metric':12s} {'':5s} {'median':>8s} {'med |e|':>8s} {'worst':>8s} within 10%")
    for i, label in ((0, "then"), (1, "now")):
        for k, s in summarise([p[i] for p in pairs]).items():
            print(f"  {k:12s} {label:5s} {_pct(s['median']):>8s} {_pct(s['median_abs']):>8s} "
                  f"{_pct(s['worst']):>8s} {s['within_10pct']}/{s['n']}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Re-estimate the runs of committed GPU results "
                                 "files (bench/results/gpu) with today's estimator, here, and "
                                 "compare with what each run measured; fit and holdout apart.")
    ap.add_argument("files", nargs="*", type=Path,
                    help="results files (default: every *.json in bench/results/gpu)")
    ap.add_argument("--only", action="append", default=[], metavar="SUBSTR",
                    help="re-estimate only runs whose id contains SUBSTR (repeatable)")
    ap.add_argument("--json", type=Path, metavar="PATH",
                    help="also write the rows and summaries here")
    ap.add_argument("--write-expected", type=Path, metavar="PATH",
                    help="write every committed run's error today, for the CI check (all "
                    "files, no --only)")
    add_flag(ap)
    a = ap.parse_args(argv)
    guard(a.quick, a.json, "--json")
    if a.write_expected and (a.files or a.only or a.quick):
        print("--write-expected records every committed run: give no files, --only or --quick",
              file=sys.stderr)
        return 2
    files = a.files or [f for f in sorted(RESULTS.glob("*.json"))  # not the derived files
                        if "runs" in json.loads(f.read_text())]
    missing = [str(f) for f in files if not f.is_file()]
    if missing or not files:
        print(f"no such results file: {', '.join(missing) or RESULTS / '*.json'}; give files "
              "written by bench/gpu_truth.py", file=sys.stderr)
        return 2
    fits = fit_set(RESULTS)
    sides: dict[str, list[tuple[dict[str, Any], dict[str, Any]]]] = {"fit": [], "holdout": []}
    origin: dict[int, str] = {}  # id() of each run's record -> the results file it came from
    envs: dict[str, dict[str, Any]] = {}
    for path in files:
        env = envs[path.name] = json.loads(path.read_text()).get("environment") or {}
        side = "fit" if path.name in fits else "holdout"
        print(f"{path.name} ({side}): {env.get('gpu_name')}, torch {env.get('torch')}, "
              f"transformers {env.get('transformers')}")
        for gap in version_gaps(env):
            print(f"  note: {gap}; model code may differ from what ran", flush=True)
        got = reestimated(path, a.only, a.quick)
        origin.update((id(then), path.name) for then, _ in got)
        sides[side] += got
    for side, pairs in sides.items():
        if pairs:
            print_summary(side, pairs)
    rows = {side: [{"id": then["id"], "file": origin[id(then)], "measured": measured_values(then),
                    "then": rel_errors(then), "now": rel_errors(now),
                    "estimate_now": now["estimate"]} for then, now in pairs]
            for side, pairs in sides.items()}
    if a.write_expected:
        a.write_expected.write_text(json.dumps(_reestimate_expected.expectations(
            {side: [(f"{r['file']}::{r['id']}", r) for r in rs] for side, rs in rows.items()},
            envs), indent=1) + "\n")
    if a.json:
        import torch
        import transformers

        doc: dict[str, Any] = {side: {
            "rows": rows[side],
            "then": summarise([p[0] for p in pairs]),
            "now": summarise([p[1] for p in pairs])} for side, pairs in sides.items()}
        # the stack the re-estimates were made with (model code moves them: see above)
        doc["reestimated_with"] = {"torch": torch.__version__,
                                   "transformers": transformers.__version__}
        a.json.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    return 0 if all("error" not in now["estimate"] for pairs in sides.values()
                    for _, now in pairs) else 1

if __name__ == "__main__":
    raise SystemExit(main())
