"""``hf-memkit estimate``: the memory breakdown of one training setup, on any GPU, without one."""

from __future__ import annotations

import argparse
import json

from .._errors import HfMemkitError
from .._model.tasks import task_choices


class FieldError(argparse.ArgumentTypeError, HfMemkitError):
    """A bad ``FIELD=VALUE``: argparse prints its message and exits 2; read outside argparse it
    is an ``HfMemkitError`` (exit 2 too)."""


# --dtype values: the floating dtypes weights can be loaded in (estimate_memory's `dtype`)
DTYPES = ("float32", "bfloat16", "float16", "auto")


def fraction(text: str) -> float:
    """``--headroom``: the fraction of device memory kept free, in [0, 1)."""
    try:
        v = float(text)
    except ValueError:
        v = None
    if v is None or not 0 <= v < 1:
        raise FieldError(f"expected the fraction of device memory kept free, in [0, 1) (0.1 "
                         f"keeps 10% free), got `{text}`")
    return v


def positive_int(text: str) -> int:
    """``--seq-len``, ``--batch``, ``--num-gpus``: an integer >= 1."""
    try:
        v = int(text)
    except ValueError:
        v = 0
    if v < 1:
        raise FieldError(f"expected a positive integer, got `{text}`")
    return v


def parse_field(text: str) -> tuple[str, object]:
    """``FIELD=VALUE`` -> (field, value). A bool/int/float ``TrainingArguments`` field's value is
    parsed by the field's type (``bf16=False`` is False: true/false, 1/0, yes/no); other values
    are read as JSON (``fsdp_config={...}``), else kept as text."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise FieldError(f"expected FIELD=VALUE (a TrainingArguments field, e.g. bf16=true or "
                         f"optim=adafactor), got `{text}`")
    from .._setup import check_field, training_args_types

    if key in training_args_types():
        try:
            return key, check_field(key, value)
        except HfMemkitError as exc:
            raise FieldError(f"{text}: {exc}") from None
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
    p.add_argument("--seq-len", type=positive_int, required=True,
                   help="longest sequence in a batch")
    p.add_argument("--batch", type=positive_int, default=None,
                   help="per_device_train_batch_size")
    p.add_argument("--task", default=None, metavar="TASK", choices=task_choices(),
                   help=f"head: {', '.join(task_choices(aliases=False))}")
    p.add_argument("--stage", default="train", choices=("train", "eval", "forward_backward"),
                   help="forward_backward: a custom loop's forward + backward, no optimizer")
    p.add_argument("--cuda-version", default=None, metavar="X.Y",
                   help="the target's CUDA, e.g. 12.8 (default: the installed torch's, else "
                        "13.0); CUDA < 11.7 or CUDA_MODULE_LOADING=EAGER loads every kernel "
                        "into a larger context")
    p.add_argument("--dtype", default=None, choices=DTYPES,
                   help="load dtype (bfloat16 = pure bf16 training; default: the model's, "
                        "float32 for a config)")
    p.add_argument("--num-gpus", type=positive_int, default=None,
                   help="data-parallel ranks: one rank's memory under DDP, or the FSDP / "
                        "DeepSpeed sharding given by fsdp=... / deepspeed=... fields")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--max-batch", action="store_true",
                   help="instead: the largest micro-batch that fits (reverse query)")
    p.add_argument("--max-seq-len", action="store_true",
                   help="instead: the longest seq_len (multiple of 64) that fits, up to --seq-len")
    p.add_argument("--headroom", type=fraction, default=None,
                   help="fraction of device memory kept free, in [0, 1) (default 0.1): the "
                        "budget of the verdict (fits) and of --max-batch/--max-seq-len")
    p.add_argument("--max-memory", default=None, metavar="SIZE",
                   help="explicit budget instead of the device's, e.g. 20GiB (as in plan): "
                        "what the verdict (fits) and --max-batch/--max-seq-len use")
    return p


def estimate_command(args: argparse.Namespace) -> int:
    from rich.console import Console

    from .._estimate import estimate_memory  # torch and transformers: only when a command runs
    from .._render import estimate_table, print_tables

    fields = dict(args.fields)
    if args.batch is not None:
        fields["per_device_train_batch_size"] = args.batch
        fields.setdefault("per_device_eval_batch_size", args.batch)
    if args.max_batch or args.max_seq_len:
        from .._plan import max_batch_size, max_seq_len

        kw = dict(device=args.gpu, headroom=args.headroom, task=args.task, dtype=args.dtype,
                  cuda_version=args.cuda_version, max_memory=args.max_memory)
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
                              num_gpus=args.num_gpus, cuda_version=args.cuda_version,
                              max_memory=args.max_memory,
                              **({} if args.headroom is None else {"headroom": args.headroom}))
    except ValueError as exc:
        raise HfMemkitError(str(exc)) from exc
    if args.json:
        print(json.dumps(est.to_dict(), indent=2, default=str))
    else:
        print_tables(Console(), estimate_table(est))
    return 0


def register(sub) -> None:
    estimate_parser(sub).set_defaults(func=estimate_command)
