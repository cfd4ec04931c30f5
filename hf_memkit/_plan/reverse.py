"""Reverse queries: the largest micro-batch, or the longest sequence, that fits a device."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .._errors import ConfigError, HfMemkitError
from .._estimate.budget import (
    headroom_problem,
    max_memory_problem,
    resolve_headroom,
    unplannable,
)
from .request import PlanRequest


@dataclass(frozen=True)
class BatchAnswer:
    """``max_batch_size``'s answer with its reason: what the largest micro-batch needs, the
    budget, and what the next size needs (the limit it hit)."""

    batch: int = field(metadata={"help": "The largest micro-batch that fits (0: none)."})
    budget: int = field(metadata={"help": "Bytes the step must fit in (max_memory or the "
                                          "device's total x (1 - headroom))."})
    needed: int | None = field(metadata={
        "help": "What `batch` needs (MemoryEstimate.upper: required + margin); None if 0."})
    next_batch: int | None = field(metadata={
        "help": "The size tried above it (batch + 1); None when `batch` is the limit."})
    next_needed: int | None = field(metadata={
        "help": "What `next_batch` needs; None where it could not be estimated (next_error)."})
    next_error: str | None = field(default=None, metadata={
        "help": "Why `next_batch` could not be estimated (an error above the fitting sizes)."})
    limit: int = field(default=4096, metadata={"help": "The largest size tried."})


def max_batch_size(model: Any, args: Any = None, *, seq_len: int, device: Any = None,
                   max_memory: int | str | None = None, headroom: float | None = None,
                   limit: int = 4096, **estimate_kwargs: Any) -> int:
    """The largest micro-batch of ``args`` (at most ``limit``) whose step fits the device (0 if
    none). ``headroom``: the fraction of device memory kept free, in [0, 1) (default 0.05);
    ``max_memory`` (bytes or "20GiB") replaces the device's budget, and headroom with it.
    ``max_batch_answer`` takes the same arguments and says why (``BatchAnswer``)."""
    return max_batch_answer(model, args, seq_len=seq_len, device=device, max_memory=max_memory,
                            headroom=headroom, limit=limit, **estimate_kwargs).batch


def max_batch_answer(model: Any, args: Any = None, *, seq_len: int, device: Any = None,
                     max_memory: int | str | None = None, headroom: float | None = None,
                     limit: int = 4096, **estimate_kwargs: Any) -> BatchAnswer:
    """``max_batch_size`` with its reason: the memory the answer needs, the budget, and what
    the next size needs (``BatchAnswer``)."""
    headroom = _check("max_batch_size", seq_len=seq_len, limit=limit, headroom=headroom,
                      max_memory=max_memory)
    probe = _Probe(PlanRequest(device=device, max_memory=max_memory, headroom=headroom))
    n = _search(lambda b, strict: probe.fits(model, args, b, seq_len, estimate_kwargs, strict),
                limit)
    nxt = n + 1 if n < limit else None
    if nxt is not None and nxt not in probe.seen:  # the search settles it, but be sure
        probe.fits(model, args, nxt, seq_len, estimate_kwargs, False)
    needed = probe.seen.get(n, (None, None))[0] if n else None
    next_needed, next_error = probe.seen.get(nxt, (None, None)) if nxt else (None, None)
    return BatchAnswer(n, probe.budget, needed, nxt, next_needed, next_error, limit)


def max_seq_len(model: Any, args: Any = None, *, device: Any = None,
                max_memory: int | str | None = None, headroom: float | None = None,
                limit: int = 1 << 20, multiple_of: int = 64, **estimate_kwargs: Any) -> int:
    """The longest ``seq_len`` (a multiple of ``multiple_of``, at most ``limit``) whose step
    fits (0 if none): "what context length can I train on this card?". ``headroom`` and
    ``max_memory`` as in ``max_batch_size``. With ``num_gpus=N`` > 1 and ``args`` that name no
    engine or ``parallelism_config``: "how long can one sequence be on these GPUs", each split
    over all N (context parallelism on FSDP2 full shard, lengths a multiple of ``2 x N`` too)."""
    headroom = _check("max_seq_len", limit=limit, multiple_of=multiple_of, headroom=headroom,
                      max_memory=max_memory)
    batch = (dict(args) if isinstance(args, dict) else args)
    ranks = estimate_kwargs.get("num_gpus")
    if _positive_int(ranks) and ranks > 1:
        batch, multiple_of = split_over(batch, ranks, multiple_of)
    probe = _Probe(PlanRequest(device=device, max_memory=max_memory, headroom=headroom))
    found = _search(lambda n, strict: probe.fits(model, batch, None, n * multiple_of,
                                                 estimate_kwargs, strict),
                    limit // multiple_of)
    return found * multiple_of


def split_over(args: Any, ranks: int, multiple_of: int) -> tuple[Any, int]:
    """``args`` with each sequence split over ``ranks`` (FSDP2 full shard + ``cp_size=ranks``)
    unless they choose an engine or parallel degrees themselves; the length step with it."""
    a = dict(args or {}) if not hasattr(args, "to_dict") else {
        f.name: getattr(args, f.name) for f in dataclasses.fields(args)}
    if a.get("fsdp") or a.get("deepspeed") or a.get("parallelism_config"):
        return args, multiple_of
    a.update(fsdp="full_shard", fsdp_config={"version": 2}, parallelism_config={"cp_size": ranks})
    return a, math.lcm(multiple_of, 2 * ranks)


def _positive_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def _check(source: str, *, limit: Any, headroom: Any, max_memory: Any, seq_len: Any = 1,
           multiple_of: Any = 1) -> float:
    """Every problem of a reverse query's own arguments at once; the headroom to use."""
    problems = []
    for name, v, what in (("seq_len", seq_len, "tokens per sequence"),
                          ("limit", limit, "the largest value to try"),
                          ("multiple_of", multiple_of, "the step between lengths, e.g. 64")):
        if not _positive_int(v):
            problems.append(f"{name} must be a positive integer ({what}), got {v!r}")
    if _positive_int(limit) and _positive_int(multiple_of) and limit < multiple_of:
        problems.append(f"limit {limit} is below multiple_of {multiple_of}: no length to try; "
                        f"give limit >= {multiple_of}")
    if headroom is not None and headroom_problem(headroom):
        problems.append(headroom_problem(headroom))
    if max_memory_problem(max_memory):
        problems.append(max_memory_problem(max_memory))
    if problems:
        raise ConfigError(problems, source=source)
    return float(resolve_headroom(headroom, max_memory, source, stacklevel=4))


