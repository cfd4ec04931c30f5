"""``hf-memkit plan``: the fastest training setup that fits, explained (for a model or a recipe)."""

from __future__ import annotations

import argparse
from importlib import resources
from pathlib import Path

from .._engines import engine_choices
from .._errors import HfMemkitError
from .._methods import method_choices
from .._model.tasks import task_choices
from ._write import add_write_options
from .cache import add_cache_option, apply_cache_option
from .estimate import (
    add_trainer_option,
    check_input,
    field_text,
    fraction,
    gpus,
    positive_number,
    read_lengths,
    samples,
    tokens,
    trainer_fields,
    trainer_option,
)

RECIPE_SUFFIXES = (".yaml", ".yml")


def plan_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "plan", help="choose the fastest setup that fits a GPU (for a model or a recipe)",
        description="Search precision, micro-batch/accumulation, optimizer, checkpointing and "
                    "LoRA/QLoRA for MODEL on a GPU and print the choice with every alternative. "
                    "Given a RECIPE (.yaml), its values are the defaults and the flags below "
                    "override them.",
        epilog="Examples:\n"
               "  hf-memkit plan Llama-3.1-8B --gpu RTX-4090 --seq-len 2048 --target-batch 32\n"
               "  hf-memkit plan Llama-3.1-70B --gpu H100-80GB --seq-len 4096 --target-batch 16 "
               "--json\n"
               "  hf-memkit plan gpt2 --gpu T4 --seq-len 1024 --target-batch 64 --method full\n"
               "  hf-memkit plan Llama-3.1-70B --gpu H100-80GB --num-gpus 16 --num-nodes 2 "
               "--seq-len 4096 --target-batch 64 --engine deepspeed\n"
               "  hf-memkit plan recipes/llama-3.1/8b_qlora_rtx4090.yaml\n"
               "  hf-memkit plan recipes/llama-3.1/8b_qlora_rtx4090.yaml --gpu A10G --seq-len 1024\n"
               "  hf-memkit plan Llama-3.1-8B --gpu A100-80GB --seq-len 2048 --target-batch 64 "
               "--trainer sft packing=true   # TRL's SFTTrainer\n"
               "  hf-memkit plan Llama-3.1-8B --gpu A100-80GB --target-batch 64 --trainer sft "
               "--lengths lengths.txt\n\n"
               "Exit status: 0 a setup fits, 3 the plan is tight (no setup fits with its "
               "margin; the chosen one fits at the centre), 2 no setup fits or bad input.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("model", metavar="MODEL|RECIPE",
                   help="bundled model name, local directory with config.json, or a recipe "
                        "(.yaml file or bundled recipe name; hf-memkit recipes list)")
    p.add_argument("fields", nargs="*", metavar="FIELD=VALUE", type=field_text,
                   help="TrainingArguments fields to pin, e.g. optim=adamw_torch_fused (with "
                        "--trainer sft/dpo/grpo/rloo: their config's fields, e.g. packing=true)")
    p.add_argument("--gpu", default=None, help="catalog GPU or 'cpu'; default: this machine "
                                               "(or the recipe's hardware.device)")
    p.add_argument("--num-gpus", type=gpus, default=None,
                   help="GPUs over all nodes: data-parallel ranks (DDP, else FSDP2 / ZeRO "
                        "sharding), each sequence split over several where whole ones do not fit "
                        "(context parallelism; Ulysses with --engine deepspeed)")
    p.add_argument("--num-nodes", type=gpus, default=None, help="nodes (default 1)")
    p.add_argument("--engine", default=None, choices=engine_choices(), metavar="ENGINE",
                   help="data-parallel engine: auto (default: DDP if a replica fits, else "
                        "FSDP2), ddp, fsdp (FSDP2, either sharding strategy), fsdp-full-shard, "
                        "fsdp-shard-grad-op, fsdp-offload, deepspeed (ZeRO-2 or 3), zero2, "
                        "zero3, zero3-offload")
    p.add_argument("--host-memory", default=None,
                   help="CPU RAM per node that offload may use, e.g. 512GiB")
    p.add_argument("--seq-len", type=tokens, default=None,
                   help="tokens per sequence (required without a recipe)")
    p.add_argument("--target-batch", type=samples, default=None,
                   help="effective batch size (required without a recipe)")
    p.add_argument("--lengths", default=None, metavar="FILE",
                   help="with --trainer sft, instead of --seq-len: the rows' token counts, one "
                        "integer per line or a JSON list; micro-batches are planned in tokens "
                        "(padded, or padding-free where the attention allows)")
    p.add_argument("--mean-len", type=positive_number, default=None,
                   help="with --trainer sft and --max-len, instead of --lengths: the mean row "
                        "length in tokens")
    p.add_argument("--max-len", type=tokens, default=None,
                   help="with --mean-len: the longest row in tokens")
    p.add_argument("--method", default=None, choices=method_choices(),
                   help="default: auto (or the recipe's)")
    p.add_argument("--max-memory", default=None, help="explicit budget, e.g. 20GiB")
    p.add_argument("--headroom", type=fraction, default=None,
                   help="fraction of memory kept free for other tenants, in [0, 1) (default 0: "
                        "a catalog card is planned headless; ignored with --max-memory)")
    p.add_argument("--task", default=None, metavar="TASK", choices=task_choices(),
                   help=f"head: {', '.join(task_choices(aliases=False))}")
    p.add_argument("--cuda-version", default=None, metavar="X.Y",
                   help="the target's CUDA, e.g. 12.8 (default: the installed torch's, else "
                        "13.0); CUDA < 11.7 or CUDA_MODULE_LOADING=EAGER loads every kernel "
                        "into a larger context")
    add_trainer_option(p)
    p.add_argument("--json", action="store_true",
                   help="print the plan as JSON: `chosen` (setup, memory, fits, training args) "
                        "first, then the estimated setups; Plan.from_json reads it")
    p.add_argument("--full", action="store_true",
                   help="with --json: every setup considered, each with its full estimate")
    add_write_options(p)
    add_cache_option(p)
    return p


