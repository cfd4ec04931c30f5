"""``--quick``, shared by the benches: a few representative cases, and never a committed file.

A quick run (tests/unit/bench/test_benches_rerun.py runs every bench so) checks that a bench
runs end to end and writes its results; its figures are not the published ones. So a quick run
writes only where it is told, never under ``bench/results/``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
HELP = ("a few representative cases, in seconds: checks the bench end to end (tests); its "
        "figures are not the published ones and it never writes under bench/results/")


def add_flag(ap: argparse.ArgumentParser) -> None:
    """Add ``--quick`` to a bench's parser.

    Args:
        ap: the bench's argument parser.
    """
    ap.add_argument("--quick", action="store_true", help=HELP)


def guard(quick: bool, path: str | Path | None, flag: str) -> None:
    """Refuse a quick run that would write under ``bench/results/``, or nowhere at all.

    Args:
        quick: whether the run is ``--quick``.
        path: where the bench will write its results (``None``: nowhere).
        flag: the option that sets ``path``, named in the message.

    Raises:
        SystemExit: (its message on stderr, exit status 1) ``quick`` and ``path`` is missing
            or under bench/results/.
    """
    if not quick:
        return
    if path is None:
        raise SystemExit(f"--quick needs {flag} PATH: a quick run writes only where it is told")
    target = Path(path).resolve()
    if target == RESULTS or RESULTS in target.parents:
        raise SystemExit(f"--quick writes no file under {RESULTS} (got {flag} {path}): its "
                         "figures are not the published ones")
