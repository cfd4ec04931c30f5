"""Compute every constant fitted on the GPU fit set from the files ``bench/results/gpu/FIT_SET``
declares, with the rule each constant's comment states, and compare with the value the package
holds.

    python bench/fit_constants.py [--json PATH] [--quick]

(``--quick`` changes nothing: reading the fit set takes about a second.)

The fit set is declared before anything is fitted; holdout files are never read here. Each rule:

- ``CONTEXT_LAZY_INIT`` (``_cuda/runtime.py``): the median NVML growth at CUDA context creation,
  before any tensor (``context.context_bytes``), rounded to the nearest MiB.
- ``LAZY_TRAINING_KERNELS``: per run, the device's used memory after the steps less the
  allocator's reserved memory less the context (the kernels CUDA loads lazily during the step);
  the median of the runs with a fused attention kernel (bf16/fp16 SDPA) and of the others; the
  larger, rounded to the nearest MiB.
- ``CudaCalibration.traced_cuda_sigma``: the largest |traced residual| of the runs where the CUDA
  emulation acts ((estimated - measured max_memory_allocated) / traced bytes, as
  ``bench/band_fit.py`` computes it), rounded up to a whole percent: the 1-sigma covers the worst
  run.
- ``CudaCalibration.traced_cuda_floor_sigma``: the same over the runs where it does not act.
- ``CudaCalibration.allocator_sigma``: the 68th percentile of |measured - predicted
  fragmentation| / the fragmentation at the smallest capacity (a 1-sigma the heavy tails move
  less; ``band_fit.py`` explains why not the RMS), rounded up to 5%.

The residuals use the estimate each run recorded on the GPU, so the figures do not move with this
machine's code. ``alloc_const`` is fitted on the published anchors' fit half by
``bench/estimator_gpu_anchors.py`` (its ``fit``), not here.

Exit status 0 when every held constant equals what its rule gives, 1 otherwise, 2 when the fit
set names no readable file.
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

import band_fit  # noqa: E402
from _quick import add_flag, guard  # noqa: E402
from gpu_reestimate import fit_set  # noqa: E402

from hf_memkit._cuda import runtime  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "gpu"
MiB = 2**20


def _round_up(x: float, step: float) -> float:
    return round(math.ceil(round(x / step, 9)) * step, 6)


def _ok_runs(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for d in docs for r in d.get("runs", []) if r.get("status") == "ok"]


def _fused_attention(run_id: str) -> bool:
    """bf16/fp16 SDPA: the runs that load a fused attention kernel (ids name the attention and
    the precision: ``llama-160m.amp_bf16.adamw_torch.sdpa.b8s1024``)."""
    return ".sdpa." in run_id and ".fp32." not in run_id


def context_constants(docs: list[dict[str, Any]]) -> dict[str, int]:
    """``CONTEXT_LAZY_INIT`` and ``LAZY_TRAINING_KERNELS`` from the fit runs (bytes)."""
    runs = _ok_runs(docs)
    ctx = statistics.median(r["context"]["context_bytes"] for r in runs)
    groups: dict[bool, list[int]] = {True: [], False: []}
    for r in runs:
        m = r["measured"]
        if m.get("device_used_after") is not None and (m.get("steady") or {}).get("reserved"):
            groups[_fused_attention(r["id"])].append(m["device_used_after"] - m["steady"]["reserved"])
    kernels = max(statistics.median(v) for v in groups.values() if v) - ctx
    return {"CONTEXT_LAZY_INIT": round(ctx / MiB) * MiB,
            "LAZY_TRAINING_KERNELS": round(kernels / MiB) * MiB}


def band_constants(paths: list[Path]) -> dict[str, float]:
    """The band's three fitted sigmas from the fit files' rows (``band_fit.read_rows``)."""
    rows = [row for p in paths for row in band_fit.read_rows(p, "fit")[0]]
    traced = band_fit.traced_stats(rows)
    alloc = band_fit.allocator_stats(rows)["rel_at_fit"]
    return {"traced_cuda_sigma": _round_up(abs(traced["emulated"]["worst"]), 0.01),
            "traced_cuda_floor_sigma": _round_up(abs(traced["floor"]["worst"]), 0.01),
            "allocator_sigma": _round_up(alloc["p68"], 0.05)}


def held() -> dict[str, float]:
    """The values the package holds today."""
    cal = runtime.CALIBRATION
    return {"CONTEXT_LAZY_INIT": runtime.CONTEXT_LAZY_INIT,
            "LAZY_TRAINING_KERNELS": runtime.LAZY_TRAINING_KERNELS,
            "traced_cuda_sigma": cal.traced_cuda_sigma,
            "traced_cuda_floor_sigma": cal.traced_cuda_floor_sigma,
            "allocator_sigma": cal.allocator_sigma}


def compute(directory: Path = RESULTS) -> dict[str, Any]:
    """Fit every constant on ``directory``'s declared fit set.

    Args:
        directory: a folder of GPU results files with its ``FIT_SET``.

    Returns:
        ``{"fit_files": [...], "constants": {name: {"fitted", "held", "agrees"}}}``.

    Raises:
        FileNotFoundError: ``FIT_SET`` names no file in ``directory``.
    """
    paths = [directory / n for n in sorted(fit_set(directory))]
    paths = [p for p in paths if p.is_file()]
    if not paths:
        raise FileNotFoundError(f"{directory / 'FIT_SET'} names no results file in {directory}")
    docs = [json.loads(p.read_text()) for p in paths]
    fitted = {**context_constants(docs), **band_constants(paths)}
    now = held()
    return {"fit_files": [p.name for p in paths],
            "constants": {k: {"fitted": v, "held": now[k], "agrees": math.isclose(v, now[k])}
                          for k, v in fitted.items()}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=RESULTS, help="the GPU results folder")
    ap.add_argument("--json", help="write the constants here")
    add_flag(ap)
    a = ap.parse_args(argv)
    guard(a.quick, a.json, "--json")
    try:
        out = compute(a.dir)
    except FileNotFoundError as e:
        print(f"fit_constants: {e}", file=sys.stderr)
        return 2
    print(f"fit set: {', '.join(out['fit_files'])}")
    for name, c in out["constants"].items():
        fmt = (lambda v: f"{v / MiB:.0f} MiB") if name.isupper() else (lambda v: f"{v:.3f}")
        print(f"  {name:24s} fitted {fmt(c['fitted']):>10s}  held {fmt(c['held']):>10s}  "
              f"{'ok' if c['agrees'] else 'DIFFERS'}")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0 if all(c["agrees"] for c in out["constants"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