def is_recipe_ref(ref: str) -> bool:
    """A ``.yaml`` path, or the name of a bundled recipe (``llama-3.1/8b_qlora_rtx4090``)."""
    if Path(ref).suffix in RECIPE_SUFFIXES:
        return True
    if Path(ref).exists():
        return False
    from .._recipe import bundled_recipes_dir

    root = bundled_recipes_dir()
    return root is not None and (root / f"{ref}.yaml").is_file()


def check_plan_input(args: argparse.Namespace) -> None:
    """``estimate.check_input`` before torch loads; a recipe's model is checked as it loads."""
    check_input(args, model=not may_be_recipe(args.model))


def may_be_recipe(ref: str) -> bool:
    """``is_recipe_ref`` without importing the recipe loader (torch): a bundled recipe is looked
    up in the package data, where ``_recipe.bundled_recipes_dir`` looks first; without that
    folder, any name may be one (the full check decides)."""
    if Path(ref).suffix in RECIPE_SUFFIXES:
        return True
    if Path(ref).exists():
        return False
    root = resources.files("hf_memkit") / "recipes"
    return not root.is_dir() or (root / f"{ref}.yaml").is_file()


def plan_command(args: argparse.Namespace) -> int:
    from .._plan import plan_training  # torch and transformers: only when a command runs
    from .._plan.request import SEARCH_CONSTRAINTS

    apply_cache_option(args)
    args.trainer = trainer_option(args.trainer)
    if args.overwrite and args.write_config is None:
        raise HfMemkitError("--overwrite replaces the files of --write-config DIR; give "
                            "--write-config DIR too, or drop --overwrite")
    if args.write_config is not None:  # before the search: a refused folder costs nothing
        from ._write import check_folder

        check_folder(args.write_config, overwrite=args.overwrite)
    cli = dict(device=args.gpu, num_gpus=args.num_gpus, seq_len=args.seq_len,
               target_batch_size=args.target_batch, method=args.method,
               max_memory=args.max_memory, headroom=args.headroom, task=args.task,
               num_nodes=args.num_nodes, engine=args.engine, host_memory=args.host_memory,
               cuda_version=args.cuda_version, trainer=args.trainer,
               lengths=read_lengths(args.lengths), mean_len=args.mean_len,
               max_len=args.max_len)
    if is_recipe_ref(args.model):
        from .._recipe import load_recipe

        recipe = load_recipe(args.model)
        pins = trainer_fields(args.fields, args.trainer or recipe.trainer,
                              also=SEARCH_CONSTRAINTS)
        kwargs = recipe.plan_kwargs(**cli, **pins)
    else:
        by_lengths = args.lengths is not None or args.mean_len is not None
        missing = [flag for flag, v in (("--seq-len", args.seq_len or by_lengths),
                                        ("--target-batch", args.target_batch)) if not v]
        if missing:
            raise HfMemkitError(f"{' and '.join(missing)} required when planning a model "
                                f"(`{args.model}`); or give a recipe .yaml that sets them"
                                + (" (with --trainer sft, --lengths FILE or --mean-len/--max-len "
                                   "may replace --seq-len)" if "--seq-len" in missing else ""))
        pins = trainer_fields(args.fields, args.trainer, also=SEARCH_CONSTRAINTS)
        kwargs = dict(model=args.model, **{k: v for k, v in cli.items() if v is not None},
                      **pins)
    if args.headroom is not None and kwargs.get("max_memory") is not None:
        import sys

        print(f"hf-memkit plan: note: --headroom {args.headroom} is ignored: max_memory "
              f"{kwargs['max_memory']} is the whole budget (drop one of them)", file=sys.stderr)
    if kwargs.get("max_memory") is not None:
        kwargs["headroom"] = None  # said above (or a recipe's default): no second warning
    plan = plan_training(**kwargs)
    written = None
    if args.write_config is not None:
        from ._write import write_config

        written = write_config(plan, args.write_config, task=args.task,
                               overwrite=args.overwrite)
    if args.json:
        import json

        from .._trainers import TRAINER, TRAINER_KEY

        d = plan.to_dict(full=args.full)
        trainer = plan.estimate.setup.trainer.name if plan.estimate is not None else TRAINER.name
        print(json.dumps({"chosen": d.pop("chosen"), TRAINER_KEY: trainer, **d,
                          **({"written": written} if written else {})}, indent=2))
    else:
        from rich.console import Console

        from .._views.text import plan_tables, print_tables

        print_tables(Console(), *plan_tables(plan, written))
    return 3 if plan.verdict == "tight" else 0  # no setup fits: an error, exit 1


def register(sub) -> None:
    plan_parser(sub).set_defaults(func=plan_command, before_torch=check_plan_input)
