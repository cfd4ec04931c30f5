"""``hf-memkit demo``: the end-to-end slice a newcomer runs first (README)."""

from __future__ import annotations

import argparse

from rich.console import Console

from .._demo import run_demo
from .._render import device_table, profile_table
from .._units import format_bytes


def demo_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "demo", help="probe, profile and train a tiny Llama on this machine",
        description="Probe this machine, profile a tiny Llama built from a config, train it on "
                    "synthetic data through transformers.Trainer and report memory used.",
        epilog="Examples:\n  hf-memkit demo\n  hf-memkit demo --steps 20 --output-dir /tmp/demo",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--steps", type=int, default=40, help="optimizer steps (default 40)")
    p.add_argument("--output-dir", default="demo_output", help="Trainer output_dir")
    return p


def demo_command(args: argparse.Namespace) -> int:
    console = Console()
    r = run_demo(args.output_dir, steps=args.steps)
    console.print(device_table(r.device, title="This machine"))
    console.print(profile_table(r.profile))
    console.print(
        f"Trained {r.steps} steps in {r.seconds:.1f} s: loss {r.first_loss:.3f} -> {r.last_loss:.3f}"
    )
    console.print(
        f"Process memory: {format_bytes(r.rss_before_train)} resident before training, "
        f"training added at most {format_bytes(r.peak_rss_during_train)} (peak RSS, /proc VmHWM)"
    )
    return 0


def register(sub) -> None:
    demo_parser(sub).set_defaults(func=demo_command)
