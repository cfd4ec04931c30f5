"""Per-rank memory of context and sequence parallelism against published runs, and the plan for
a million-token SFT of an 8B model on one 8 x H100 node.

Each row is a run a library published with its per-GPU memory, rebuilt as ``estimate_memory``
arguments from the published setup (the script, its config, the blog's text; sources in
``ROWS``). Published "GB" is read both as 10^9 bytes and as GiB, since none of the sources says
which counter it printed; the estimate's ``device_used`` (what nvidia-smi shows) and
``peak_reserved`` (torch's ``max_memory_reserved``) are shown against it. Nothing here is fitted:
the rows were gathered after the model was written and are not used to tune it.

    python bench/parallel_published.py [--json out.json] [--skip-plan] [--quick]

``--quick``: the ``QUICK`` rows (Ulysses at 8k tokens with and without SP), no plan.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from pathlib import Path

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _quick import add_flag, guard  # noqa: E402

import hf_memkit as mk  # noqa: E402
from hf_memkit._units import GiB  # noqa: E402

FSDP_CP8 = {"fsdp": "full_shard", "fsdp_config": {"version": 2, "reshard_after_forward": True}}
ALLOC_ENV = "PYTORCH_CUDA_ALLOC_CONF"
OFFLOAD = {"activation_checkpointing": True, "activation_checkpointing_kwargs": {"offload": True}}


def _ulysses(seq: int, gb: float, sp: int = 4) -> dict:
    """The Ulysses blog's runs. Its TRL computed the model's own loss under SP (the full
    logits, upcast to fp32: transformers' ``deepspeed_sp_compute_loss`` calls
    ``model(**inputs).loss``); TRL 1.16 passes ``fused_lm_head=True`` there, so the rows are
    estimated as the plain Trainer step, which is what ran."""
    par = {"parallelism_config": {"sp_size": sp}} if sp > 1 else {}
    return {
        "name": f"Qwen3-4B SP={sp} {seq // 1024}k (Ulysses blog)", "model": "Qwen3-4B",
        "num_gpus": sp, "published_gb": gb, "trainer": "trainer", "seq_len": seq,
        "source": "https://huggingface.co/blog/ulysses-sp: H100 80GB, ZeRO-3 + CPU optimizer "
                  "offload, checkpointing, flash attention, the model's own loss",
        # flash-attn is not installed here; CUDA's SDPA flash kernel holds the same tensors
        "attn": "sdpa",
        "args": {"per_device_train_batch_size": 1, "bf16": True,
                 "activation_checkpointing": True, **par,
                 "deepspeed": {"bf16": {"enabled": True}, "zero_optimization": {
                     "stage": 3, "offload_optimizer": {"device": "cpu"}}}}}


ROWS = [
    {"name": "Qwen3-8B 1M tokens CP=8 (TRL example)", "model": "Qwen3-8B", "num_gpus": 8,
     "published_gb": 56.2, "trainer": "sft", "attn": "sdpa",
     "source": "trl examples/sft_qwen3_8b_1m_context (docstring, context_parallel_8gpu.yaml); "
               "TRL v1.13.0 release notes: 8 x H100, FSDP2, cp=8, bf16, fused head, "
               "checkpointing with offload, 56.2 GB/GPU",
     "args": {"per_device_train_batch_size": 1, "bf16": True, "max_length": 1_048_576,
              **FSDP_CP8, **OFFLOAD, "parallelism_config": {"cp_size": 8}}},
    {"name": "Qwen3-4B 1M tokens CP=4 (TRL guide)", "model": "Qwen3-4B", "num_gpus": 4,
     "published_gb": 63.6, "trainer": "sft", "attn": "sdpa",
     "source": "https://huggingface.co/docs/trl/en/long_context_training: 4 GPUs, cp=4, fused "
               "head, checkpointing with offload, expandable_segments",
     "alloc_conf": "expandable_segments:True",   # the guide requires it for this run
     "args": {"per_device_train_batch_size": 1, "bf16": True, "max_length": 1_048_576,
              **FSDP_CP8, **OFFLOAD, "parallelism_config": {"cp_size": 4}}},
    _ulysses(8192, 76.4, sp=1), _ulysses(8192, 23.4), _ulysses(32768, 35.0),
    _ulysses(65536, 50.5), _ulysses(98304, 66.0),
]


QUICK = ("Qwen3-4B SP=1 8k (Ulysses blog)", "Qwen3-4B SP=4 8k (Ulysses blog)")


def estimate(row: dict) -> dict:
    t = time.perf_counter()
    before = os.environ.get(ALLOC_ENV)
    if row.get("alloc_conf"):   # the estimator reads the allocator options from the environment
        os.environ[ALLOC_ENV] = row["alloc_conf"]
    try:
        return _estimate(row, t)
    finally:
        os.environ.pop(ALLOC_ENV, None)
        if before is not None:
            os.environ[ALLOC_ENV] = before


def _estimate(row: dict, t: float) -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        e = mk.estimate_memory(row["model"], row["args"], trainer=row["trainer"],
                               num_gpus=row["num_gpus"], device="H100-80GB", dtype="bfloat16",
                               attn_implementation=row["attn"], seq_len=row.get("seq_len"))
    pub = row["published_gb"]
    return {"name": row["name"], "source": row["source"], "published_gb": pub,
            "alloc_conf": row.get("alloc_conf"),
            "device_used_gib": e.device_used / GiB, "peak_reserved_gib": e.peak_reserved / GiB,
            "peak_allocated_gib": e.peak_allocated / GiB,
            "ratio_if_gb": e.device_used / (pub * 1e9), "ratio_if_gib": e.device_used / (pub * GiB),
            "peak_phase": e.peak_phase, "seconds": time.perf_counter() - t}


def million_token_plan() -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t = time.perf_counter()
        plan = mk.plan_training("Qwen3-8B", seq_len=1_048_576, target_batch_size=1,
                                device="H100-80GB", num_gpus=8, trainer="sft")
    return {"chosen": plan.chosen.label(), "seconds": time.perf_counter() - t,
            "device_used_gib": plan.estimate.device_used / GiB,
            "upper_gib": plan.estimate.upper / GiB, "budget_gib": plan.budget / GiB,
            "parallelism_config": plan.training_args_kwargs.get("parallelism_config"),
            "launch": plan.launch_commands()["accelerate_config"],
            "accelerate_config": plan.accelerate_config()}


def main(argv: list[str] | None = None) -> int:
    """Estimate each published row (and plan the 1M-token run); print and write ``--json``.

    Args:
        argv: the command line (default ``sys.argv[1:]``).

    Returns:
        The exit status: 0.
    """
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--skip-plan", action="store_true")
    add_flag(ap)
    a = ap.parse_args(argv)
    guard(a.quick, a.json, "--json")
    out = {"rows": [estimate(r) for r in ROWS if not a.quick or r["name"] in QUICK]}
    table = Table(title="context / sequence parallelism: estimate vs published per-GPU memory")
    for col in ("run", "published", "allocated", "device_used", "ratio (GB)", "ratio (GiB)",
                "peak in"):
        table.add_column(col)
    for r in out["rows"]:
        table.add_row(r["name"], f"{r['published_gb']} GB", f"{r['peak_allocated_gib']:.1f} GiB",
                      f"{r['device_used_gib']:.1f} GiB", f"{r['ratio_if_gb']:.2f}",
                      f"{r['ratio_if_gib']:.2f}", r["peak_phase"])
    Console(width=120).print(table)
    if not a.skip_plan and not a.quick:
        out["plan"] = million_token_plan()
        p = out["plan"]
        print(f"\n1M-token SFT of Qwen3-8B on 8 x H100: {p['chosen']}; {p['device_used_gib']:.1f} "
              f"GiB per GPU (with margin {p['upper_gib']:.1f} of {p['budget_gib']:.1f}); planned "
              f"in {p['seconds']:.0f} s\n{p['launch']}\n{p['accelerate_config']}")
    if a.json:
        a.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
