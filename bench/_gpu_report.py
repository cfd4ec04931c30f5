"""The result file and the error table of ``bench/gpu_truth.py``: file names, atomic writes,
the measured and predicted figure of each metric, relative errors and their summary.

Plain data in, plain data out (no torch import), so ``--list`` and the CPU tests read it anywhere.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import statistics
from pathlib import Path
from typing import Any

METRICS = ("allocated", "reserved", "device_used")


def _jsonable(o: Any) -> Any:
    if isinstance(o, (set, frozenset)):
        return sorted(o, key=str)
    if dataclasses.is_dataclass(o) and not isinstance(o, type):
        return dataclasses.asdict(o)
    return str(o)


def sanitize(text: str) -> str:
    """Letters, digits, '.', '_' and '-' only: each run of anything else becomes one '-'."""
    s = re.sub(r"[^A-Za-z0-9._-]+", "-", str(text).strip())
    return re.sub(r"-{2,}", "-", s).strip("-") or "unknown"


def result_filename(gpu_name: str, torch_version: str, date: str) -> str:
    """``<GPU>_torch<version>_<date>.json``; the torch version without its local part (+cu128)."""
    return f"{sanitize(gpu_name)}_torch{sanitize(torch_version.split('+')[0])}_{sanitize(date)}.json"


def unique_path(directory: Path, name: str) -> Path:
    """``directory/name``, or ``stem-2.json``... when a file of that name exists already."""
    path, stem, n = directory / name, Path(name).stem, 2
    while path.exists():
        path, n = directory / f"{stem}-{n}.json", n + 1
    return path


def write_json(path: Path, doc: dict[str, Any]) -> None:
    """Atomically: an interrupted run leaves the previous complete file, never half of one."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=_jsonable) + "\n")
    os.replace(tmp, path)


def measured_values(rec: dict[str, Any]) -> dict[str, int | None]:
    """The measured figure each estimate is compared with: the steady-state window's."""
    m = rec.get("measured") or {}
    steady = m.get("steady") or {}
    capped = "at_required" in m  # reserved was capped on purpose: only allocated compares
    return {"allocated": steady.get("max_allocated"),
            "reserved": None if capped else steady.get("max_reserved"),
            "device_used": m.get("device_used") if not capped and m.get(
                "device_used_basis", "").startswith("nvml_used -") else None}


def predicted_values(rec: dict[str, Any]) -> dict[str, int | None]:
    e = rec.get("estimate") or {}
    if "error" in e:
        return dict.fromkeys(METRICS)
    return {"allocated": e.get("peak_allocated"), "reserved": e.get("peak_reserved"),
            "device_used": e.get("device_used")}


def rel_errors(rec: dict[str, Any]) -> dict[str, float | None]:
    """predicted / measured - 1 per metric (None where either is missing)."""
    if rec.get("status") != "ok":
        return {}
    meas, pred = measured_values(rec), predicted_values(rec)
    return {k: (pred[k] / meas[k] - 1 if pred[k] is not None and meas[k] else None)
            for k in METRICS}


