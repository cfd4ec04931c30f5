"""Reverse queries: the largest micro-batch, or the longest sequence, that fits a device."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .._compat import quiet_notices
from .._engines import ENGINES
from .._errors import ConfigError, HfMemkitError
from .._estimate.budget import (
    headroom_problem,
    max_memory_problem,
    resolve_headroom,
    unplannable,
)
from .._units import is_positive_int
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


@dataclass(frozen=True)
class SeqLenAnswer:
    """``max_seq_len``'s answer with its reason: what the longest length needs, how much of
    the budget its margin holds back, and what the next length needs."""

    seq_len: int = field(metadata={"help": "The longest length that fits (0: none)."})
    budget: int = field(metadata={"help": "Bytes the step must fit in (max_memory or the "
                                          "device's total x (1 - headroom))."})
    budget_basis: str = field(metadata={"help": "How the budget was derived (its headroom)."})
    needed: int | None = field(metadata={
        "help": "What `seq_len` needs with its margin (MemoryEstimate.upper); None if 0."})
    margin: int | None = field(metadata={
        "help": "The part of `needed` held back for the estimate's uncertainty (2 sigma); "
                "None if 0."})
    next_len: int | None = field(metadata={
        "help": "The length tried above it (seq_len + step); None when `seq_len` is the limit."})
    next_needed: int | None = field(metadata={
        "help": "What `next_len` needs with its margin; None where it could not be estimated."})
    next_error: str | None = field(default=None, metadata={
        "help": "Why `next_len` could not be estimated."})
    limit: int = field(default=1 << 20, metadata={"help": "The longest length tried."})
    step: int = field(default=64, metadata={"help": "The step between the lengths tried."})


@quiet_notices()  # third-party import notices our call triggers
def max_batch_size(model: Any, args: Any = None, *, seq_len: int, device: Any = None,
                   max_memory: int | str | None = None, headroom: float | None = None,
                   limit: int = 4096, **estimate_kwargs: Any) -> int:
    """The largest micro-batch of `args` (at most `limit`) whose step fits the device.

    Each size is estimated with `estimate_memory` (`per_device_train_batch_size` set to it) and
    fits when its `upper` is within the budget; the search doubles, then bisects. A size whose
    estimate fails reads as "does not fit", except size 1, whose error is raised.
    `max_batch_answer` takes the same arguments and says why (`BatchAnswer`).

    Args:
        model (`torch.nn.Module`, `PretrainedConfig`, `str` or `os.PathLike`):
            The model, as `estimate_memory` takes it.
        args (`TrainingArguments`, a TRL config or `dict`, *optional*):
            The arguments whose micro-batch is searched.
        seq_len (`int`):
            The longest sequence of a batch.
        device (`DeviceInfo` or `str`, *optional*):
            A `DeviceInfo`, a catalog name or `"cpu"`; `None` for this machine's device.
        max_memory (`int` or `str`, *optional*):
            Bytes or `"20GiB"`: replaces the device's budget, and `headroom` with it.
        headroom (`float`, *optional*, defaults to 0):
            The fraction of device memory kept free for other tenants, in [0, 1).
        limit (`int`, *optional*, defaults to 4096):
            The largest size tried.
        **estimate_kwargs:
            Passed on to `estimate_memory` (`num_gpus`, `trainer`, `dtype`, ...).

    Returns:
        `int`: the largest micro-batch that fits; 0 if none.

    Raises:
        ConfigError: `seq_len` or `limit` not a positive integer, or a bad `headroom` or
            `max_memory` (all at once).
        HfMemkitError: A device that cannot be planned for, or the estimate's error at
            size 1 (an unknown model or field is raised, never answered with 0).
    """
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


@quiet_notices()  # third-party import notices our call triggers
def max_seq_len(model: Any, args: Any = None, *, device: Any = None,
                max_memory: int | str | None = None, headroom: float | None = None,
                limit: int = 1 << 20, multiple_of: int = 64, **estimate_kwargs: Any) -> int:
    """The longest `seq_len` whose step fits: "what context length can I train on this card?".

    Lengths are multiples of `multiple_of`, at most `limit`; each is estimated with
    `estimate_memory` and fits when its `upper` is within the budget (the search doubles, then
    bisects). What is held back: the budget is the device's memory x (1 - `headroom`) (the
    default headroom 0 keeps none back) or `max_memory`, and each length must fit it with its
    margin (2 sigma of the estimate's uncertain terms, `MemoryEstimate.margin`), so the step
    of the answer needs less than the budget by at least that margin. `max_seq_len_answer`
    takes the same arguments and says so in bytes (`SeqLenAnswer`).

    The trainer changes the answer a lot for the same `args`: with `trainer="sft"` the
    arguments are an `SFTConfig`, whose defaults turn gradient checkpointing and bf16 on
    where `args` do not set them, and TRL's fused head computes the loss in tiles of 4096
    tokens, never the full `[tokens x vocab]` logits that `transformers.Trainer`'s loss keeps;
    so an SFT answer is several times the plain Trainer's (Llama-3.2-1B on an RTX 4090, bf16,
    micro-batch 1: 10432 tokens with `trainer="sft"`, 2816 with its checkpointing off, 1536
    with the plain Trainer, 3072 with the Trainer and checkpointing). Pass the trainer the run
    uses. With `num_gpus=N` > 1 in `estimate_kwargs` and `args` that name no engine or
    `parallelism_config`: "how long can one sequence be on these GPUs", each split over all N
    (context parallelism on FSDP2 full shard, lengths a multiple of `2 x N` too).

    Args:
        model (`torch.nn.Module`, `PretrainedConfig`, `str` or `os.PathLike`):
            The model, as `estimate_memory` takes it.
        args (`TrainingArguments`, a TRL config or `dict`, *optional*):
            The training arguments (their micro-batch is kept).
        device (`DeviceInfo` or `str`, *optional*):
            A `DeviceInfo`, a catalog name or `"cpu"`; `None` for this machine's device.
        max_memory (`int` or `str`, *optional*):
            As in `max_batch_size`: bytes or `"20GiB"`, replacing the device's budget.
        headroom (`float`, *optional*, defaults to 0):
            As in `max_batch_size`: the fraction of device memory kept free, in [0, 1).
        limit (`int`, *optional*, defaults to 1048576):
            The longest length tried; at least `multiple_of`.
        multiple_of (`int`, *optional*, defaults to 64):
            The step between the lengths tried.
        **estimate_kwargs:
            Passed on to `estimate_memory` (`num_gpus`, `trainer`, `dtype`, ...).

    Returns:
        `int`: the longest length that fits; 0 if none.

    Raises:
        ConfigError: `limit` or `multiple_of` not a positive integer, `limit` below
            `multiple_of`, or a bad `headroom` or `max_memory` (all at once).
        HfMemkitError: A device that cannot be planned for, or the estimate's error at
            the shortest length (an unknown model or field is raised, never answered with 0).
    """
    return max_seq_len_answer(model, args, device=device, max_memory=max_memory,
                              headroom=headroom, limit=limit, multiple_of=multiple_of,
                              **estimate_kwargs).seq_len


def max_seq_len_answer(model: Any, args: Any = None, *, device: Any = None,
                       max_memory: int | str | None = None, headroom: float | None = None,
                       limit: int = 1 << 20, multiple_of: int = 64,
                       **estimate_kwargs: Any) -> SeqLenAnswer:
    """``max_seq_len`` with its reason: what the answer needs, the margin it holds back, the
    budget and how it was derived, and what the next length needs (``SeqLenAnswer``)."""
    headroom = _check("max_seq_len", limit=limit, multiple_of=multiple_of, headroom=headroom,
                      max_memory=max_memory)
    batch = (dict(args) if isinstance(args, dict) else args)
    ranks = estimate_kwargs.get("num_gpus")
    if is_positive_int(ranks) and ranks > 1:
        batch, multiple_of = split_over(batch, ranks, multiple_of)
    req = PlanRequest(device=device, max_memory=max_memory, headroom=headroom)
    probe = _Probe(req)

    def fits(n: int, strict: bool) -> bool:
        return probe.fits(model, batch, None, n * multiple_of, estimate_kwargs, strict)

    n = _search(fits, limit // multiple_of) * multiple_of
    nxt = n + multiple_of if n + multiple_of <= limit else None
    if nxt is not None and nxt not in probe.seen:  # the search settles it, but be sure
        fits(nxt // multiple_of, False)
    needed = probe.seen.get(n, (None, None))[0] if n else None
    next_needed, next_error = probe.seen.get(nxt, (None, None)) if nxt else (None, None)
    return SeqLenAnswer(n, probe.budget, req.budget_of().basis, needed,
                        probe.margins.get(n) if n else None, nxt, next_needed, next_error,
                        limit, multiple_of)


def split_over(args: Any, ranks: int, multiple_of: int) -> tuple[Any, int]:
    """``args`` with each sequence split over ``ranks`` as the default sharding engine splits
    it (``Engine.split_args``: FSDP2 full shard + ``cp_size=ranks``) unless they choose an
    engine or parallel degrees themselves; the length step with it."""
    a = dict(args or {}) if not hasattr(args, "to_dict") else {
        f.name: getattr(args, f.name) for f in dataclasses.fields(args)}
    if any(e.selected(a.get) for e in ENGINES) or a.get("parallelism_config"):
        return args, multiple_of
    engine = next(e for e in ENGINES if e.default_sharding)
    splits = engine.sequence_splits(ranks, lambda: 0)   # one that splits no heads
    if not splits:
        return args, multiple_of
    a.update(engine.split_args(splits[0]))
    return a, math.lcm(multiple_of, splits[0].sequence_divisor)


def _check(source: str, *, limit: Any, headroom: Any, max_memory: Any, seq_len: Any = 1,
           multiple_of: Any = 1) -> float:
    """Every problem of a reverse query's own arguments at once; the headroom to use."""
    problems = []
    for name, v, what in (("seq_len", seq_len, "tokens per sequence"),
                          ("limit", limit, "the largest value to try"),
                          ("multiple_of", multiple_of, "the step between lengths, e.g. 64")):
        if not is_positive_int(v):
            problems.append(f"{name} must be a positive integer ({what}), got {v!r}")
    if is_positive_int(limit) and is_positive_int(multiple_of) and limit < multiple_of:
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
        self.margins: dict[int, int] = {}   # size -> MemoryEstimate.margin

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
        self.seen[key], self.margins[key] = (est.upper, None), est.margin
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
