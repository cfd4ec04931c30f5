"""``hf-memkit`` root: registers each command module's parser.

Exit codes: 0 success, 2 bad input (message on stderr), 1 a failed run.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import warnings

from .._errors import HfMemkitError, TrainingFailed, visible
from . import (
    _answers,
    cache,
    calibrate,
    demo,
    devices,
    estimate,
    plan,
    probe,
    recipes,
    train,
)

COMMANDS = (devices, probe, calibrate, estimate, plan, train, recipes, cache, demo)


class Parser(argparse.ArgumentParser):
    """argparse's parser, with the fix said when an option's value starts with ``-`` (argparse
    reads ``--max-memory -5GiB`` as a missing value followed by an option)."""

    def error(self, message: str):
        if message.endswith("expected one argument"):
            flag = message.removeprefix("argument ").split(":")[0].split("/")[-1]
            message += (f" (a value that starts with '-' goes after '=': {flag}=-VALUE; the "
                        "value itself is then checked)")
        super().error(visible(message))


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="hf-memkit",
        description="Predict, plan and watch the memory of Hugging Face training runs.",
        epilog="Examples:\n  hf-memkit devices\n  hf-memkit probe --json\n"
               "  hf-memkit calibrate --check   # on a CUDA machine: measure this GPU\n"
               "  hf-memkit estimate Llama-3.1-8B --gpu RTX-4090 --seq-len 2048 --batch 1 bf16=true\n"
               "  hf-memkit plan Llama-3.1-8B --gpu RTX-4090 --seq-len 2048 --target-batch 32\n"
               "  hf-memkit plan recipes/llama-3.1/8b_qlora_rtx4090.yaml --json\n"
               "  hf-memkit train recipes/tiny-llama/1m_full_cpu.yaml\n"
               "  hf-memkit recipes validate\n"
               "  hf-memkit cache info         # traces kept between runs (--no-cache skips)\n"
               "  hf-memkit demo\n"
               "Exit codes: 0 success, 2 bad input (message on stderr), 1 a failed run.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in COMMANDS:
        module.register(sub)
    return parser


@contextlib.contextmanager
def _warnings_as_lines(command: str):
    """Our warnings (``UserWarning``: a setting that is ignored, a precision the device cannot
    run) as ``hf-memkit COMMAND: warning: ...`` on stderr, not Python's ``file:line:`` form."""
    shown = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, UserWarning):
            print(f"hf-memkit {command}: warning: {visible(str(message))}", file=sys.stderr)
        else:
            shown(message, category, filename, lineno, file, line)

    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = shown


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    # FIELD=VALUE settings may sit anywhere among the options (argparse cannot intermix them)
    args, extra = parser.parse_known_args(argv)
    if extra:
        if not hasattr(args, "fields") or any("=" not in e or e.startswith("-") for e in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        from .estimate import field_text

        try:
            args.fields = list(args.fields) + [field_text(e) for e in extra]
        except HfMemkitError as exc:
            print(f"hf-memkit {args.command}: error: {visible(str(exc))}", file=sys.stderr)
            return 2
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    from .._compat import quiet_notices
    from ._progress import status

    try:
        # what needs no torch is checked first (an unknown model or GPU: refused in < 1 s)
        if getattr(args, "before_torch", None) is not None:
            args.before_torch(args)
        key = _answers.question_key(args)   # the same question answered before: no torch
        kept = _answers.replay(key, args.command)
        if kept is not None:
            return kept
        with _answers.recording(key) as rec, quiet_notices(), \
                _warnings_as_lines(args.command), status(args):
            if hasattr(args, "fields"):  # their types come from TrainingArguments (torch)
                from .estimate import typed_fields

                args.fields = typed_fields(args.fields)
            code = int(args.func(args) or 0)
            rec.keep(code)   # a plan that fits or a tight one (``_answers.KEPT_CODES``)
            return code
    except HfMemkitError as exc:
        print(f"hf-memkit {args.command}: error: {visible(str(exc))}", file=sys.stderr)
        return 2
    except TrainingFailed as exc:
        print(f"hf-memkit {args.command}: run failed: {visible(str(exc))}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
