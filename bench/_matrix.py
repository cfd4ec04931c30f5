"""Running a bench's matrix of measured cases: no case is dropped silently.

A case that needs an optional package declares it (``needs``); where that package is missing
the case is reported and counted as skipped. Any other case that cannot run is a failure: it is
reported, recorded in the results and makes the bench exit 1. The results file also records the
versions measured and the command line that wrote it.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import sys
import traceback
from collections.abc import Callable, Iterable
from pathlib import Path

VERSIONED = ("torch", "transformers", "trl", "peft", "accelerate")


def missing(needs: Iterable[str]) -> list[str]:
    """The packages of ``needs`` that cannot be imported here.

    Args:
        needs: importable module names.

    Returns:
        Those not installed, in order.
    """
    return [p for p in needs if importlib.util.find_spec(p) is None]


def run_matrix(cases: list[dict], run_case: Callable, console) -> tuple[list, list, list]:
    """Run every case, skipping (and reporting) those whose declared packages are missing.

    Args:
        cases: the cases, each with ``name`` and ``needs`` (module names).
        run_case: ``run_case(case, console) -> row`` (a dict).
        console: a rich console the outcomes are printed on.

    Returns:
        ``(rows, skipped, failed)``: the rows of the cases run; ``{"name", "missing"}`` for each
        case skipped; ``{"name", "error"}`` for each case that raised.
    """
    rows, skipped, failed = [], [], []
    for c in cases:
        gone = missing(c.get("needs", ()))
        if gone:
            skipped.append({"name": c["name"], "missing": gone})
            console.print(f"SKIPPED {c['name']}: needs {', '.join(gone)} (not installed)")
            continue
        try:
            rows.append(run_case(c, console))
        except Exception as ex:  # a failure, reported and counted: never a silent drop
            failed.append({"name": c["name"], "error": f"{type(ex).__name__}: {ex}"})
            console.print(f"FAILED {c['name']}: {type(ex).__name__}: {ex}")
            traceback.print_exc()
    if skipped:
        console.print(f"{len(skipped)} case(s) skipped, optional packages missing: "
                      + "; ".join(f"{s['name']} ({', '.join(s['missing'])})" for s in skipped))
    if failed:
        console.print(f"{len(failed)} case(s) FAILED: " + "; ".join(f["name"] for f in failed))
    return rows, skipped, failed


def versions(extra: Iterable[str] = ()) -> dict:
    """The installed versions of the measured stack.

    Args:
        extra: more distributions to record (e.g. the optional packages the cases need).

    Returns:
        ``{distribution: version or None (not installed)}``.
    """
    out = {}
    for name in dict.fromkeys((*VERSIONED, *extra)):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def write_results(path: str | Path, payload: dict, script: str, argv: list[str] | None,
                  extra: Iterable[str] = ()) -> None:
    """Write ``payload`` plus the versions and the command line as JSON.

    Args:
        path: the file to write.
        payload: the bench's ``summary``, ``rows``, ``skipped``, ``failed``.
        script: the bench's path, as run (``bench/estimator_cpu.py``).
        argv: its arguments (``None``: ``sys.argv[1:]``).
        extra: more distributions whose versions to record.
    """
    argv = sys.argv[1:] if argv is None else argv
    out = {**payload, "versions": versions(extra),
           "command": " ".join(["python", script, *argv])}
    with open(path, "w") as f:
        json.dump(out, f, indent=2)