class _Probe:
    """Estimates steps against one device and budget, keeping what each size needed
    (``seen``: size -> (MemoryEstimate.upper, None) or (None, the error))."""

    def __init__(self, req: PlanRequest) -> None:
        why = unplannable(req.dev)
        if why:
            raise HfMemkitError(why)
        self.req, self.budget = req, req.budget()
        self.seen: dict[int, tuple[int | None, str | None]] = {}

    def fits(self, model: Any, args: Any, batch: int | None, seq_len: int, kw: dict,
             strict: bool) -> bool:
        """Whether the step fits. ``strict`` (the smallest size): bad input raises instead of
        reading as "does not fit", so an unknown model or field is never answered with 0."""
        from .._estimate import estimate_memory

        a = dict(args or {}) if not hasattr(args, "to_dict") else {
            f.name: getattr(args, f.name) for f in dataclasses.fields(args)}
        if batch is not None:
            a["per_device_train_batch_size"] = batch
        key = batch if batch is not None else seq_len
        try:
            est = estimate_memory(model, a, seq_len=seq_len, device=self.req.dev, **kw)
        except HfMemkitError as exc:
            if strict:
                raise
            self.seen[key] = (None, str(exc))
            return False
        self.seen[key] = (est.upper, None)
        return est.upper <= self.budget  # the upper band must fit


def _search(fits: Callable[[int, bool], bool], limit: int) -> int:
    """Largest n in [1, limit] with fits(n) (monotone), by doubling then bisection."""
    if not fits(1, True):
        return 0
    lo, hi = 1, 2
    while hi <= limit and fits(hi, False):
        lo, hi = hi, hi * 2
    hi = min(hi, limit + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid, False) else (lo, mid)
    return lo
