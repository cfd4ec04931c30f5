"""The search at the edges of the card: the expandable-segments rung, the tight fallback and the
offload setup a plan passed over (docs/fitting.md, verdicts and expandable segments). Functions of
a running ``Search`` (``core``), which calls them."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from ..._cuda.allocator import AllocatorConfig
from ..._setup.setup import TrainingSetup
from ..._units import format_bytes
from ..space import EXPANDABLE, Candidate, rung_of

PURE_BF16 = "pure-bf16"


def order(c: Candidate) -> tuple:
    """The order a pool of the search tries its candidates in."""
    return c.precision == PURE_BF16, c.rel_time


def allocator_of(c: Candidate) -> AllocatorConfig | None:
    """The allocator options ``c`` is estimated with: the environment's, plus the planner's
    rung (``Candidate.allocator``) where it has one; None: the environment's as they are."""
    if not c.allocator:
        return None
    conf = AllocatorConfig.from_env()
    return dataclasses.replace(conf, expandable_segments=True, source=(
        f"{conf.source} + " if conf.source else "") + "the plan's PYTORCH_CUDA_ALLOC_CONF")


def expandable(search: Any, c: Candidate, setup: TrainingSetup) -> bool:
    """The expandable-segments rung, tried before any slower setup: where ``c`` misses by
    less than what the caching allocator adds over its live bytes (fragmentation, and the
    margin's allocator term), ``c`` again with ``expandable_segments:True``; it fits or
    not on that exact estimate, and the plan then sets the variable."""
    est = c.estimate
    if est is None or est.lower_bound or est.refusals or search.req.dev.kind != "cuda" \
            or c.allocator or host_short(search, c):
        return False
    conf = AllocatorConfig.from_env()
    given = " ".join(os.environ.get(v, "") for v in ("PYTORCH_CUDA_ALLOC_CONF",
                                                     "PYTORCH_ALLOC_CONF"))
    if "expandable_segments" in given or conf.backend != "native":
        return False  # the user chose it either way (or another allocator)
    by_allocator = est.breakdown.get("fragmentation", 0) + est.margin_terms.get("allocator", 0)
    if est.upper - search.budget >= by_allocator:
        return False
    before = est
    c.allocator = EXPANDABLE
    if search.record(c, search.estimate(c, setup=setup)):
        return True
    c.allocator = ""
    search.record(c, before)
    return False


def host_short(search: Any, c: Candidate) -> bool:
    """Whether ``c``'s offload needs more host RAM per node than the plan may use."""
    est = c.estimate
    host = est.host_offloaded * (search.req.ranks // search.req.nodes) if est else 0
    return search.host_budget is not None and host > search.host_budget


def say_offload(search: Any, candidates: list[Candidate], chosen: Candidate) -> None:
    """Where a setup that offloads parameters or optimizer state was passed over for one
    earlier in the order (or refused for host RAM), say what it would need: the user may
    have the RAM and want it (full fine-tuning rather than adapters)."""
    if rung_of(chosen.parallel).tier == 1:
        return
    names = [m.name for m in search.methods]
    for c in candidates:
        if c.method not in names[:names.index(chosen.method)] \
                or rung_of(c.parallel).tier != 1 or c.rel_time is None:
            continue
        if c.reason and not c.reason.startswith("offload needs"):
            continue
        _, rs, _ = search.states_of(c)
        host = rs.host * (search.req.ranks // search.req.nodes)
        search.notes.append(
            f"{c.method} fine-tuning would fit with {rung_of(c.parallel).label} (slower: "
            f"the offloaded states cross PCIe every step), needing about "
            f"{format_bytes(host)} of host RAM per node ({search.req.host_basis()}); to plan "
            f"it, pass method='{c.method}' and host_memory= the RAM your nodes have")
        return


def tightest(search: Any, candidates: list[Candidate]) -> Candidate | None:
    """Where nothing fits with its margin: the first setup in the search's order whose
    step fits at the centre (``MemoryEstimate.verdict`` ``tight``), re-estimated without the
    budget's shortcut (a setup judged against the budget may say only "at least"). Runs like
    it ran at 96-98% of their card; the plan says so and what to do."""
    names = [m.name for m in search.methods]
    tried = sorted((c for c in candidates if c.estimate is not None and not c.fits
                    and not c.estimate.lower_bound and c.estimate.required <= search.budget
                    and not c.estimate.refusals),
                   key=lambda c: (names.index(c.method), rung_of(c.parallel).tier,
                                  order(c)))
    for c in tried:
        est = search.estimate(c, judge=False)
        est.budget = search.budget
        if est.verdict == "tight":
            c.estimate, c.device_used, c.peak_allocated = est, est.device_used, \
                est.peak_allocated
            c.fits = True
            search.notes.append(
                f"tight: no setup fits with its margin; this one needs "
                f"{format_bytes(est.required)} of {format_bytes(search.budget)}, and its "
                f"margin ({format_bytes(est.upper - est.required)}) does not fit. Runs like it "
                "have run at 96-98% of their card, but fragmentation may push it over: set "
                "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, or use more GPUs")
            return c
    return None
