"""Measured per-rank peak tensor memory of tensor and sequence parallelism on CPU (2 gloo ranks).

The cases are ``bench/_dist_cases.py``'s ``parallel_cases()``; each trains for real under
``torchrun --nproc_per_node 2`` (``hf_memkit.testing.groundtruth_dist``, ranks in
``hf_memkit.testing._parallel_worker``):
  * TP: transformers' native tensor parallelism (``from_pretrained(...,
    distributed_config=DistributedConfig(tp_size=2))``), trained with the Trainer's own steps
    (optimizer, clipping, replicated-parameter sync, bf16 autocast), because the Trainer itself
    refuses a ParallelismConfig on a CPU-only machine;
  * SP: DeepSpeed Ulysses (ALST) through the real Trainer on DeepSpeed's CPU accelerator;
  * one ZeRO-3 run without SP at the same sequence length, for comparison.
Context parallelism does not run on CPU (torch 2.13 has no CP rule for the CPU SDPA kernel);
``_parallel_worker.CP_ON_CPU`` records what was tried. Nothing here is estimated.

    python bench/parallel_measure.py [--json PATH] [--only SUBSTRING ...] [--quick]

``--quick``: the fp32 TP case only (``QUICK``), about a minute on 2 cores; it needs ``--json``
(never the committed ``bench/results/parallel_measured.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import dist_measure  # noqa: E402
from _dist_cases import NPROC, parallel_cases  # noqa: E402
from _quick import add_flag, guard  # noqa: E402

from hf_memkit._units import MiB  # noqa: E402
from hf_memkit.testing._parallel_worker import CP_ON_CPU  # noqa: E402

DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "parallel_measured.json"
QUICK = ("tp-fp32",)


def measure(only: list[str] | None = None, quick: bool = False) -> list[dict]:
    """Measure the parallel cases whose name contains one of ``only`` (all when empty).

    Args:
        only: name substrings.
        quick: only the ``QUICK`` cases (by exact name), where ``only`` is empty.

    Returns:
        ``dist_measure.measure``'s rows.
    """
    specs = [c for c in parallel_cases() if not quick or only or c["name"] in QUICK]
    return dist_measure.measure(only, specs)


def _mib(x) -> str:
    return "-" if x is None else f"{x / MiB:.2f}"


def _dtype(spec: dict, rk: dict) -> str:
    if rk.get("tp"):
        mp = rk["tp"]["mixed_precision"]
        return rk["tp"]["param_dtype"].replace("torch.", "") + ("" if mp == "no" else f"+{mp}")
    ds = spec.get("deepspeed", {})
    return "bf16" if ds.get("bf16", {}).get("enabled") else spec.get("dtype", "float32")


def _seq(spec: dict, rk: dict) -> str:
    shapes = (rk.get("sp") or {}).get("model_input_shapes")
    return f"{spec['seq_len']}/{shapes[0][1]}" if shapes else str(spec["seq_len"])


def table(rows: list[dict]) -> Table:
    t = Table(title=f"per-rank peak tensor memory, {NPROC} gloo ranks on CPU (MiB)")
    for col in ("case", "rank", "seq (model)", "mb", "dtype", "peak", "open", "params", "grads",
                "optim", "master", "steady steps", "loss first->last"):
        t.add_column(col, justify="left" if col in ("case", "dtype", "steady steps") else "right")
    for row in rows:
        spec, res = row["spec"], row["result"]
        for rk in res["ranks"]:
            steady = [s for s in rk["steps"] if s["step"] >= 2]
            t.add_row(row["name"], str(rk["rank"]), _seq(spec, rk),
                      str(spec["args"].get("per_device_train_batch_size")), _dtype(spec, rk),
                      _mib(rk["peak"]), _mib(max(s["alive_open"] for s in steady)),
                      _mib(rk.get("local_param_bytes")), _mib(rk.get("local_grad_bytes")),
                      _mib(rk.get("local_optimizer_bytes")), _mib(rk.get("local_master_bytes")),
                      " ".join(f"{s['peak'] / MiB:.1f}" for s in steady),
                      f"{res['losses'][0]:.3f}->{res['losses'][-1]:.3f}")
    t.caption = ("params/grads/optim: this rank's local bytes (DTensor local shards under TP; "
                 "ZeRO partitions under DeepSpeed, grads = ZeRO-3's gradient partition buffer, "
                 "'-' where not reachable); master: DeepSpeed's fp32 master partitions; open: "
                 "tensors alive when a steady step's window opens; seq (model): global/per-rank "
                 "model input under SP")
    return t


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None,
                    help=f"write every rank's full result here (default {DEFAULT_JSON}; "
                    "--quick: required)")
    ap.add_argument("--only", nargs="*", help="run only the cases whose name contains one of these")
    add_flag(ap)
    a = ap.parse_args(argv)
    guard(a.quick, a.json, "--json")
    a.json = a.json or str(DEFAULT_JSON)
    rows = measure(a.only, a.quick)
    if not rows:
        print(f"no case matches --only {a.only!r}; cases: "
              + ", ".join(c["name"] for c in parallel_cases()), file=sys.stderr)
        return 2
    Console(width=200).print(table(rows))
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps({"context_parallel_on_cpu": CP_ON_CPU, "rows": rows},
                                       indent=1))
    print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
