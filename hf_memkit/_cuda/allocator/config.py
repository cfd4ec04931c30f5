"""The allocator options (``PYTORCH_CUDA_ALLOC_CONF`` / ``PYTORCH_ALLOC_CONF``) as torch parses
them, and the size rounding they decide.

Written from a reading of ``c10/core/AllocatorConfig.{h,cpp}`` (``ConfigTokenizer``,
``AcceleratorAllocatorConfig::parseArgs``, ``roundup_power2_divisions``) and
``c10/cuda/CUDAAllocatorConfig.cpp`` (``parseArgs``, ``parseAllocatorConfig``,
``parsePerProcessMemoryFraction``, ``parsePinnedNumRegisterThreads``); the rounding from
``CUDACachingAllocator.cpp`` (``round_size``, ``roundup_power2_next_division``). Keys are those
of torch 2.4 to 2.13; a key torch does not know, or a value torch's parser rejects, is an error
that names it and what is allowed.

What the caching-allocator model (``caching``) does with each option:

* modelled: ``max_split_size_mb``, ``max_non_split_rounding_mb``, ``expandable_segments``,
  ``roundup_power2_divisions`` (``round_size``), ``per_process_memory_fraction`` (the
  allocator's capacity, ``AllocatorConfig.limit``; the estimate's budget shrinks to it);
* ``backend:cudaMallocAsync``: torch hands every tensor to CUDA's stream-ordered allocator
  (c10/cuda/CUDAMallocAsyncAllocator.cpp); none of the caching allocator's block rules apply,
  and the model refuses to replay it (the estimate says so instead of claiming its
  fragmentation);
* every other key is accepted as torch accepts it, NOT modelled, and named as such
  (``AllocatorConfig.unmodelled``) in the estimate's notes.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field

from ..._errors import HfMemkitError, did_you_mean
from ..._units import MiB

MIN_BLOCK = 512             # kMinBlockSize
SMALL_SIZE = MiB            # kSmallSize: largest "small" request
SMALL_BUFFER = 2 * MiB      # kSmallBuffer: small-pool segment (and expandable page)
LARGE_BUFFER = 20 * MiB     # kLargeBuffer: 1-10 MiB segment, large expandable page, rounding limit
MIN_LARGE_ALLOC = 10 * MiB  # kMinLargeAlloc
ROUND_LARGE = 2 * MiB       # kRoundLarge
MIN_SPLIT_MB = LARGE_BUFFER // MiB  # parseMaxSplitSize / parseMaxNonSplitRoundingSize: >= 20
# roundup_power2_divisions: one entry per power-of-two interval of request sizes, from [1 MiB,
# 2 MiB) (smaller requests share its entry) to [32 GiB, 64 GiB) and above
# (kRoundUpPowerOfTwoIntervals = 16, kRoundUpPowerOfTwoStart = 1 MiB)
INTERVALS = 16
_FIRST_INTERVAL_LOG2 = 20
MAX_REGISTER_THREADS = 128  # CUDAAllocatorConfig::pinned_max_register_threads

BOOL_KEYS = frozenset((
    "expandable_segments pinned_use_background_threads release_lock_on_cudamalloc "
    "release_lock_on_hipmalloc pinned_use_cuda_host_register pinned_use_hip_host_register "
    "graph_capture_record_stream_reuse pinned_free_catch_all throw_on_cudamalloc_oom").split())
KEYS = BOOL_KEYS | frozenset((
    "max_split_size_mb garbage_collection_threshold roundup_power2_divisions backend "
    "max_non_split_rounding_mb large_segment_size_mb pinned_max_round_threshold_mb "
    "pinned_max_cached_size_mb pinned_reserve_segment_size_mb pinned_num_register_threads "
    "per_process_memory_fraction").split())
MODELLED = frozenset(("max_split_size_mb max_non_split_rounding_mb expandable_segments "
                      "roundup_power2_divisions per_process_memory_fraction backend").split())
# what an option the model does not follow does to device memory, where it does something
_EFFECTS = {
    "garbage_collection_threshold": "frees cached blocks early once reserved passes that share "
                                    "of per_process_memory_fraction: reserved may be lower",
    "large_segment_size_mb": "changes the segment size of 1-10 MiB requests",
    "release_lock_on_cudamalloc": "locking only",
    "graph_capture_record_stream_reuse": "CUDA graph capture only",
    "throw_on_cudamalloc_oom": "how an OOM is raised",
}


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _whole(value: str) -> int | None:
    return int(value) if value.isdigit() else None


def _fraction(value: str) -> float | None:
    try:
        f = float(value)
    except ValueError:
        return None
    return f if math.isfinite(f) else None


_VALUE_RULES = {  # key: (check, what is allowed); torch's parse* functions raise on the rest
    "max_split_size_mb": (lambda v: (_whole(v) or 0) >= MIN_SPLIT_MB,  # parseMaxSplitSize
                          f"a whole number of MiB >= {MIN_SPLIT_MB} (torch: 'max_split_size_mb too "
                          f"small, must be >= {MIN_SPLIT_MB}'; older releases wanted > 20), e.g. 128"),
    "max_non_split_rounding_mb": (lambda v: (_whole(v) or 0) >= MIN_SPLIT_MB,
                                  f"a whole number of MiB >= {MIN_SPLIT_MB}, e.g. 64"),
    "backend": (lambda v: v in ("native", "cudaMallocAsync"), "`native` or `cudaMallocAsync`"),
    "garbage_collection_threshold": (
        lambda v: (f := _fraction(v)) is not None and 0 < f < 1, "a number in (0.0, 1.0)"),
    "per_process_memory_fraction": (  # parsePerProcessMemoryFraction
        lambda v: (f := _fraction(v)) is not None and 0 <= f <= 1,
        "a number in [0.0, 1.0] (the share of the GPU's memory this process may reserve)"),
    "pinned_num_register_threads": (
        lambda v: _pow2(_whole(v) or 0) and int(v) <= MAX_REGISTER_THREADS,
        f"a power of 2 <= {MAX_REGISTER_THREADS}"),
    "pinned_reserve_segment_size_mb": (lambda v: (_whole(v) or 0) > 0,
                                       "a whole number of MiB > 0"),
    **{k: (lambda v: v in ("True", "False"), "True or False, spelled so (ConfigTokenizer::toBool)")
       for k in BOOL_KEYS},
}
_DIVISIONS_ALLOWED = ("a power of 2 (e.g. `roundup_power2_divisions:4`), or a list of "
                      "`MiB:divisions` pairs keyed by power-of-2 sizes with an optional `>` "
                      "for the rest, e.g. `[256:1,512:2,1024:4,>:8]` (divisions a power of 2, or "
                      "0 for no rounding)")


def parse_divisions(value: str) -> tuple[int, ...]:
    """``roundup_power2_divisions`` as ``parseRoundUpPower2Divisions`` reads it: one entry per
    interval. A list sets every interval below its first key to that key's value; ``>`` sets
    the intervals after the last key (torch 2.9+; torch <= 2.8 also overwrote the last key's
    own interval). Raises ``ValueError`` with what is wrong."""
    if not value.startswith("["):
        n = _whole(value)
        if n is None or not _pow2(n):
            raise ValueError(f"{value!r} is not a power of 2")
        return (n,) * INTERVALS
    if not value.endswith("]"):
        raise ValueError("the list has no closing `]`")
    div, last, first = [0] * INTERVALS, 0, True
    for item in filter(None, value[1:-1].split(",")):
        key, _, val = item.partition(":")
        n = _whole(val)
        if n is None or (n and not _pow2(n)):
            raise ValueError(f"`{item}`: divisions must be a power of 2 or 0")
        if key == ">":
            div[last + 1:] = [n] * (INTERVALS - last - 1)
            continue
        boundary = _whole(key)
        if boundary is None or not _pow2(boundary):
            raise ValueError(f"`{item}`: the size (MiB) must be a power of 2 or `>`")
        index = min(boundary.bit_length() - 1, INTERVALS - 1)
        if first:
            div[:index], first = [n] * index, False
        div[index], last = n, index
    return tuple(div)


def next_division(size: int, divisions: int) -> int:
    """``roundup_power2_next_division``: ``size`` up to the next of ``divisions`` equal steps
    between the powers of two around it (1200 B, 4 divisions: 1280)."""
    if _pow2(size):
        return size
    floor = 1 << (size.bit_length() - 1)
    step = floor >> (divisions.bit_length() - 1)
    if step == 0:
        return floor << 1
    rounded = size & ~(step - 1)
    return size if rounded == size else rounded + step


def _config_items(text: str) -> Iterator[tuple[str, str]]:
    """``key:value`` pairs; whitespace dropped (as ConfigTokenizer does), commas inside [] kept."""
    for item in filter(None, re.split(r",(?![^\[]*\])", "".join(text.split()))):
        key, sep, value = item.partition(":")
        if not (key and sep and value):
            raise HfMemkitError(f"allocator option `{item}` is not `key:value`; write e.g. "
                                "`expandable_segments:True,max_split_size_mb:128`")
        yield key, value


@dataclass(frozen=True)
class AllocatorConfig:
    """The allocator options; the model follows those in ``MODELLED`` (module docstring).
    ``roundup_power2_divisions``: an int (every interval) or one entry per interval
    (``INTERVALS``); stored as that tuple, () when nothing is rounded. ``memory_fraction``:
    ``per_process_memory_fraction`` (None: no limit, as 1.0 is for torch)."""

    max_split_size: int | None = None     # bytes; None = unlimited (the default)
    expandable_segments: bool = False
    roundup_power2_divisions: int | tuple[int, ...] = ()
    max_non_split_rounding: int = LARGE_BUFFER
    backend: str = "native"
    memory_fraction: float | None = None
    # the options given that the model does not follow, as "key:value" (notes only)
    unmodelled: tuple[str, ...] = field(default=(), compare=False)
    source: str = field(default="", compare=False)  # the variable read ("" when given as text)

    def __post_init__(self):
        ms = self.max_split_size
        if ms is not None and (type(ms) is not int or ms <= 0):
            raise HfMemkitError(f"max_split_size {ms!r} is not a positive number of bytes; "
                                "give bytes (e.g. 128 * 2**20) or None for no limit")
        div = self.roundup_power2_divisions
        div = (div,) * INTERVALS if isinstance(div, int) else tuple(div)
        if div and (len(div) != INTERVALS or any(d < 0 or (d and not _pow2(d)) for d in div)):
            raise HfMemkitError(f"roundup_power2_divisions {self.roundup_power2_divisions!r}: "
                                f"give a power of 2, or {INTERVALS} of them (0 or 1: none)")
        object.__setattr__(self, "roundup_power2_divisions",
                           div if any(d > 1 for d in div) else ())
        if self.backend not in ("native", "cudaMallocAsync"):
            raise HfMemkitError(f"backend {self.backend!r}: `native` or `cudaMallocAsync`")
        f = self.memory_fraction
        if f is not None and not 0 <= f <= 1:
            raise HfMemkitError(f"memory_fraction {f!r} is not in [0, 1]")
        if f == 1:
            object.__setattr__(self, "memory_fraction", None)  # setMemoryFraction: 1 = no limit

    def round_size(self, nbytes: int) -> int:
        """``round_size``: bytes a request of ``nbytes`` (> 0) takes (what allocated counts)."""
        if nbytes < MIN_BLOCK:
            return MIN_BLOCK
        if self.roundup_power2_divisions:
            index = min(max(nbytes.bit_length() - 1 - _FIRST_INTERVAL_LOG2, 0), INTERVALS - 1)
            divisions = self.roundup_power2_divisions[index]
            if divisions > 1 and nbytes > MIN_BLOCK * divisions:
                return next_division(nbytes, divisions)
        return -(-nbytes // MIN_BLOCK) * MIN_BLOCK

    def limit(self, total_memory: int | None) -> int | None:
        """What the allocator may reserve under ``per_process_memory_fraction`` on a device of
        ``total_memory`` bytes (``setMemoryFraction``), or None for no limit."""
        if self.memory_fraction is None or not total_memory:
            return None
        return int(self.memory_fraction * total_memory)

    def modelled(self) -> list[str]:
        """The options that change the model, as ``key:value`` for a person."""
        return [o for o in (
            f"backend:{self.backend}" if self.backend != "native" else "",
            f"max_split_size_mb:{self.max_split_size // MiB}" if self.max_split_size else "",
            f"max_non_split_rounding_mb:{self.max_non_split_rounding // MiB}"
            if self.max_non_split_rounding != LARGE_BUFFER else "",
            "expandable_segments:True" if self.expandable_segments else "",
            f"roundup_power2_divisions:{_divisions_text(self.roundup_power2_divisions)}"
            if self.roundup_power2_divisions else "",
            f"per_process_memory_fraction:{self.memory_fraction:g}"
            if self.memory_fraction is not None else "") if o]

    def unmodelled_note(self) -> str | None:
        """The sentence that names the options given that the model does not follow."""
        if not self.unmodelled:
            return None
        parts = [o + (f" ({_EFFECTS[o.partition(':')[0]]})" if o.partition(":")[0] in _EFFECTS
                      else "") for o in self.unmodelled]
        return (f"allocator options NOT modelled ({self.source or 'the allocator config'}): "
                + "; ".join(parts) + ". The estimate assumes torch's default for each")

    @classmethod
    def from_env(cls, value: str | None = None) -> AllocatorConfig:
        """Parse ``PYTORCH_CUDA_ALLOC_CONF``-style text; with ``value`` None read that variable,
        else ``PYTORCH_ALLOC_CONF`` (the order of ``CUDAAllocatorConfig::instance()``; torch
        2.13 also applies the CUDA variable when both are set). Last occurrence of a key wins."""
        source = "the allocator config"
        if value is None:
            var = next((v for v in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
                        if v in os.environ), None)
            value, source = (os.environ[var], var) if var else ("", "")
        given: dict[str, str] = {}
        for key, val in _config_items(value or ""):
            given.pop(key, None)
            given[key] = _checked(key, val, source or "the allocator config")
        return cls._of(given, source)

    @classmethod
    def _of(cls, given: dict[str, str], source: str) -> AllocatorConfig:
        fraction = given.get("per_process_memory_fraction")
        return cls(
            max_split_size=int(given["max_split_size_mb"]) * MiB
            if "max_split_size_mb" in given else None,
            expandable_segments=given.get("expandable_segments") == "True",
            roundup_power2_divisions=parse_divisions(given["roundup_power2_divisions"])
            if "roundup_power2_divisions" in given else (),
            max_non_split_rounding=int(given.get("max_non_split_rounding_mb", MIN_SPLIT_MB)) * MiB,
            backend=given.get("backend", "native"),
            memory_fraction=float(fraction) if fraction is not None else None,
            unmodelled=tuple(f"{k}:{v}" for k, v in given.items() if k not in MODELLED),
            source=source)


def _checked(key: str, val: str, source: str) -> str:
    """``val`` when torch's parser accepts ``key:val``; else a clear error."""
    if key not in KEYS:
        raise HfMemkitError(
            f"unknown allocator option `{key}` in {source}{did_you_mean(key, KEYS)}; "
            f"known keys: {', '.join(sorted(KEYS))}. Fix the spelling or remove it")
    if key == "roundup_power2_divisions":
        try:
            parse_divisions(val)
        except ValueError as exc:
            raise HfMemkitError(f"`{key}:{val}` in {source}: {exc}; {key} takes "
                                f"{_DIVISIONS_ALLOWED}") from None
        return val
    check, allowed = _VALUE_RULES.get(key, (bool, ""))
    if not check(val):
        raise HfMemkitError(f"`{key}:{val}` in {source}: {key} takes {allowed}; correct "
                            "the value or remove the key (its default applies then)")
    return val


def _divisions_text(div: tuple[int, ...]) -> str:
    """The shortest text ``parse_divisions`` reads back as ``div``: each run of equal entries
    but the last keyed by its last interval (MiB), the last run as ``>``."""
    if len(set(div)) == 1:
        return str(div[0])
    ends = [i for i in range(INTERVALS - 1) if div[i] != div[i + 1]]
    return "[" + ",".join([f"{1 << i}:{div[i]}" for i in ends] + [f">:{div[-1]}"]) + "]"
