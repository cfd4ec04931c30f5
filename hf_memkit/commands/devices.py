"""``hf-memkit devices``: list the bundled GPU catalog."""

from __future__ import annotations

import argparse
import json


def devices_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "devices", help="list the GPU catalog",
        description="List the GPUs hf-memkit can plan for without having them.",
        epilog="Examples:\n  hf-memkit devices\n  hf-memkit devices --json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return p


def devices_command(args: argparse.Namespace) -> int:
    from rich.console import Console

    from .._device.probe import get_device, list_devices
    from .._views.text import catalog_table, print_tables

    devs = [get_device(n) for n in list_devices()]
    if args.json:
        print(json.dumps([d.to_dict() for d in devs], indent=2))
    else:
        print_tables(Console(), catalog_table(devs))
    return 0


def register(sub) -> None:
    devices_parser(sub).set_defaults(func=devices_command)
