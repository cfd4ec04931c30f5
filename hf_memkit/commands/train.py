"""``hf-memkit train RECIPE``: plan, prepare and train a recipe with the memory callbacks."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from typing import TYPE_CHECKING

from .._units import format_bytes
from .estimate import parse_field, steps

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table


def train_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "train", help="plan, prepare and train a recipe (progress, memory logs, summary)",
        description="Plan RECIPE for its hardware, build the model (random init from the config "
                    "unless the model directory holds weights), apply the plan (attention, "
                    "LoRA/QLoRA, checkpointing) and train it through transformers.Trainer "
                    "(TRL's SFTTrainer for a recipe with `trainer: sft`) with "
                    "MemoryCallback (predicted vs measured memory, memory_report.json, "
                    "memory_timeline.png) and ThroughputCallback. FIELD=VALUE pins any "
                    "field of the trainer's config (TrainingArguments, SFTConfig) on top of "
                    "the recipe's pins.",
        epilog="Examples:\n"
               "  hf-memkit train recipes/tiny-llama/1m_full_cpu.yaml\n"
               "  hf-memkit train tiny-llama/1m_full_cpu --max-steps 5 --output-dir /tmp/run\n"
               "  hf-memkit train my_recipe.yaml learning_rate=1e-4 --json\n"
               "  hf-memkit train my_sft_recipe.yaml packing=true   # a recipe with trainer: sft\n"
               "  hf-memkit train my_recipe.yaml --report-to wandb --push-to-hub\n"
               "Writes: only to the output directory (a relative one stays inside the working "
               "directory; a directory that is not empty needs --overwrite); nothing is pushed "
               "to the Hub or reported to a service (report_to, push_to_hub in the recipe are "
               "refused) unless --push-to-hub / --report-to say so.\n"
               "Exit codes: 0 trained, 2 bad recipe or input (message on stderr), 1 the run "
               "failed (error.txt, memory_report.json and the model so far are kept in the "
               "output directory), 130 interrupted by Ctrl-C, 143 stopped by SIGTERM (docker "
               "stop, a batch scheduler; the same files are kept).\n"
               "On CPU, hf-memkit re-executes itself with MALLOC_MMAP_THRESHOLD_=65536 so that "
               "its memory readings are exact.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("recipe", help="recipe .yaml file, or a bundled recipe name "
                                  "(hf-memkit recipes list)")
    p.add_argument("fields", nargs="*", metavar="FIELD=VALUE", type=parse_field,
                   help="TrainingArguments fields pinned on top of the recipe's pins")
    add_output_arguments(p, "override the recipe's output_dir (a relative path stays inside "
                            "the working directory; give an absolute path to write elsewhere)")
    p.add_argument("--max-steps", type=steps, default=None, help="override max_steps")
    p.add_argument("--push-to-hub", action="store_true",
                   help="push the model to the Hugging Face Hub (the repository: the "
                        "recipe's hub_model_id, else the output directory's name); without "
                        "this flag push_to_hub / hub_* pins are refused")
    p.add_argument("--report-to", default=None, metavar="SERVICES",
                   help="report the run to these services, comma-separated (wandb, "
                        "tensorboard, mlflow, trackio, ... or all); default: none (a recipe's "
                        "report_to naming a service is refused, and inside a Kubeflow TrainJob "
                        "its status reporter is off unless named: --report-to kubeflow)")
    p.add_argument("--json", action="store_true",
                   help="print a machine-readable summary (no tables, no progress bar)")
    return p


def add_output_arguments(p: argparse.ArgumentParser, output_help: str) -> None:
    """``--output-dir`` and ``--overwrite`` (``train`` and ``demo``)."""
    p.add_argument("--output-dir", default=None, help=output_help)
    p.add_argument("--overwrite", action="store_true",
                   help="train into an output directory that is not empty (files of the same "
                        "name are replaced; without this flag such a directory is refused)")


def memory_log_table(result) -> Table:
    from .._views.text import add_column, add_row, new_table

    t = new_table("memory at each logging step (MemoryCallback)")
    for col in ("step", "peak\nallocated", "predicted\npeak", "measured /\npredicted",
                "allocated\nafter step"):
        add_column(t, col, numeric=True)
    for rec in result.timeline:
        pred = rec.get("predicted_peak")
        ratio = rec.get("actual_over_predicted")
        add_row(t, str(rec["step"]), format_bytes(rec.get("peak_allocated")),
                format_bytes(pred) if pred else "-", f"{ratio:.3f}" if ratio else "-",
                format_bytes(rec.get("allocated")))
    return t


def summary_table(result) -> Table:
    # plain-text cells (_views.text): rich markup would eat the "[plot]" of "hf-memkit[plot]"
    from .._views.text import add_column, add_row, new_table

    t = new_table(f"trained {result.recipe}", show_header=False)
    add_column(t, "field", style="bold")
    add_column(t, "value")
    c = result.plan.chosen
    loss = ("-" if result.first_loss is None else
            f"{result.first_loss:.4f} -> {result.last_loss:.4f}")
    rows = [
        ("setup", f"{c.label()}, attention {c.attn} (planned for {result.plan.device.name})"),
        ("loss (first -> last log)", loss),
        ("steps / time", f"{result.steps} steps in {result.seconds:.1f} s on {result.device}"
                         + (f" ({result.samples_per_second:.1f} samples/s)"
                            if result.samples_per_second else "")),
        ("peak memory predicted", format_bytes(result.predicted_peak)),
        ("peak memory measured", format_bytes(result.measured_peak)
         + (f" ({result.measured_peak / result.predicted_peak:.3f} x predicted)"
            if result.measured_peak and result.predicted_peak else "")),
        ("model saved to", str(result.model_dir)),
        ("memory report", str(result.memory_report or "-")),
        ("memory timeline PNG", str(result.memory_plot or
                                    "not drawn (pip install 'hf-memkit[plot]' for matplotlib)")),
    ]
    if result.oom_recoveries:
        rows.append(("OOM recoveries", str(result.oom_recoveries)))
    for k, v in rows:
        add_row(t, k, v)
    return t


def run_train(recipe_ref: str, *, output_dir: str | None = None, max_steps: int | None = None,
              pins: dict | None = None, as_json: bool = False,
              console: Console | None = None, overwrite: bool = False,
              push_to_hub: bool = False, report_to: str | None = None) -> int:
    """The body of ``hf-memkit train`` (also ``hf-memkit demo``)."""
    from rich.console import Console

    from .._recipe import load_recipe
    from .._run.train import (
        check_run_writes,
        check_trainable_here,
        check_trainer_runs,
        plan_recipe,
        train_recipe,
        with_max_steps,
        with_pins,
    )
    from .._run.writes import check_report_flag
    from .._views.text import plan_tables, print_tables

    console = console or Console()
    services = check_report_flag(report_to) if report_to is not None else []
    recipe = load_recipe(recipe_ref)
    if pins:
        recipe = with_pins(recipe, pins)
    if max_steps is not None:
        recipe = with_max_steps(recipe, max_steps)
    check_trainable_here(recipe)
    check_trainer_runs(recipe)   # before planning: e.g. DPO trains synthetic pairs only
    where_to = dict(output_dir=output_dir, overwrite=overwrite, push_to_hub=push_to_hub,
                    report_to=services)
    check_run_writes(recipe, **where_to)   # before planning: the output directory, the Hub
    plan = plan_recipe(recipe)
    if not as_json:
        console.rule(f"plan for {recipe.source}")
        print_tables(console, *plan_tables(plan))
    progress = None if as_json else Console(stderr=True)
    # --json: stdout carries only the JSON; libraries' chatter (e.g. deepspeed's accelerator
    # warning, printed to stdout) goes to stderr
    with contextlib.redirect_stdout(sys.stderr) if as_json else contextlib.nullcontext():
        try:
            result = train_recipe(recipe, plan=plan, progress_console=progress, **where_to)
        except KeyboardInterrupt as exc:   # TrainingInterrupted: what existed is saved
            return interrupted(exc)
        finally:
            close_process_group()
    if as_json:
        print(json.dumps({"trainer": recipe.trainer, **result.to_dict()}, indent=2, default=str))
    else:
        if result.timeline:
            print_tables(console, memory_log_table(result))
        print_tables(console, summary_table(result))
    return 0


def close_process_group() -> None:
    """Under torchrun, close the process group the Trainer opened before this process exits: a
    rank that leaves gloo's or NCCL's threads running at interpreter exit can abort after the run
    has succeeded (and torch warns that ``destroy_process_group`` was not called)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def interrupted(exc: BaseException, command: str = "train") -> int:
    """Ctrl-C or SIGTERM: one line on stderr (what was saved, where), exit code 128 + the
    signal: 130 (SIGINT), 143 (SIGTERM)."""
    import signal

    what = str(exc) or "interrupted before training began; nothing saved"
    print(f"hf-memkit {command}: {what}", file=sys.stderr, flush=True)
    return 128 + int(getattr(exc, "signum", signal.SIGINT))


