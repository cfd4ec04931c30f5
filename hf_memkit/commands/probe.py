"""``hf-memkit probe``: describe this machine's device."""

from __future__ import annotations

import argparse
import json

from .estimate import device_index


def probe_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "probe", help="describe this machine's GPU (or CPU)",
        description="Probe device INDEX: CUDA through NVML or torch.cuda, else MPS, else the CPU.",
        epilog="Examples:\n  hf-memkit probe\n  hf-memkit probe --index 1 --json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--index", type=device_index, default=None,
                   help="CUDA device index (default: this process's device: LOCAL_RANK, else 0)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return p


def probe_command(args: argparse.Namespace) -> int:
    from rich.console import Console

    from .._device.probe import probe_device
    from .._views.text import device_table, print_tables

    dev = probe_device(args.index)
    if args.json:
        print(json.dumps(dev.to_dict(), indent=2))
    else:
        print_tables(Console(), device_table(dev, title="This machine"))
    return 0


def register(sub) -> None:
    probe_parser(sub).set_defaults(func=probe_command)
