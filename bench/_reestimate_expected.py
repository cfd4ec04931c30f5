"""The recorded errors of bench/gpu_reestimate.py's re-estimates (``--write-expected``), and the
comparison CI makes with them (tests/unit/bench/test_gpu_reestimate.py).

Each committed GPU run (bench/results/gpu) is re-estimated on a CPU; its error (predicted /
measured - 1, per metric) is recorded with the torch and transformers versions it was made with.
A later re-estimate fails the check when a run's error moves from its recorded one by more than
``max(MARGIN_FLOOR, MARGIN_SHARE x |recorded|)``, or when runs were added or removed without
regenerating. The file is written by the script, never by hand.
"""

from __future__ import annotations

import importlib.metadata as md
from typing import Any

METRICS = ("allocated", "reserved", "device_used")
MARGIN_FLOOR = 0.01   # 1 percentage point of the measured figure
MARGIN_SHARE = 0.5    # half the recorded error, for runs whose error is itself large
LARGE = 0.10          # the estimator's bar: runs above it are named in the file's notes


def _version(name: str) -> str | None:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def allowed(recorded: float) -> float:
    """How far a run's error may move from its recorded one before the check fails.

    Args:
        recorded: the recorded error (predicted / measured - 1).

    Returns:
        max(``MARGIN_FLOOR``, ``MARGIN_SHARE`` x |recorded|).
    """
    return max(MARGIN_FLOOR, MARGIN_SHARE * abs(recorded))


def expectations(rows: dict[str, list[tuple[str, dict[str, Any]]]],
                 file_versions: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The expectations document of one re-estimate.

    Args:
        rows: per side ("fit", "holdout"), (key, row) pairs: key ``FILE::RUN_ID``, row as
            ``gpu_reestimate --json`` writes it (``measured``, ``now``).
        file_versions: per results file, the ``environment`` it recorded.

    Returns:
        ``{"made_with", "margin", "notes", "fit", "holdout"}``: per side, per run key, the
        measured bytes and today's error per metric (None where the run has no such figure).
    """
    made_with = {k: _version(k) for k in ("torch", "transformers", "peft")}
    notes = [f"written by `python bench/gpu_reestimate.py --write-expected PATH`; never edit by "
             f"hand. A run fails the check when its error moves from the one recorded here by "
             f"more than max({MARGIN_FLOOR:.0%}, {MARGIN_SHARE:g} x |recorded|)."]
    for name, env in sorted(file_versions.items()):
        gaps = [f"{k} {env.get(k)} there, {made_with[k]} here" for k in made_with
                if env.get(k) and made_with[k]
                and str(env[k]).split("+")[0] != made_with[k].split("+")[0]]
        if gaps:
            notes.append(f"{name} was measured with other versions ({'; '.join(gaps)}): the "
                         "re-estimate runs this machine's model code, which may differ from "
                         "what ran on the GPU (T5's SDPA mask layout, hence its CUDA kernel, "
                         "changed after transformers 5.17).")
    doc: dict[str, Any] = {"made_with": made_with,
                           "margin": {"floor": MARGIN_FLOOR, "share": MARGIN_SHARE},
                           "notes": notes}
    for side, pairs in rows.items():
        doc[side] = {key: {"measured": row["measured"],
                           "error": {k: row["now"].get(k) for k in METRICS}}
                     for key, row in pairs}
        for key, row in pairs:
            large = [f"{k} {row['now'][k]:+.1%}" for k in METRICS
                     if row["now"].get(k) is not None and abs(row["now"][k]) > LARGE]
            if large:
                notes.append(f"{side} {key}: recorded error beyond {LARGE:.0%}: "
                             f"{', '.join(large)}")
    return doc


def departures(expected: dict[str, Any],
               rows: dict[str, list[tuple[str, dict[str, Any]]]]) -> list[str]:
    """What differs between a re-estimate and the recorded expectations, one line each.

    Args:
        expected: the document ``expectations`` wrote.
        rows: the re-estimate, as ``expectations`` takes it.

    Returns:
        One line per run added or removed, per measured figure changed, per metric whose
        error moved by more than ``allowed``; empty when the re-estimate agrees.
    """
    out = []
    for side in ("fit", "holdout"):
        want, got = expected.get(side, {}), dict(rows.get(side, []))
        out += [f"{side}: {k} is not in the expectations (regenerate them)"
                for k in sorted(set(got) - set(want))]
        out += [f"{side}: {k} was not re-estimated (regenerate the expectations)"
                for k in sorted(set(want) - set(got))]
        for key in sorted(set(want) & set(got)):
            rec, row = want[key], got[key]
            if rec["measured"] != row["measured"]:
                out.append(f"{side}: {key}: measured {row['measured']}, recorded "
                           f"{rec['measured']}")
            for k in METRICS:
                then, now = rec["error"].get(k), row["now"].get(k)
                if (then is None) != (now is None):
                    out.append(f"{side}: {key}: {k} error {now}, recorded {then}")
                elif then is not None and abs(now - then) > allowed(then):
                    out.append(f"{side}: {key}: {k} error {now:+.2%}, recorded {then:+.2%} "
                               f"(allowed +-{allowed(then):.2%})")
    return out
