"""Reverse queries: the largest micro-batch, or the longest sequence, that fits a device."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from .._errors import ConfigError, HfMemkitError
from .._estimate.budget import headroom_problem, resolve_headroom
from .request import PlanRequest


def max_batch_size(model: Any, args: Any = None, *, seq_len: int, device: Any = None,
                   max_memory: int | str | None = None, headroom: float | None = None,
                   limit: int = 4096, **estimate_kwargs: Any) -> int:
    """The largest micro-batch of ``args`` (at most ``limit``) whose step fits the device (0 if
    none). ``headroom``: the fraction of device memory kept free, in [0, 1) (default 0.05);
    ``max_memory`` (bytes or "20GiB") replaces the device's budget, and headroom with it."""
    headroom = _check("max_batch_size", seq_len=seq_len, limit=limit, headroom=headroom,
                      max_memory=max_memory)
    return _search(lambda b, strict: _fits(model, args, b, seq_len, device, max_memory,
                                           headroom, estimate_kwargs, strict), limit)


def max_seq_len(model: Any, args: Any = None, *, device: Any = None,
                max_memory: int | str | None = None, headroom: float | None = None,
                limit: int = 1 << 20, multiple_of: int = 64, **estimate_kwargs: Any) -> int:
    """The longest ``seq_len`` (a multiple of ``multiple_of``, at most ``limit``) whose step
    fits (0 if none): "what context length can I train on this card?". ``headroom`` and
    ``max_memory`` as in ``max_batch_size``."""
    headroom = _check("max_seq_len", limit=limit, multiple_of=multiple_of, headroom=headroom,
                      max_memory=max_memory)
    batch = (dict(args) if isinstance(args, dict) else args)
    found = _search(lambda n, strict: _fits(model, batch, None, n * multiple_of, device,
                                            max_memory, headroom, estimate_kwargs, strict),
                    limit // multiple_of)
    return found * multiple_of


def _positive_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def _check(source: str, *, limit: Any, headroom: Any, max_memory: Any, seq_len: Any = 1,
           multiple_of: Any = 1) -> float:
    """Every problem of a reverse query's own arguments at once; the headroom to use."""
    from .._units import parse_bytes

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
    if max_memory is not None:
        try:
            if parse_bytes(max_memory) <= 0:
                raise HfMemkitError("")
        except HfMemkitError:
            problems.append(f"max_memory must be a positive size in bytes or e.g. '20GiB', got "
                            f"{max_memory!r}")
    if problems:
        raise ConfigError(problems, source=source)
    return float(resolve_headroom(headroom, max_memory, source, stacklevel=4))


def _fits(model, args, batch, seq_len, device, max_memory, headroom, kw, strict) -> bool:
    """Whether the step fits. ``strict`` (the smallest size): bad input raises instead of
    reading as "does not fit", so an unknown model or field is never answered with 0."""
    from .._estimate import estimate_memory

    req = PlanRequest(device=device, max_memory=max_memory, headroom=headroom)
    a = dict(args or {}) if not hasattr(args, "to_dict") else {
        f.name: getattr(args, f.name) for f in dataclasses.fields(args)}
    if batch is not None:
        a["per_device_train_batch_size"] = batch
    try:
        est = estimate_memory(model, a, seq_len=seq_len, device=req.dev, **kw)
    except HfMemkitError:
        if strict:
            raise
        return False
    return est.upper <= req.budget()  # the upper band must fit


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
