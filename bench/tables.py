"""Write the benchmark tables of the docs from the committed results files, so that no figure in
the docs is typed by hand.

    python bench/tables.py            # rewrite every generated table in place
    python bench/tables.py --check    # exit 1 when a doc's table differs from its results file

A generated table sits in a Markdown file between two markers::

    <!-- table: estimator-cpu -->
    ...
    <!-- /table -->

Each name in ``TABLES`` reads one committed file (``bench/results/...``) that its bench writes;
rerun the bench, then this script, and the docs follow. Exit status: 0, 1 for ``--check`` with a
stale table, 2 for a marker naming no table or a results file that is missing.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKER = re.compile(r"(<!-- table: (?P<name>[a-z0-9-]+) -->\n)(?P<body>.*?)(<!-- /table -->)",
                    re.S)
MiB = 2**20


def _pct(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{100 * x:+.{digits}f}%"


def _abs_pct(x: float, digits: int = 2) -> str:
    return f"{100 * abs(x):.{digits}f}%"


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows]) + "\n"


def _worst(rows: list[dict[str, Any]]) -> dict[str, Any]:
    return max(rows, key=lambda r: abs(r["err"]))


def estimator_cpu(doc: dict[str, Any]) -> str:
    """``bench/estimator_cpu.py``: the summary, then every case."""
    rows, s = doc["rows"], doc["summary"]
    worst = _worst(rows)
    deep = [r for r in rows if r.get("extrapolated")]
    fused = [r for r in rows if "fused" in r["name"]]
    summary = [["hf_memkit `estimate_memory`", _abs_pct(s["median_abs_err"]),
                f"{_abs_pct(worst['err'])} ({worst['name']})"]]
    if fused:
        summary.append([f"the {len(fused)} `adamw_torch_fused` cases",
                        _abs_pct(statistics.median(abs(r["err"]) for r in fused)),
                        _abs_pct(_worst(fused)["err"])])
    if deep:
        summary.append([f"the {len(deep)} extrapolated (deeper than the full-trace limit)",
                        _abs_pct(statistics.median(abs(r["err"]) for r in deep)),
                        _abs_pct(_worst(deep)["err"])])
    summary += [["weights only (`accelerate estimate-memory`)",
                 _abs_pct(s["weights_only_median_abs_err"], 0), ""],
                ["18 bytes/param, nothing for activations",
                 _abs_pct(s["rule18_median_abs_err"], 0), ""]]
    skipped = doc.get("skipped") or []
    head = (f"{s['cases']} cases run, {len(skipped)} skipped"
            + (f" ({', '.join(str(k.get('name', k)) if isinstance(k, dict) else str(k) for k in skipped)})"
               if skipped else "") + _versions(doc) + ".\n\n")
    cases = [[r["name"], f"{r['measured'] / MiB:.1f}", f"{r['predicted'] / MiB:.1f}",
              _pct(r["err"]), r["phase"]] for r in rows]
    return (head + _table(["", "median abs error", "worst abs error"], summary) + "\n"
            + _table(["case", "measured MiB", "predicted MiB", "error", "peak phase"], cases))


def estimator_trl(doc: dict[str, Any]) -> str:
    """``bench/estimator_trl.py``: every case and the summary per trainer."""
    rows, s = doc["rows"], doc["summary"]
    cases = [[r["name"], r["trainer"], f"{r['measured'] / MiB:.1f}", f"{r['predicted'] / MiB:.1f}",
              _pct(r["err"]), r["phase"], _pct(r["plain_err"], 1)] for r in rows]
    per = [[k, _abs_pct(s[f"{k}_median_abs_err"]), _abs_pct(s[f"{k}_worst_abs_err"])]
           for k in ("sft", "dpo", "grpo", "rloo") if f"{k}_median_abs_err" in s]
    per.append(["all", _abs_pct(s["median_abs_err"]), _abs_pct(s["worst_abs_err"])])
    return (f"{s['cases']} cases run{_versions(doc)}.\n\n"
            + _table(["case", "trainer", "measured MiB", "predicted MiB", "error", "peak phase",
                      "estimated as a plain Trainer"], cases) + "\n"
            + _table(["trainer", "median abs error", "worst abs error"], per))


def _versions(doc: dict[str, Any]) -> str:
    v = doc.get("versions") or doc.get("environment") or {}
    got = [f"{k} {v[k]}" for k in ("torch", "transformers", "trl") if v.get(k)]
    return f" ({', '.join(got)})" if got else ""


def _cell(m: dict[str, Any]) -> str:
    return f"{_pct(m['median'], 1)}, {_pct(m['worst'], 1)}, {m['within_10pct']}/{m['n']}"


def gpu_reestimate(doc: dict[str, Any]) -> str:
    """``bench/gpu_reestimate.py --json``: the estimate each run recorded on the GPU (for the
    holdout, the honest figure: made before any change it prompted) beside today's."""
    out = []
    for side in ("fit", "holdout"):
        if side not in doc:
            continue
        for metric in ("allocated", "reserved", "device_used"):
            then, now = doc[side]["then"][metric], doc[side]["now"][metric]
            label = "**holdout**" if side == "holdout" else "fit"
            out.append([f"{label}, {then['n']}", metric.replace("device_used", "device_used (NVML)"),
                        f"**{_cell(then)}**" if side == "holdout" else _cell(then),
                        _cell(now) + (" (a fit figure)" if side == "holdout" else "")])
    env = doc.get("reestimated_with") or {}
    note = (f"Re-estimated with torch {env['torch']}, transformers {env['transformers']}.\n\n"
            if env else "")
    return note + _table(
        ["runs", "metric", "estimated on the GPU when it ran: median, worst, within 10%",
         "re-estimated now: median, worst, within 10%"], out)