def train_command(args: argparse.Namespace) -> int:
    from .._device.probe import pin_one_device

    try:
        reexec_with_mmap_threshold(args.recipe)
        pin_one_device()   # one process trains on one GPU, never nn.DataParallel over all
        return run_train(args.recipe, output_dir=args.output_dir, max_steps=args.max_steps,
                         pins=dict(args.fields), as_json=args.json, overwrite=args.overwrite,
                         push_to_hub=args.push_to_hub, report_to=args.report_to)
    except KeyboardInterrupt as exc:
        return interrupted(exc)


# ----------------------------------------------------------------------------------------------
# exact CPU memory readings: MALLOC_MMAP_THRESHOLD_ from process start
# (docs/stack-facts.md#cpu-ground-truth)
# ----------------------------------------------------------------------------------------------

REEXEC_GUARD = "HF_MEMKIT_REEXEC"   # set in the re-executed process: never a second time
_CLI_SCRIPTS = ("hf-memkit", os.path.join("hf_memkit", "commands", "main.py"),
                os.path.join("hf_memkit", "__main__.py"))


def reexec_with_mmap_threshold(recipe_ref: str) -> None:
    """Re-execute this ``hf-memkit`` process (same pid, argv and interpreter flags; so the same
    exit code and signals) with ``MALLOC_MMAP_THRESHOLD_=65536`` when a CPU run lacks it: glibc
    then maps every tensor on its own, and RSS counts tensor bytes exactly. Returns (nothing
    done) when it is set, after one re-execution, off glibc, when the run trains on a GPU, or
    when ``hf-memkit`` was not the program started (``main([...])`` called from Python)."""
    import platform

    from .._device.rss import MMAP_THRESHOLD

    if ("MALLOC_MMAP_THRESHOLD_" in os.environ or os.environ.get(REEXEC_GUARD)
            or not sys.argv or not sys.argv[0].endswith(_CLI_SCRIPTS)
            or platform.libc_ver()[0] != "glibc" or not _trains_on_cpu(recipe_ref)):
        return
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(MMAP_THRESHOLD), **{REEXEC_GUARD: "1"})
    argv = [sys.executable, *getattr(sys, "orig_argv", [sys.executable, *sys.argv])[1:]]
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, argv, env)
    except OSError:   # cannot exec: train here; set_mmap_threshold (mallopt) still applies
        return


def _trains_on_cpu(recipe_ref: str) -> bool:
    """The recipe's ``hardware.device`` is ``cpu``, or it names none and this machine has no
    NVIDIA driver. Read from the YAML alone (no torch import: the re-execution must be cheap);
    a recipe that does not parse is left to ``load_recipe`` to explain."""
    import yaml

    from .._recipe.load import resolve_recipe_path

    try:
        data = yaml.safe_load(resolve_recipe_path(recipe_ref).read_text())
        device = (data.get("hardware") or {}).get("device")
    except Exception:
        return False
    if device is None:
        return not os.path.exists("/proc/driver/nvidia")
    return str(device).lower() == "cpu"


def register(sub) -> None:
    train_parser(sub).set_defaults(func=train_command)
