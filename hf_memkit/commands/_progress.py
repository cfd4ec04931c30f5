"""A one-line status on stderr while ``hf-memkit plan`` / ``estimate`` work: what is being
traced or estimated now (``_estimate.progress``), on a terminal only; ``--json`` and output
sent to a pipe or a file stay silent."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

COMMANDS = ("plan", "estimate")


@contextlib.contextmanager
def status(args: Any) -> Iterator[None]:
    """rich's status spinner on stderr for the body, fed by ``_estimate.progress.report``.

    Args:
        args (`argparse.Namespace`): The command line (its ``command`` and ``json``).
    """
    if args.command not in COMMANDS or getattr(args, "json", False) or not sys.stderr.isatty():
        yield
        return
    from rich.console import Console

    head = f"hf-memkit {args.command}"
    counts = {"estimating": 0}

    with Console(stderr=True).status(f"{head}: loading torch and transformers") as line:
        from .._estimate.progress import reporting  # imports torch: the line shows meanwhile

        def show(text: str) -> None:
            counts["estimating"] += text.startswith("estimating")
            n = counts["estimating"]
            line.update(f"{head}: {text}" + (f"  [{n} setup(s) so far]" if n else ""))

        with reporting(show):
            yield
