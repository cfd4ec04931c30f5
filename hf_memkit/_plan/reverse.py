"""Reverse queries: the largest micro-batch, or the longest sequence, that fits a device."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from .._errors import HfMemkitError
from .request import PlanRequest


def max_batch_size(model: Any, args: Any = None, *, seq_len: int, device: Any = None,
                   max_memory: int | str | None = None, headroom: float = 0.1,
                   limit: int = 4096, **estimate_kwargs: Any) -> int:
    """The largest micro-batch of ``args`` whose step fits the device (0 if none)."""
    return _search(lambda b: _fits(model, args, b, seq_len, device, max_memory, headroom,
                                   estimate_kwargs), limit)


def max_seq_len(model: Any, args: Any = None, *, device: Any = None,
                max_memory: int | str | None = None, headroom: float = 0.1,
                limit: int = 1 << 20, multiple_of: int = 64, **estimate_kwargs: Any) -> int:
    """The longest ``seq_len`` (a multiple of ``multiple_of``) whose step fits (0 if none):
    "what context length can I train on this card?"."""
    batch = (dict(args) if isinstance(args, dict) else args)
    found = _search(lambda n: _fits(model, batch, None, n * multiple_of, device, max_memory,
                                    headroom, estimate_kwargs), limit // multiple_of)
    return found * multiple_of


def _fits(model, args, batch, seq_len, device, max_memory, headroom, kw) -> bool:
    from .._estimate import estimate_memory

    req = PlanRequest(device=device, max_memory=max_memory, headroom=headroom)
    a = dict(args or {}) if not hasattr(args, "to_dict") else {
        f.name: getattr(args, f.name) for f in dataclasses.fields(args)}
    if batch is not None:
        a["per_device_train_batch_size"] = batch
    try:
        est = estimate_memory(model, a, seq_len=seq_len, device=req.dev, **kw)
    except HfMemkitError:
        return False
    return est.upper <= req.budget()  # the upper band must fit


def _search(fits: Callable[[int], bool], limit: int) -> int:
    """Largest n in [1, limit] with fits(n) (monotone), by doubling then bisection."""
    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi <= limit and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, limit + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo
