"""``hf-memkit demo``: the end-to-end slice a newcomer runs first (`make demo`) = ``hf-memkit train``
on the bundled tiny CPU recipe."""

from __future__ import annotations

import argparse

from .estimate import steps
from .train import add_output_arguments

DEMO_RECIPE = "recipes/tiny-llama/1m_full_cpu.yaml"


def demo_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "demo", help=f"train the tiny CPU recipe ({DEMO_RECIPE}) end to end",
        description="Probe this machine, then `hf-memkit train` the bundled tiny Llama recipe "
                    f"({DEMO_RECIPE}): the plan, a progress bar, the memory logs (predicted vs "
                    "measured), the trained model, memory_report.json and memory_timeline.png.",
        epilog="Examples:\n  hf-memkit demo\n  hf-memkit demo --steps 20 --output-dir /tmp/demo\n"
               "  hf-memkit demo --overwrite        # again, into the same demo_output\n"
               f"  hf-memkit train {DEMO_RECIPE}      # the same run",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--steps", type=steps, default=None,
                   help="optimizer steps (default: the recipe's max_steps, 40)")
    add_output_arguments(p, "where the model and reports go (default: the recipe's, "
                            "demo_output)")
    return p


def demo_command(args: argparse.Namespace) -> int:
    from rich.console import Console

    from .._device.probe import probe_device
    from .._views.text import device_table
    from .train import run_train

    console = Console()
    console.print(device_table(probe_device(), title="This machine"))
    return run_train(DEMO_RECIPE, output_dir=args.output_dir, max_steps=args.steps,
                     console=console, overwrite=args.overwrite)


def register(sub) -> None:
    demo_parser(sub).set_defaults(func=demo_command)
