"""The bisect cases of ``bench/gpu_truth.py``: the smallest allocator capacity at which a
training step completes, found on the GPU by bisection, next to the estimate's ``required``.

``hf_memkit.estimate_memory`` says ``required`` is "the smallest device memory the step runs in:
on CUDA, the smallest capacity at which the replayed step completes through the
caching-allocator model (it frees cached blocks and retries before an OOM), plus context". A
bisect case (``Case(bisect=True)``) measures that capacity: each probe is one child process
(a clean CUDA context) that caps the allocator with
``torch.cuda.set_per_process_memory_fraction(capacity / total_memory)`` and runs the case's
steps; an out-of-memory error (or the probe's timeout) is "does not complete".

What the fraction limits: the caching allocator's *reserved* bytes (its ``cudaMalloc``'d
segments: before each new segment it checks reserved + size against fraction x total, and on
a refusal it frees cached blocks and retries, then raises ``OutOfMemoryError``). The CUDA
context (and anything allocated outside the allocator) is not limited and not counted. So the
found capacity is compared with ``required`` less the estimate's context, and the device
memory it means is the found capacity plus the context measured in the probes (NVML, before any
tensor); both raw values are recorded.

Plain functions, no torch import: ``bisect_capacity`` takes the probe as a callable, so the unit
tests drive it with a predicate of known threshold, and ``--cpu-smoke`` with a fake OOM below a
threshold, through the same code the GPU runs.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

MiB = 2**20
COMPLETED, OOM, TIMEOUT, ERROR = "completed", "oom", "timeout", "error"
NOT_COMPLETED = (OOM, TIMEOUT)  # a probe that timed out is taken as not completing
GRANULARITY = 2 * MiB  # the allocator rounds large blocks to 2 MiB: finer capacities are equal
PROBES = 5  # bisection probes a case (plus at most one probe of an unverified bound)
BELOW_ALLOCATED = 0.05  # the lower bound: the estimate's peak_allocated less 5%
ABOVE_DEVICE_USED = 0.10  # the upper bound: at least device_used (less context) plus 10%
RESOLUTION = 0.005  # stop once the bracket is 0.5% of the upper bound (at least a granule)

# the results a bisection ends with
FOUND = "found"              # a failing capacity and a completing one, at most `resolution` apart
BELOW_LOWER = "below_lower"  # the lower bound completed too: the smallest is at most that
ABOVE_UPPER = "above_upper"  # nothing completed up to the upper bound
FAILED = "error"             # a probe failed otherwise (not an OOM): the bisection stopped


def search_bounds(estimate: dict[str, Any], total: int, *, granularity: int = GRANULARITY
                  ) -> dict[str, Any]:
    """The bracket the bisection starts from, in allocator bytes (context excluded): the
    estimate's ``peak_allocated`` less 5% (reserved never goes below allocated), and the
    larger of the estimate's ``upper`` and its ``device_used`` plus 10%, both less the
    estimate's context, at most ``total``; rounded outwards to ``granularity``."""
    d = estimate["to_dict"]
    context = int(d["breakdown"].get("context", 0))
    lower = int(estimate["peak_allocated"] * (1 - BELOW_ALLOCATED)) // granularity * granularity
    upper = max(d["upper"] - context, int((d["device_used"] - context) * (1 + ABOVE_DEVICE_USED)))
    upper = min(total, -(-upper // granularity) * granularity)
    lower = min(lower, upper - granularity)
    return {"lower": max(0, lower), "upper": upper, "total": total, "estimate_context": context,
            "granularity": granularity,
            "target_resolution": max(granularity, int(upper * RESOLUTION)),
            "basis": f"lower: peak_allocated x {1 - BELOW_ALLOCATED:g}; upper: max(upper, "
                     f"device_used x {1 + ABOVE_DEVICE_USED:g}), less the estimate's context, "
                     "at most total memory"}


def _mid(lo: int, hi: int, granularity: int) -> int:
    return (lo + hi) // 2 // granularity * granularity


def verdict(probes: list[dict[str, Any]]) -> dict[str, Any]:
    """What the probes (in any order, repeats allowed) say: ``smallest_completing`` is the
    smallest capacity that completed above every capacity that did not (so a capacity that once
    failed above a completion never counts as the answer); ``largest_failing`` the largest that
    did not complete; ``monotone`` False where some failure lies at or above a completion
    (noisy or non-monotone), with those pairs in ``contradictions``."""
    done = sorted({p["capacity"] for p in probes if p["outcome"] == COMPLETED})
    fail = sorted({p["capacity"] for p in probes if p["outcome"] in NOT_COMPLETED})
    top_fail = fail[-1] if fail else None
    above = [c for c in done if top_fail is None or c > top_fail]
    smallest = above[0] if above else None
    contradictions = [[f, c] for f in fail for c in done if f >= c]
    return {"smallest_completing": smallest, "largest_failing": top_fail,
            "resolution": smallest - top_fail if smallest is not None and top_fail is not None
            else None,
            "smallest_seen_completing": done[0] if done else None,
            "monotone": not contradictions, "contradictions": contradictions[:20],
            "timeouts": sum(p["outcome"] == TIMEOUT for p in probes)}


def bisect_capacity(probe: Callable[[int], dict[str, Any]], lower: int, upper: int, *,
                    probes: int = PROBES, resolution: int = GRANULARITY,
                    granularity: int = GRANULARITY, confirm: int = 0) -> dict[str, Any]:
    """The smallest capacity in (``lower``, ``upper``] at which ``probe(capacity)`` completes.

    ``probe`` returns a dict whose ``outcome`` is ``completed``, ``oom``, ``timeout`` or
    ``error`` (and whatever else it measured, kept). ``lower`` is assumed not to complete and
    ``upper`` to complete; up to ``probes`` probes halve the bracket (midpoints on
    ``granularity``) until it is at most ``resolution`` wide. A bound assumed, never tried, is
    then probed once: ``upper`` when every probe failed (still failing: ``above_upper``, the
    step needs more than the search allowed), ``lower`` when every probe completed (completing
    too: ``below_lower``, the smallest is at most ``lower``). ``confirm`` re-probes the found
    capacity up to that many times (each repeat that fails makes the next completing capacity
    above it the answer and marks the result not monotone). A probe that errors stops the
    search (``error``). The answer is ``verdict`` of every probe."""
    tried: list[dict[str, Any]] = []

    def run(capacity: int) -> str:
        r = dict(probe(capacity))
        r["capacity"] = capacity
        r.setdefault("outcome", ERROR)
        tried.append(r)
        return r["outcome"]

    lo, hi, lo_tried, hi_tried, result = lower, upper, False, False, None
    for _ in range(probes):
        mid = _mid(lo, hi, granularity)
        if hi - lo <= resolution or not lo < mid < hi:
            break
        out = run(mid)
        if out == ERROR:
            result = FAILED
            break
        if out == COMPLETED:
            hi, hi_tried = mid, True
        else:
            lo, lo_tried = mid, True
    if result is None and not hi_tried:  # nothing completed: does the upper bound?
        out = run(upper)
        result = FAILED if out == ERROR else None if out == COMPLETED else ABOVE_UPPER
    if result is None and not lo_tried:  # everything completed: does the lower bound fail?
        out = run(lower)
        result = FAILED if out == ERROR else BELOW_LOWER if out == COMPLETED else None
    for _ in range(confirm if result is None else 0):
        found = verdict(tried)["smallest_completing"]
        if found is None or run(found) in (COMPLETED, ERROR):
            break
    v = verdict(tried)
    if result is None:
        result = FAILED if tried and tried[-1]["outcome"] == ERROR else \
            ABOVE_UPPER if v["smallest_completing"] is None else FOUND
    return {"result": result, **v, "lower_bound": lower, "upper_bound": upper,
            "max_probes": probes,
            "target_resolution": resolution, "granularity": granularity, "confirm": confirm,
            "probes": tried}


def outside_allocator(probe: dict[str, Any]) -> int | None:
    """What a completed probe's process held on the device beyond the allocator's segments at
    its peak: NVML's device_used (peak less before CUDA init) less max_reserved, both of the
    measured window: the context plus what came after it (lazily loaded kernels, cuBLAS
    handles). None where either is unknown."""
    used, reserved = probe.get("device_used"), probe.get("max_reserved")
    if probe.get("outcome") != COMPLETED or not used or reserved is None:
        return None
    return used - reserved


def _median(xs: list[int | None]) -> int | None:
    known = [x for x in xs if x is not None]
    return int(statistics.median(known)) if known else None


def compare(search: dict[str, Any], estimate: dict[str, Any],
            contexts: list[int | None]) -> dict[str, Any]:
    """The found capacity next to the estimate: ``found_device`` is the smallest completing
    capacity plus the measured context (the median of the probes' NVML readings after CUDA
    init, before any tensor; the estimate's where none was measured), ``rel_error`` =
    required / found_device - 1, and ``capacity_rel_error`` = (required - the estimate's
    context) / the found capacity - 1 (the allocator's part alone). ``outside_measured``: the
    median over completed probes of what their process held beyond the allocator at the peak
    (``outside_allocator``), and ``rel_error_outside`` = required / (capacity + that) - 1.
    ``required_completes``: whether the probes show the step completes at required's capacity
    (None: it lies inside the final bracket, or nothing was found)."""
    d = estimate["to_dict"]
    est_ctx = int(d["breakdown"].get("context", 0))
    measured = _median(contexts)
    ctx = est_ctx if measured is None else measured
    outside = _median([outside_allocator(p) for p in search.get("probes", [])])
    cap = d["required"] - est_ctx
    found, failing = search.get("smallest_completing"), search.get("largest_failing")
    completes = (True if found is not None and cap >= found else
                 False if failing is not None and cap <= failing else None)
    return {"required": d["required"], "device_used": d["device_used"], "upper": d["upper"],
            "margin": d["margin"], "peak_allocated": d["peak_allocated"],
            "peak_reserved": d["peak_reserved"], "estimate_context": est_ctx,
            "estimate_capacity": cap,
            "context_measured": measured, "contexts": contexts,
            "context_basis": ("measured: NVML after CUDA init less before, median of the probes"
                              if measured is not None else "the estimate's (no context measured)"),
            "found_device": found + ctx if found is not None else None,
            "rel_error": d["required"] / (found + ctx) - 1 if found else None,
            "capacity_rel_error": cap / found - 1 if found else None,
            "outside_measured": outside,
            "rel_error_outside": (d["required"] / (found + outside) - 1
                                  if found and outside is not None else None),
            "required_completes": completes}
