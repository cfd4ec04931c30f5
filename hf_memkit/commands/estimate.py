"""``hf-memkit estimate``: the memory breakdown of one training setup, on any GPU, without one."""

from __future__ import annotations

import argparse
import json

from rich.console import Console

from .._errors import HfMemkitError
from .._estimate import estimate_memory
from .._model.tasks import task_choices
from .._render import estimate_table


def parse_field(text: str) -> tuple[str, object]:
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"expected FIELD=VALUE, got `{text}`")
    key, value = text.split("=", 1)
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def estimate_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "estimate", help="predict the memory of one training setup",
        description="Predict peak memory of a training (or eval) step of MODEL (a bundled name, a "
                    "local directory with config.json) on a catalog GPU or this machine.",
        epilog="Examples:\n"
               "  hf-memkit estimate Llama-3.1-8B --gpu RTX-4090 --seq-len 2048 --batch 1 \\\n"
               "      bf16=true gradient_checkpointing=true optim=adamw_bnb_8bit\n"
               "  hf-memkit estimate gpt2 --gpu cpu --seq-len 512 --batch 8 --json\n"
               "  hf-memkit estimate bert-large-uncased --task sequence-classification "
               "--gpu T4 --seq-len 512 --batch 8 fp16=true\n"
               "  hf-memkit estimate Llama-3.1-70B --gpu H100-80GB --num-gpus 8 --seq-len 4096 "
               "--batch 1 \\\n      bf16=true fsdp=true "
               "'fsdp_config={\"version\": 2, \"cpu_offload\": true}'   # one rank's memory",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("model", help="bundled model name or local directory with config.json")
    p.add_argument("fields", nargs="*", type=parse_field, metavar="FIELD=VALUE",
                   help="any TrainingArguments field, e.g. bf16=true optim=adafactor")
    p.add_argument("--gpu", default=None, help="catalog GPU (hf-memkit devices) or 'cpu'; "
                                               "default: this machine")
    p.add_argument("--seq-len", type=int, required=True, help="longest sequence in a batch")
    p.add_argument("--batch", type=int, default=None, help="per_device_train_batch_size")
    p.add_argument("--task", default=None, metavar="TASK", choices=task_choices(),
                   help=f"head: {', '.join(task_choices(aliases=False))}")
    p.add_argument("--stage", default="train", choices=("train", "eval", "forward_backward"),
                   help="forward_backward: a custom loop's forward + backward, no optimizer")
    p.add_argument("--cuda-version", default=None, metavar="X.Y",
                   help="the target's CUDA, e.g. 12.8 (default: the installed torch's, else "
                        "13.0); CUDA < 11.7 or CUDA_MODULE_LOADING=EAGER loads every kernel "
                        "into a larger context")
    p.add_argument("--dtype", default=None, help="load dtype (bfloat16 = pure bf16 training)")
    p.add_argument("--num-gpus", type=int, default=None,
                   help="data-parallel ranks: one rank's memory under DDP, or the FSDP / "
                        "DeepSpeed sharding given by fsdp=... / deepspeed=... fields")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--max-batch", action="store_true",
                   help="instead: the largest micro-batch that fits (reverse query)")
    p.add_argument("--max-seq-len", action="store_true",
                   help="instead: the longest seq_len (multiple of 64) that fits, up to --seq-len")
    p.add_argument("--headroom", type=float, default=0.1, help="for --max-batch/--max-seq-len")
    return p


def estimate_command(args: argparse.Namespace) -> int:
    fields = dict(args.fields)
    if args.batch is not None:
        fields["per_device_train_batch_size"] = args.batch
        fields.setdefault("per_device_eval_batch_size", args.batch)
    if args.max_batch or args.max_seq_len:
        from .._plan import max_batch_size, max_seq_len

        kw = dict(device=args.gpu, headroom=args.headroom, task=args.task, dtype=args.dtype,
                  cuda_version=args.cuda_version)
        if args.max_batch:
            n = max_batch_size(args.model, fields, seq_len=args.seq_len, **kw)
            text = f"largest micro-batch that fits at seq_len {args.seq_len}: {n}"
            result = {"max_batch_size": n}
        else:
            n = max_seq_len(args.model, fields, limit=args.seq_len, **kw)
            text = f"longest seq_len that fits (up to {args.seq_len}): {n}"
            result = {"max_seq_len": n}
        print(json.dumps(result) if args.json else text)
        return 0
    try:
        est = estimate_memory(args.model, fields, seq_len=args.seq_len, device=args.gpu,
                              stage=args.stage, task=args.task, dtype=args.dtype,
                              num_gpus=args.num_gpus, cuda_version=args.cuda_version)
    except ValueError as exc:
        raise HfMemkitError(str(exc)) from exc
    if args.json:
        print(json.dumps(est.to_dict(), indent=2, default=str))
    else:
        Console().print(estimate_table(est))
    return 0


def register(sub) -> None:
    estimate_parser(sub).set_defaults(func=estimate_command)
