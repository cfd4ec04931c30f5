"""Measured per-rank peak tensor memory of the 2-process CPU sharding cases (``_dist_cases``).

Each case trains for real under ``torchrun --nproc_per_node 2`` with the gloo backend
(``hf_memkit.testing.groundtruth_dist``): DDP through the ``transformers.Trainer``, FSDP2 through
accelerate's own ``fsdp2_prepare_model`` in a Trainer-like loop. Each rank reports its own peak
(RSS window with ``MALLOC_MMAP_THRESHOLD_=65536``, steady steps >= 2) and its local parameter,
gradient and optimizer-state bytes. Nothing here is estimated; ``bench/sharding.py`` compares.

    python bench/dist_measure.py [--out results.json] [--only SUBSTRING] [--quick]

``--quick``: the plain DDP case only (``QUICK``), about a minute on 2 cores; needs ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _dist_cases import NPROC, cases  # noqa: E402
from _quick import add_flag, guard  # noqa: E402

from hf_memkit._units import MiB  # noqa: E402
from hf_memkit.testing.groundtruth_dist import measure_distributed_peak  # noqa: E402

QUICK = ("ddp-fp32-adamw",)


def measure(only: str | list[str] | None = None, specs: list[dict] | None = None) -> list[dict]:
    """Measure ``specs`` (default: ``_dist_cases.cases()``) whose name contains ``only`` (one
    substring or any of several)."""
    rows = []
    wanted = [only] if isinstance(only, str) else only
    for spec in specs if specs is not None else cases():
        if wanted and not any(o in spec["name"] for o in wanted):
            continue  # not asked for
        t0 = time.perf_counter()
        res = measure_distributed_peak({k: v for k, v in spec.items() if k != "name"},
                                       nproc=NPROC)
        rows.append({"name": spec["name"], "spec": spec, "result": res,
                     "wall_seconds": time.perf_counter() - t0})
    return rows


def render(rows: list[dict]) -> str:
    head = (f"{'case':<26} {'rank':>4} {'peak MiB':>9} {'params':>8} {'grads':>8} "
            f"{'optim':>8} {'extra':>8} {'steady steps MiB':<28} {'loss first->last':<17}")
    lines = [head, "-" * len(head)]
    for row in rows:
        res = row["result"]
        for rk in res["ranks"]:
            steady = [s["peak"] / MiB for s in rk["steps"] if s["step"] >= 2]
            extra = rk.get("ddp", {}).get("bucket_bytes", 0)
            loss = f"{res['losses'][0]:.3f}->{res['losses'][-1]:.3f}"
            lines.append(
                f"{row['name']:<26} {rk['rank']:>4} {rk['peak'] / MiB:>9.2f} "
                f"{rk['local_param_bytes'] / MiB:>8.2f} {rk['local_grad_bytes'] / MiB:>8.2f} "
                f"{rk['local_optimizer_bytes'] / MiB:>8.2f} {extra / MiB:>8.2f} "
                f"{' '.join(f'{x:.1f}' for x in steady):<28} {loss:<17}")
    lines.append("params/grads/optim: this rank's local bytes (DTensor shards under FSDP2); "
                 "extra: DDP reducer buckets (separate from .grad: gradient_as_bucket_view=False)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Measure the cases; print the table and write ``--out``.

    Args:
        argv: the command line (default ``sys.argv[1:]``).

    Returns:
        The exit status: 0, or 2 where ``--only`` matches no case.
    """
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write the full results (every rank, every step) as JSON here")
    ap.add_argument("--only", help="run only the cases whose name contains this")
    add_flag(ap)
    a = ap.parse_args(argv)
    guard(a.quick, a.out, "--out")
    quick = [c for c in cases() if c["name"] in QUICK] if a.quick and not a.only else None
    rows = measure(a.only, quick)
    if not rows:
        print(f"no case matches --only {a.only!r}; cases: "
              + ", ".join(c["name"] for c in cases()), file=sys.stderr)
        return 2
    print(render(rows))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
