"""Per-rank estimates of tensor and sequence parallelism against 2-process CPU runs.

The runs are ``bench/_dist_cases.py``'s ``parallel_cases()``, measured by
``bench/parallel_measure.py`` (transformers' tensor parallelism with the Trainer's steps, and
DeepSpeed Ulysses through the real Trainer; gloo, peak RSS per rank; committed in
``bench/results/parallel_measured.json``, or measured again with ``--measure``). Each is
estimated with ``estimate_memory(..., parallelism_config=..., num_gpus=2, device="cpu")`` and
compared with the larger rank's peak. Bar (issue 27): within 8%. The ZeRO-3 run without SP is
the same comparison for the engine alone. Context parallelism cannot run on a CPU (torch has no
rule for the CPU SDPA kernel): its buffers are checked against torch's own ring attention on
fake tensors (tests/unit/estimate/test_ring_attention_buffers.py).

    python bench/parallel_cpu.py [--measured PATH | --measure] [--json out.json] [--quick]

A case the measurements lack fails the run (exit 1), it is not left out. ``--quick``: the
``QUICK`` cases only (one TP, one SP), from the measurements, in seconds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _dist_cases  # noqa: E402
from _quick import add_flag, guard  # noqa: E402
from transformers import AutoConfig  # noqa: E402

import hf_memkit as mk  # noqa: E402

MEASURED = Path(__file__).resolve().parent / "results" / "parallel_measured.json"
QUICK = ("tp-fp32", "sp-zero3-fp32-seq1024")


def args_of(spec: dict) -> dict:
    """The TrainingArguments fields of a measured case, with its parallel degrees."""
    args = dict(spec["args"])
    args.setdefault("per_device_eval_batch_size", args["per_device_train_batch_size"])
    if spec["mode"] == "tp":
        args["parallelism_config"] = {"tp_size": _dist_cases.NPROC}
    if "deepspeed" in spec:
        mb = args["per_device_train_batch_size"]
        accum = args.get("gradient_accumulation_steps", 1)
        args["deepspeed"] = dict(spec["deepspeed"], train_micro_batch_size_per_gpu=mb,
                                 gradient_accumulation_steps=accum)
    if spec["mode"] == "sp":
        args["parallelism_config"] = {"sp_size": _dist_cases.NPROC}
    return args


def estimate(spec: dict) -> int:
    cfg = dict(spec["config"])
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        est = mk.estimate_memory(config, args_of(spec), seq_len=spec["seq_len"],
                                 dtype=spec.get("dtype"), device="cpu",
                                 num_gpus=_dist_cases.NPROC)
    return est.peak_allocated


def main(argv: list[str] | None = None) -> int:
    """Estimate each measured case; print the table and write ``--json``.

    Args:
        argv: the command line (default ``sys.argv[1:]``).

    Returns:
        The exit status: 0, or 1 where the measurements lack a case.
    """
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--measured", default=str(MEASURED), help="parallel_measure.py's JSON")
    ap.add_argument("--measure", action="store_true", help="run the cases again instead")
    ap.add_argument("--json", type=Path)
    add_flag(ap)
    a = ap.parse_args(argv)
    guard(a.quick, a.json, "--json")
    specs = [s for s in _dist_cases.parallel_cases() if not a.quick or s["name"] in QUICK]
    if a.measure:
        from hf_memkit.testing.groundtruth_dist import measure_distributed_peak

        runs = {s["name"]: measure_distributed_peak(s, nproc=_dist_cases.NPROC) for s in specs}
    else:
        runs = {r["name"]: r["result"] for r in json.loads(Path(a.measured).read_text())["rows"]}
    table = Table(title=f"TP / SP per-rank peak, {_dist_cases.NPROC} gloo ranks (MiB)")
    for col in ("case", "seq", "measured (max rank)", "estimated", "error"):
        table.add_column(col)
    rows = []
    missing = [spec["name"] for spec in specs if spec["name"] not in runs]
    for spec in specs:
        if spec["name"] in missing:
            continue  # reported below, and the run fails
        t0 = time.perf_counter()
        peak, pred = runs[spec["name"]]["peak"], estimate(spec)
        err = (pred - peak) / peak
        rows.append({"case": spec["name"], "mode": spec["mode"], "seq_len": spec["seq_len"],
                     "measured": peak, "estimated": pred, "error": err,
                     "seconds": time.perf_counter() - t0})
        table.add_row(spec["name"], str(spec["seq_len"]), f"{peak / 2**20:.1f}",
                      f"{pred / 2**20:.1f}", f"{err:+.2%}")
    console = Console(width=110)
    console.print(table)
    errs = [abs(r["error"]) for r in rows]
    console.print(f"{len(errs)} runs: median |error| {statistics.median(errs):.2%}, worst "
                  f"{max(errs):.2%}; within 8%: {sum(e <= 0.08 for e in errs)}/{len(errs)}")
    if missing:
        console.print(f"not measured in {a.measured}: {', '.join(missing)}")
    if a.json:
        a.json.write_text(json.dumps({"rows": rows, "missing": missing}, indent=2) + "\n")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
