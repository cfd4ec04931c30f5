"""``hf-memkit train RECIPE``: plan, prepare and train a recipe with the memory callbacks."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys

from rich.console import Console
from rich.table import Table

from .._units import format_bytes
from .estimate import parse_field


def train_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "train", help="plan, prepare and train a recipe (progress, memory logs, summary)",
        description="Plan RECIPE for its hardware, build the model (random init from the config "
                    "unless the model directory holds weights), apply the plan (attention, "
                    "LoRA/QLoRA, checkpointing) and train it through transformers.Trainer with "
                    "MemoryCallback (predicted vs measured memory, memory_report.json, "
                    "memory_timeline.png) and ThroughputCallback. FIELD=VALUE pins any "
                    "TrainingArguments field on top of the recipe's pins.",
        epilog="Examples:\n"
               "  hf-memkit train recipes/tiny-llama/1m_full_cpu.yaml\n"
               "  hf-memkit train tiny-llama/1m_full_cpu --max-steps 5 --output-dir /tmp/run\n"
               "  hf-memkit train my_recipe.yaml learning_rate=1e-4 --json\n"
               "Exit codes: 0 trained, 2 bad recipe or input (message on stderr), 1 the run "
               "failed.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("recipe", help="recipe .yaml file, or a bundled recipe name "
                                  "(hf-memkit recipes list)")
    p.add_argument("fields", nargs="*", metavar="FIELD=VALUE", type=parse_field,
                   help="TrainingArguments fields pinned on top of the recipe's pins")
    p.add_argument("--output-dir", default=None, help="override the recipe's output_dir")
    p.add_argument("--max-steps", type=int, default=None, help="override max_steps")
    p.add_argument("--json", action="store_true",
                   help="print a machine-readable summary (no tables, no progress bar)")
    return p


def memory_log_table(result) -> Table:
    t = Table(title="memory at each logging step (MemoryCallback)")
    for col in ("step", "peak allocated", "predicted peak", "measured / predicted",
                "allocated after step"):
        t.add_column(col, justify="right")
    for rec in result.timeline:
        pred = rec.get("predicted_peak")
        ratio = rec.get("actual_over_predicted")
        t.add_row(str(rec["step"]), format_bytes(rec.get("peak_allocated")),
                  format_bytes(pred) if pred else "-", f"{ratio:.3f}" if ratio else "-",
                  format_bytes(rec.get("allocated")))
    return t


def summary_table(result) -> Table:
    t = Table(title=f"trained {result.recipe}", show_header=False)
    t.add_column("field", style="bold")
    t.add_column("value")
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
        t.add_row(k, v)
    return t


def run_train(recipe_ref: str, *, output_dir: str | None = None, max_steps: int | None = None,
              pins: dict | None = None, as_json: bool = False,
              console: Console | None = None) -> int:
    """The body of ``hf-memkit train`` (also ``hf-memkit demo``)."""
    from .._recipe import load_recipe
    from .._render import plan_tables
    from .._train import check_trainable_here, plan_recipe, train_recipe, with_max_steps, with_pins

    console = console or Console()
    recipe = load_recipe(recipe_ref)
    if pins:
        recipe = with_pins(recipe, pins)
    if max_steps is not None:
        recipe = with_max_steps(recipe, max_steps)
    check_trainable_here(recipe)
    plan = plan_recipe(recipe)
    if not as_json:
        console.rule(f"plan for {recipe.source}")
        for table in plan_tables(plan):
            console.print(table)
    progress = None if as_json else Console(stderr=True)
    # --json: stdout carries only the JSON; libraries' chatter (e.g. deepspeed's accelerator
    # warning, printed to stdout) goes to stderr
    with contextlib.redirect_stdout(sys.stderr) if as_json else contextlib.nullcontext():
        result = train_recipe(recipe, plan=plan, output_dir=output_dir,
                              progress_console=progress)
    if as_json:
        print(json.dumps(result.to_dict(), indent=2, default=str))
    else:
        if result.timeline:
            console.print(memory_log_table(result))
        console.print(summary_table(result))
    return 0


def train_command(args: argparse.Namespace) -> int:
    return run_train(args.recipe, output_dir=args.output_dir, max_steps=args.max_steps,
                     pins=dict(args.fields), as_json=args.json)


def register(sub) -> None:
    train_parser(sub).set_defaults(func=train_command)
