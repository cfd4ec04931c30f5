"""The PNG memory timeline of a ``MemoryCallback`` report (compute first, render separately).

``draw_timeline`` builds the figure from the report (bytes); ``plot_timeline`` saves it. What a
reader sees at a glance: the y axis starts at 0 and is labelled in MiB or GiB; each logged step
has two side-by-side bars, the forward + backward peak and the optimizer-step peak, that never
overlap; the peak since the previous log and the memory allocated after the step are lines drawn
above the bars; reserved is its own dashed line on CUDA (on CPU it equals allocated, so one line
says so); the predicted peak is a labelled horizontal line; OOM recoveries are vertical lines.
"""

from __future__ import annotations

import math
from typing import Any

from .._compat import require
from .._units import GiB, MiB, format_bytes

PHASES = (("peak_fwd_bwd", "forward + backward peak", "tab:blue"),
          ("peak_optimizer", "optimizer-step peak", "tab:orange"))
BAR_WIDTH = 0.3   # of the smallest spacing between logged steps, per phase bar
BAR_GAP = 0.06    # between the two bars of one step, same unit


def plot_timeline(report: dict[str, Any], path: str) -> str:
    """Draw the report's timeline (``draw_timeline``) into the PNG ``path``; returns ``path``."""
    require("matplotlib", "the memory timeline PNG (MemoryCallback(plot=True))")
    import matplotlib.pyplot as plt

    fig = draw_timeline(report)
    try:
        fig.savefig(path, dpi=100)
    finally:
        plt.close(fig)
    return path


def draw_timeline(report: dict[str, Any]):
    """The timeline as a matplotlib ``Figure`` (one ``Axes``); the caller closes it."""
    matplotlib = require("matplotlib", "the memory timeline PNG (MemoryCallback(plot=True))")
    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    steps = report["steps"]
    xs = [r["step"] for r in steps]
    predicted = report.get("predicted_peak_allocated")
    top = max([_num(r.get(k)) for r in steps
               for k in ("peak_allocated", "reserved", "peak_fwd_bwd", "peak_optimizer")]
              + [predicted or 0, 1])
    unit, scale = ("GiB", GiB) if top >= GiB else ("MiB", MiB)

    fig, ax = plt.subplots(figsize=(9, 5.5), layout="constrained")
    _phase_bars(ax, xs, steps, scale)
    _memory_lines(ax, xs, steps, scale, report.get("device"))
    if predicted:
        ax.axhline(predicted / scale, color="red", linestyle="--", linewidth=1.5, zorder=6,
                   label=f"predicted peak ({format_bytes(predicted)})")
        ax.annotate(f"predicted\n{format_bytes(predicted)}", (1.0, predicted / scale),
                    xycoords=("axes fraction", "data"), xytext=(4, 0),
                    textcoords="offset points", ha="left", va="center", color="red",
                    fontsize="small", annotation_clip=False)
    for i, ev in enumerate(report.get("events", [])):
        ax.axvline(ev["step"], color="black", linestyle=":", zorder=6,
                   label="OOM recovery" if i == 0 else None)
    ax.set_ylim(0, top / scale * 1.15)
    if len(xs) <= 12:
        ax.set_xticks(xs)
    else:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("optimizer step (one group per logging step)")
    ax.set_ylabel(f"memory ({unit})")
    ax.set_title(_title(report), fontsize="medium")
    ax.grid(axis="y", alpha=0.3)
    fig.legend(loc="outside lower center", ncols=3, fontsize="small", frameon=False)
    return fig


def _num(v: Any) -> float:
    return float(v) if v is not None else 0.0


def _spacing(xs: list[int]) -> float:
    gaps = [b - a for a, b in zip(xs, xs[1:], strict=False) if b > a]
    return float(min(gaps)) if gaps else 1.0


def _phase_bars(ax, xs: list[int], steps: list[dict[str, Any]], scale: int) -> None:
    """Two bars per logged step from 0, side by side: [x - gap/2 - w, x - gap/2] holds the
    forward + backward peak, [x + gap/2, x + gap/2 + w] the optimizer-step peak."""
    s = _spacing(xs)
    w, gap = BAR_WIDTH * s, BAR_GAP * s
    for side, (key, label, color) in zip((-1, 1), PHASES, strict=True):
        pts = [(x, r[key] / scale) for x, r in zip(xs, steps, strict=True)
               if r.get(key) is not None]
        if not pts:
            continue
        lefts = [x - gap / 2 - w if side < 0 else x + gap / 2 for x, _ in pts]
        ax.bar(lefts, [h for _, h in pts], width=w, align="edge", color=color, alpha=0.35,
               edgecolor=color, linewidth=0.8, label=label, zorder=2)


def _memory_lines(ax, xs, steps, scale: int, device: str | None) -> None:
    def series(key):
        return [r[key] / scale if r.get(key) is not None else math.nan for r in steps]

    alloc, reserved = series("allocated"), series("reserved")
    same = all(a == r or (a != a and r != r) for a, r in zip(alloc, reserved, strict=True))
    ax.plot(xs, series("peak_allocated"), color="tab:green", marker="o", linewidth=2,
            zorder=5, label="peak since previous log")
    if same:
        note = " (CPU: reserved = allocated)" if device == "cpu" else " (= reserved)"
        ax.plot(xs, alloc, color="tab:purple", marker=".", linewidth=1.8, zorder=5,
                label="allocated after step" + note)
        return
    ax.plot(xs, reserved, color="0.45", linestyle="--", linewidth=2.5, zorder=4,
            label="reserved (caching allocator)")
    ax.plot(xs, alloc, color="tab:purple", marker=".", linewidth=1.8, zorder=5,
            label="allocated after step")


def _title(report: dict[str, Any]) -> str:
    peak = (report.get("summary") or {}).get("max_peak_allocated")
    pred = report.get("predicted_peak_allocated")
    text = f"memory timeline on {report.get('device') or 'unknown device'}"
    if peak:
        text += f"\npeak {format_bytes(peak)} measured"
        if pred:
            text += f", {format_bytes(pred)} predicted ({peak / pred:.2f}x)"
    status = report.get("status") or {}
    if status.get("state") in ("interrupted", "failed"):
        text += f" ({status['state']} at step {status.get('step')})"
    return text
