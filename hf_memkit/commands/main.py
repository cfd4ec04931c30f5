"""``hf-memkit`` root: registers each command module's parser.

Exit codes: 0 success, 2 bad input (message on stderr), 1 a failed run.
"""

from __future__ import annotations

import argparse
import sys

from .._errors import HfMemkitError, TrainingFailed
from . import calibrate, demo, devices, estimate, plan, probe, recipes, train

COMMANDS = (devices, probe, calibrate, estimate, plan, train, recipes, demo)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hf-memkit",
        description="Predict, plan and watch the memory of Hugging Face training runs.",
        epilog="Examples:\n  hf-memkit devices\n  hf-memkit probe --json\n"
               "  hf-memkit calibrate --check   # on a CUDA machine: measure this GPU\n"
               "  hf-memkit estimate Llama-3.1-8B --gpu RTX-4090 --seq-len 2048 --batch 1 bf16=true\n"
               "  hf-memkit plan Llama-3.1-8B --gpu RTX-4090 --seq-len 2048 --target-batch 32\n"
               "  hf-memkit plan recipes/llama-3.1/8b_qlora_rtx4090.yaml --json\n"
               "  hf-memkit train recipes/tiny-llama/1m_full_cpu.yaml\n"
               "  hf-memkit recipes validate\n"
               "  hf-memkit demo\n"
               "Exit codes: 0 success, 2 bad input (message on stderr), 1 a failed run.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in COMMANDS:
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    # FIELD=VALUE settings may sit anywhere among the options (argparse cannot intermix them)
    args, extra = parser.parse_known_args(argv)
    if extra:
        if not hasattr(args, "fields") or any("=" not in e or e.startswith("-") for e in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        from .estimate import parse_field

        try:
            args.fields = list(args.fields) + [parse_field(e) for e in extra]
        except HfMemkitError as exc:
            print(f"hf-memkit {args.command}: error: {exc}", file=sys.stderr)
            return 2
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    from .._compat import quiet_notices

    try:
        with quiet_notices():  # no third-party notices that our own calls trigger
            return int(args.func(args) or 0)
    except HfMemkitError as exc:
        print(f"hf-memkit {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except TrainingFailed as exc:
        print(f"hf-memkit {args.command}: run failed: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