def fit_constants(_doc: Any) -> str:
    """``bench/fit_constants.py``: each constant fitted on the declared fit file."""
    import fit_constants as fc

    out = fc.compute()
    rows = []
    for name, c in out["constants"].items():
        fmt = (lambda v: f"{v / MiB:.0f} MiB") if name.isupper() else (lambda v: f"{v:.3f}")
        rows.append([f"`{name}`", fmt(c["fitted"]), fmt(c["held"]),
                     "yes" if c["agrees"] else "**no**"])
    return (f"Fit set: {', '.join(out['fit_files'])}.\n\n"
            + _table(["constant", "the rule gives", "held", "agrees"], rows))


TABLES: dict[str, tuple[Path | None, Callable[[Any], str]]] = {
    "estimator-cpu": (RESULTS / "estimator_cpu.json", estimator_cpu),
    "estimator-trl": (RESULTS / "estimator_trl.json", estimator_trl),
    "gpu-reestimate": (RESULTS / "gpu" / "reestimate.json", gpu_reestimate),
    "fit-constants": (None, fit_constants),
}


def render(name: str) -> str:
    """The Markdown body of one generated table.

    Args:
        name: a key of ``TABLES``.

    Returns:
        The table (and its one-line heading), ending with a newline.

    Raises:
        KeyError: no such table.
        FileNotFoundError: its results file is missing.
    """
    path, fn = TABLES[name]
    doc = json.loads(path.read_text()) if path is not None else None
    rel = f"`{path.relative_to(ROOT)}`" if path is not None else "`bench/results/gpu` (FIT_SET)"
    return fn(doc) + f"\n(Generated by `python bench/tables.py` from {rel}.)\n"


def update(text: str) -> tuple[str, list[str]]:
    """``text`` with every generated table re-rendered, and the names it holds."""
    names: list[str] = []

    def one(m: re.Match[str]) -> str:
        names.append(m["name"])
        return m.group(1) + render(m["name"]) + m.group(4)

    return MARKER.sub(one, text), names


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true",
                    help="change nothing; exit 1 when a table differs from its results file")
    a = ap.parse_args(argv)
    stale, seen = [], set()
    for doc in DOCS:
        text = doc.read_text()
        try:
            new, names = update(text)
        except KeyError as e:
            print(f"{doc}: no table named {e}; known: {', '.join(TABLES)}", file=sys.stderr)
            return 2
        except FileNotFoundError as e:
            print(f"{doc}: results file missing: {e.filename}; run its bench", file=sys.stderr)
            return 2
        seen.update(names)
        if new != text:
            stale.append(str(doc.relative_to(ROOT)))
            if not a.check:
                doc.write_text(new)
    unused = sorted(set(TABLES) - seen)
    if unused:
        print(f"no doc shows: {', '.join(unused)}", file=sys.stderr)
    if stale:
        print(("stale (run `python bench/tables.py`): " if a.check else "rewrote: ")
              + ", ".join(stale))
    return 1 if (a.check and stale) or unused else 0


if __name__ == "__main__":
    sys.exit(main())
