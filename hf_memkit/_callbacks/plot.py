"""The PNG memory timeline of a ``MemoryCallback`` report (compute first, render separately)."""

from __future__ import annotations

from typing import Any

from .._compat import require
from .._units import GiB, MiB


def plot_timeline(report: dict[str, Any], path: str) -> str:
    """Draw allocated, reserved and peak per logged step; phase peaks shaded; predicted peak as a
    horizontal line; OOM recoveries as vertical lines. Returns ``path``."""
    matplotlib = require("matplotlib", "the memory timeline PNG (MemoryCallback(plot=True))")
    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    steps = report["steps"]
    xs = [r["step"] for r in steps]
    top = max([r.get("peak_allocated") or 0 for r in steps]
              + [report.get("predicted_peak_allocated") or 0, 1])
    unit, scale = ("GiB", GiB) if top >= GiB else ("MiB", MiB)

    def series(key):
        return [(r.get(key) / scale) if r.get(key) is not None else float("nan") for r in steps]

    fig, ax = plt.subplots(figsize=(9, 4.5))
    try:
        alloc = series("allocated")
        for key, label, color in (("peak_fwd_bwd", "forward + backward peak", "tab:blue"),
                                  ("peak_optimizer", "optimizer-step peak", "tab:orange")):
            ys = series(key)
            if any(y == y for y in ys):  # not all NaN
                ax.fill_between(xs, alloc, ys, alpha=0.2, color=color, label=label, step="mid")
        ax.plot(xs, alloc, marker=".", label="allocated")
        ax.plot(xs, series("reserved"), marker=".", label="reserved")
        ax.plot(xs, series("peak_allocated"), marker=".", label="peak since last log")
        if report.get("predicted_peak_allocated"):
            ax.axhline(report["predicted_peak_allocated"] / scale, color="red", linestyle="--",
                       label="predicted peak")
        for i, ev in enumerate(report.get("events", [])):
            ax.axvline(ev["step"] + 0.5, color="black", linestyle=":",
                       label="OOM recovery" if i == 0 else None)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(f"memory ({unit})")
        ax.set_title(f"memory timeline ({report.get('device')})")
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize="small")
        fig.tight_layout()
        fig.savefig(path, dpi=100)
    finally:
        plt.close(fig)
    return path