def summarise(records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per metric over the ok runs: n, median and median |.| of the relative error, the worst
    (signed, largest magnitude), the count of under-predictions (error < 0) and of errors within
    10% (the estimator's bar). A run whose
    window held no real optimizer step (fp16 skipped them all) is left out: its figures miss
    the optimizer state the estimate counts."""
    out = {}
    for k in METRICS:
        errs = [e for r in records if r.get("status") == "ok"
                and not (r.get("flags") or {}).get("window_without_optimizer_step")
                for e in [rel_errors(r).get(k)] if e is not None]
        out[k] = {"n": len(errs),
                  "median": statistics.median(errs) if errs else None,
                  "median_abs": statistics.median(abs(e) for e in errs) if errs else None,
                  "worst": max(errs, key=abs) if errs else None,
                  "under": sum(e < 0 for e in errs),
                  "within_10pct": sum(abs(e) <= 0.10 + 1e-9 for e in errs)}
    return out


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:+.1f}%"


def summary_rows(summary: dict[str, dict[str, Any]]) -> list[list[str]]:
    return [[k, str(s["n"]), _pct(s["median"]), _pct(s["median_abs"]).lstrip("+"),
             _pct(s["worst"]), str(s["under"])] for k, s in summary.items()]


SUMMARY_HEADER = ["metric", "runs", "median err", "median |err|", "worst err", "under-predicted"]
SUMMARY_TITLE = "hf_memkit estimate vs measured (predicted / measured - 1, steady state)"


def render_summary(summary: dict[str, dict[str, Any]]) -> str:
    """The error table as plain text."""
    rows = [SUMMARY_HEADER, *summary_rows(summary)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(SUMMARY_HEADER))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                       for i, (c, w) in enumerate(zip(r, widths, strict=True))) for r in rows]
    return "\n".join([SUMMARY_TITLE, *lines])


def _print_table(title: str, header: list[str], rows: list[list[str]], plain: str,
                 left: int = 1, width: int = 120) -> None:
    """``rows`` as a rich table (its first ``left`` columns left-aligned) where rich is
    installed, else ``plain``."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(plain)
        return
    t = Table(title=title)
    for i, col in enumerate(header):
        t.add_column(col, justify="left" if i < left else "right")
    for row in rows:
        t.add_row(*row)
    Console(width=width).print(t)


def print_summary(summary: dict[str, dict[str, Any]]) -> None:
    """With rich where it is installed, plain text otherwise."""
    _print_table(SUMMARY_TITLE, SUMMARY_HEADER, summary_rows(summary), render_summary(summary))


def _mib(x: int | None) -> str:
    return "-" if x is None else f"{x / 2**20:.0f}"


def progress_line(i: int, n: int, rec: dict[str, Any]) -> str:
    head = f"[{i:2d}/{n}] {rec['id']:<62s} {rec['status']:<7s}"
    if rec["status"] != "ok":
        return f"{head} {rec.get('error') or ''}"
    if rec.get("kind") == "bisect":
        b = rec["bisect"]
        return (f"{head} {rec['seconds']:5.1f}s bisect {b['result']} in {len(b['probes'])} "
                f"probes: capacity {_mib_fine(b['smallest_completing'])} MiB "
                f"(+-{_mib_fine(b['resolution'])}) + context {_mib_fine(b['context_measured'])}"
                f" = {_mib_fine(b['found_device'])} MiB; required {_mib_fine(b['required'])} MiB "
                f"({_pct(b['rel_error'])})")
    meas, pred, err = measured_values(rec), predicted_values(rec), rec.get("rel_error") or {}
    cols = " ".join(f"{k} {_mib(meas[k])}/{_mib(pred[k])} MiB ({_pct(err.get(k))})"
                    for k in METRICS)
    est_err = (rec.get("estimate") or {}).get("error")
    flags = " ".join(f"{k}={v}" for k, v in (rec.get("flags") or {}).items())
    return (f"{head} {rec['seconds']:5.1f}s {cols}" + (f"  estimate: {est_err[:80]}" if est_err
                                                       else "") + (f"  [{flags}]" if flags else ""))


# ---------------------------------------------------------------------------- bisect cases
def probe_line(case_id: str, p: dict[str, Any]) -> str:
    """One probe of a bisect case, as it ends."""
    return (f"      probe {case_id[:56]:<56s} capacity {_mib(p['capacity'])} MiB "
            f"({p['fraction']:.4f}): {p['outcome']:<9s} {p['seconds']:5.1f}s"
            + (f"  {p['error'][:100]}" if p.get("error") else ""))


def _bisected(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in records if r.get("kind") == "bisect"]


def bisect_summary(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Over the bisect cases that found a capacity: n, the median and worst (largest
    magnitude) of required / (capacity + context) - 1, how many under-predict (error < 0,
    within the bracket's resolution or not) and in how many the probes show the step does not
    complete at required's capacity (``fails_at_required``); the results' counts."""
    b = [r for r in _bisected(records) if r.get("bisect")]
    errs = [r["bisect"]["rel_error"] for r in b if r["bisect"]["result"] == "found"
            and r["bisect"]["rel_error"] is not None]
    results = [r["bisect"]["result"] for r in b]
    return {"cases": len(_bisected(records)), "n": len(errs),
            "median": statistics.median(errs) if errs else None,
            "worst": max(errs, key=abs) if errs else None, "under": sum(e < 0 for e in errs),
            "fails_at_required": sum(r["bisect"].get("required_completes") is False for r in b),
            "results": {k: results.count(k) for k in sorted(set(results))},
            "probes": sum(len(r["bisect"]["probes"]) for r in b),
            "seconds": round(sum(r.get("seconds") or 0 for r in _bisected(records)), 1)}


BISECT_HEADER = ["case", "result", "probes", "capacity", "+-", "context", "cap+ctx",
                 "required", "req err", "err (outside)", "device_used", "upper", "margin"]
BISECT_TITLE = ("smallest capacity at which the step completes (bisected; MiB): required / "
                "(capacity + measured context) - 1")


def _mib_fine(x: int | None) -> str:
    """MiB, with two decimals below 100 MiB (the shrunk models of --cpu-smoke)."""
    return "-" if x is None else f"{x / 2**20:.0f}" if x >= 100 * 2**20 else f"{x / 2**20:.2f}"


def bisect_rows(records: list[dict[str, Any]]) -> list[list[str]]:
    rows = []
    for r in _bisected(records):
        b = r.get("bisect")
        if not b:
            rows.append([r["id"], r["status"]] + ["-"] * (len(BISECT_HEADER) - 2))
            continue
        rows.append([r["id"], b["result"], str(len(b["probes"])),
                     *map(_mib_fine, (b["smallest_completing"], b["resolution"],
                                      b["context_measured"], b["found_device"], b["required"])),
                     _pct(b["rel_error"]), _pct(b.get("rel_error_outside")),
                     *map(_mib_fine, (b["device_used"], b["upper"], b["margin"]))])
    return rows


def render_bisect(records: list[dict[str, Any]]) -> str:
    """The bisect cases' table as plain text ("" without any)."""
    if not _bisected(records):
        return ""
    rows = [BISECT_HEADER, *bisect_rows(records)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(BISECT_HEADER))]
    lines = ["  ".join(c.ljust(w) if i < 2 else c.rjust(w)
                       for i, (c, w) in enumerate(zip(r, widths, strict=True))) for r in rows]
    return "\n".join([BISECT_TITLE, *lines])


def print_bisect(records: list[dict[str, Any]]) -> None:
    """With rich where it is installed, plain text otherwise; nothing without bisect cases."""
    if not _bisected(records):
        return
    _print_table(BISECT_TITLE, BISECT_HEADER, bisect_rows(records), render_bisect(records),
                 left=2, width=200)
