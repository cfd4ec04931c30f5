"""What each memory rung of the chosen setup saved: ``Plan.ladder``, shown by ``explain()``.

The chosen setup is taken apart one rung at a time, the costliest first (the method after
full fine-tuning, another optimizer than the user's, pure bf16, then the searched techniques by
``Technique.ladder``: checkpoint offload, checkpointing, Liger's fused head), and each setup on the way down is estimated exactly at the chosen micro-batch. Read from the
bottom up, every rung's line is what adding it saved on the device (and kept in host RAM) and
what it costs in predicted time per sample. Rungs the user pinned are shown too: they are part of
the setup's memory.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from .._errors import HfMemkitError
from .._techniques import TECHNIQUES
from .space import Candidate, user_optimizer

PURE_BF16_RUNG = 60   # after checkpoint offload (40)
OPTIM_RUNG = 65       # another optimizer than the user's: after every rung that keeps the recipe
METHOD_RUNG = 70      # LoRA / 8-bit / 4-bit bases: the last resort of method="auto"
ALLOCATOR_RUNG = 90   # expandable segments: tried on a setup before any slower one (search.edges)


def _without(c: Candidate, name: str) -> Candidate:
    """``c`` with technique ``name`` off, and every technique that requires it."""
    gone = {name} | {n for n in c.techniques if name in TECHNIQUES.get(n).requires}
    on = tuple(n for n in c.techniques if n not in gone)
    return dataclasses.replace(c, techniques=on, checkpointing="activation_checkpointing" in on,
                               estimate=None, device_used=None, peak_allocated=None,
                               fits=False, chosen=False, reason="")


def _fresh(c: Candidate, **changes: Any) -> Candidate:
    return dataclasses.replace(c, estimate=None, device_used=None, peak_allocated=None,
                               fits=False, chosen=False, reason="", **changes)


def rungs(search: Any, c: Candidate) -> list[tuple[int, str, Callable[[Candidate], Candidate]]]:
    """(ladder position, label, undo) of every rung ``c`` stands on."""
    out = []
    for name in c.techniques:
        t = TECHNIQUES.get(name)
        out.append((t.ladder, t.display, lambda x, n=name: _without(x, n)))
    mine = user_optimizer(search.req)
    if c.optim != mine:
        out.append((OPTIM_RUNG, f"{c.optim} instead of {mine} (your optimizer)",
                    lambda x: _fresh(x, optim=mine)))
    if c.precision == "pure-bf16":
        out.append((PURE_BF16_RUNG, "pure bf16 (no fp32 master weights)",
                    lambda x: _fresh(x, precision="bf16")))
    if c.allocator:
        out.append((ALLOCATOR_RUNG, "expandable segments (PYTORCH_CUDA_ALLOC_CONF)",
                    lambda x: _fresh(x, allocator="")))
    names = [m.name for m in search.methods]
    if c.method in names:
        for i in range(names.index(c.method), 0, -1):
            out.append((METHOD_RUNG + i, f"{names[i]} instead of {names[i - 1]}",
                        lambda x, m=names[i - 1]: _fresh(x, method=m)))
    return out


def ladder_savings(search: Any, chosen: Candidate) -> list[dict[str, Any]]:
    """One row per rung, from the setup with none of them up to ``chosen``: ``rung``,
    ``device_used`` with it, ``must_fit`` (what must fit the budget with it: the step's need
    plus its margin), ``saved`` (the bytes of ``must_fit`` it saved; None when the setup below
    it could not be estimated), ``host_offloaded`` it added and ``time_factor`` (predicted time
    per sample with it / without it)."""
    steps = sorted(rungs(search, chosen), key=lambda r: -r[0])
    chain = [chosen]
    for _, _, undo in steps:
        chain.append(undo(chain[-1]))
    used, must, host = [], [], []
    for c in chain[1:]:
        search.price(c)
        try:
            c.estimate = search.estimate(c, judge=False)
        except HfMemkitError:  # e.g. a method this model cannot be estimated with
            c.estimate = None
    # the top row is the chosen setup as the plan shows it (its estimate judged against the
    # budget: where the verdict did not depend on it, its smallest capacity was not searched,
    # so its figure, and the top rung's saving, may be a little larger than an exact one); the
    # rungs below compare exact needs
    exact = [chosen.estimate] + [c.estimate for c in chain[1:]]
    for e in exact:
        used.append(e.device_used if e is not None else None)
        must.append(e.upper if e is not None else None)
        host.append(e.host_offloaded if e is not None else None)
    out = []
    for i in range(len(steps) - 1, -1, -1):  # from the bottom rung up
        above, below = chain[i], chain[i + 1]
        out.append({"rung": steps[i][1], "device_used": used[i], "must_fit": must[i],
                    "saved": None if None in (must[i], must[i + 1]) else must[i + 1] - must[i],
                    "host_offloaded": None if None in (host[i], host[i + 1]) else
                    host[i] - host[i + 1],
                    "time_factor": above.rel_time / below.rel_time if below.rel_time else None})
    return out
