"""``hf-memkit plan``: the fastest training setup that fits, explained."""

from __future__ import annotations

import argparse

from rich.console import Console

from .._plan import plan_training
from .estimate import _field


def plan_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "plan", help="choose the fastest setup that fits a GPU",
        description="Search precision, micro-batch/accumulation, optimizer, checkpointing and "
                    "LoRA/QLoRA for MODEL on a GPU and print the choice with every alternative.",
        epilog="Examples:\n"
               "  hf-memkit plan Llama-3.1-8B --gpu RTX-4090 --seq-len 2048 --target-batch 32\n"
               "  hf-memkit plan Llama-3.1-70B --gpu H100-80GB --seq-len 4096 --target-batch 16 "
               "--json\n"
               "  hf-memkit plan gpt2 --gpu T4 --seq-len 1024 --target-batch 64 --method full",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("model", help="bundled model name or local directory with config.json")
    p.add_argument("fields", nargs="*", metavar="FIELD=VALUE", type=_field,
                   help="TrainingArguments fields to pin, e.g. optim=adamw_torch_fused")
    p.add_argument("--gpu", default=None, help="catalog GPU or 'cpu'; default: this machine")
    p.add_argument("--num-gpus", type=int, default=None, help="data-parallel ranks")
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--target-batch", type=int, required=True, help="effective batch size")
    p.add_argument("--method", default="auto", choices=("auto", "full", "lora", "qlora"))
    p.add_argument("--max-memory", default=None, help="explicit budget, e.g. 20GiB")
    p.add_argument("--headroom", type=float, default=0.1, help="fraction of memory kept free")
    p.add_argument("--task", default=None, help="head: causal-lm, sequence-classification, ...")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    return p


def plan_command(args: argparse.Namespace) -> int:
    pins = dict(args.fields)
    plan = plan_training(args.model, seq_len=args.seq_len, target_batch_size=args.target_batch,
                         device=args.gpu, num_gpus=args.num_gpus, method=args.method,
                         headroom=args.headroom, max_memory=args.max_memory, task=args.task,
                         **pins)
    if args.json:
        print(plan.to_json(indent=2))
    else:
        from .._render import plan_tables

        console = Console()
        for table in plan_tables(plan):
            console.print(table)
    return 0


def register(sub) -> None:
    plan_parser(sub).set_defaults(func=plan_command)
