"""A model of PyTorch's CUDA caching allocator: replay allocation/free events to predict
``torch.cuda.max_memory_reserved`` and ``max_memory_allocated``.

Written from a reading (not a copy) of ``c10/cuda/CUDACachingAllocator.cpp``
(``DeviceCachingAllocator``; newer releases keep it in ``c10/core/CachingDeviceAllocator.h``) and
of ``c10/core/AllocatorConfig.{h,cpp}`` / ``c10/cuda/CUDAAllocatorConfig.{h,cpp}``. One device
and one stream; source names are cited where modelled:

* ``round_size`` (512 B), small (<= 1 MiB) and large pools, ``get_allocation_size``,
  ``get_free_block`` (best fit; ties: older segment, then lower offset, for pointer order) with
  the ``max_split_size`` oversize rules, ``should_split``, ``free_block``/``try_merge_blocks``.
* Memory goes back only on the OOM path: with a ``capacity``, ``malloc`` retries ``alloc_block``
  after ``release_available_cached_blocks`` and after ``release_cached_blocks``; a final failure
  counts an OOM (torch raises) and allocates nothing.
* ``expandable_segments``: one growing segment per pool in 2 MiB (small pool) or 20 MiB (large
  pool) pages, ``find_expandable_block``, ``map_block``, ``unmap_block`` (OOM path only) and
  ``get_free_block``'s expandable size; new memory is the request rounded up to whole pages,
  remainders >= 512 B are split off in both pools; address space 9/8 of ``capacity`` (as
  ``ExpandableSegment`` does with totalGlobalMem), unbounded without one.

Not modelled: several streams and ``record_stream``, CUDA graph / ``MemPool`` private pools,
``empty_cache``, free-memory callbacks, real addresses, and the options
``roundup_power2_divisions``, ``garbage_collection_threshold``, ``per_process_memory_fraction``
(pass ``capacity``), ``large_segment_size_mb`` / ``max_non_split_rounding_mb`` (kept at 20 MiB),
``backend:cudaMallocAsync``: :meth:`AllocatorConfig.from_env` accepts and ignores them.
``segments`` counts cudaMalloc'd segments and expandable segments with mapped pages (torch's
``segment.all.current`` leaves the latter out).
"""

from __future__ import annotations

import itertools
import os
import re
from bisect import bisect_left, insort
from collections.abc import Hashable, Iterable, Iterator
from dataclasses import dataclass

from .._errors import HfMemkitError, did_you_mean
from .._units import MiB

_MIN_BLOCK = 512            # kMinBlockSize
_SMALL_SIZE = MiB           # kSmallSize: largest "small" request
_SMALL_BUFFER = 2 * MiB     # kSmallBuffer: small-pool segment (and expandable page)
_LARGE_BUFFER = 20 * MiB    # kLargeBuffer: 1-10 MiB segment, large expandable page, rounding limit
_MIN_LARGE_ALLOC = 10 * MiB  # kMinLargeAlloc
_ROUND_LARGE = 2 * MiB      # kRoundLarge
_NO_LIMIT = 1 << 64         # std::numeric_limits<size_t>::max(): max_split_size unset
_UNBOUNDED_SPACE = 1 << 60  # address space of an expandable segment without a capacity
_MIN_SPLIT_MB = _LARGE_BUFFER // MiB  # parseMaxSplitSize: max_split_size_mb >= 20 (torch 2.13)

_BOOL_KEYS = frozenset((
    "expandable_segments pinned_use_background_threads release_lock_on_cudamalloc "
    "release_lock_on_hipmalloc pinned_use_cuda_host_register pinned_use_hip_host_register "
    "graph_capture_record_stream_reuse pinned_free_catch_all throw_on_cudamalloc_oom").split())
# the other keys of AcceleratorAllocatorConfig::parseArgs and CUDAAllocatorConfig::getKeys():
# accepted, not modelled
_KEYS = _BOOL_KEYS | frozenset((
    "max_split_size_mb garbage_collection_threshold roundup_power2_divisions backend "
    "max_non_split_rounding_mb large_segment_size_mb pinned_max_round_threshold_mb "
    "pinned_max_cached_size_mb pinned_reserve_segment_size_mb pinned_num_register_threads "
    "per_process_memory_fraction").split())


def _round_size(nbytes: int) -> int:
    """``round_size``: < 512 B -> 512, else up to a multiple of 512; power-2 divisions ignored."""
    return -(-nbytes // _MIN_BLOCK) * _MIN_BLOCK


def _allocation_size(size: int) -> int:
    """``get_allocation_size``: bytes cudaMalloc'd for a new segment serving a rounded request."""
    if size <= _SMALL_SIZE:
        return _SMALL_BUFFER
    if size < _MIN_LARGE_ALLOC:
        return _LARGE_BUFFER
    return -(-size // _ROUND_LARGE) * _ROUND_LARGE


def _config_items(text: str) -> Iterator[tuple[str, str]]:
    """``key:value`` pairs; whitespace dropped (as ConfigTokenizer does), commas inside [] kept."""
    for item in filter(None, re.split(r",(?![^\[]*\])", "".join(text.split()))):
        key, sep, value = item.partition(":")
        if not (key and sep and value):
            raise HfMemkitError(f"allocator option `{item}` is not `key:value`; write e.g. "
                                "`expandable_segments:True,max_split_size_mb:128`")
        yield key, value


_VALUE_RULES = {  # key: (check, what is allowed); torch's parse* functions raise on the rest
    "max_split_size_mb": (lambda v: v.isdigit() and int(v) >= _MIN_SPLIT_MB,  # parseMaxSplitSize
                          f"a whole number of MiB >= {_MIN_SPLIT_MB} (torch: 'max_split_size_mb too "
                          f"small, must be >= {_MIN_SPLIT_MB}'; older releases wanted > 20), e.g. 128"),
    "backend": (lambda v: v in ("native", "cudaMallocAsync"), "`native` or `cudaMallocAsync`"),
    "garbage_collection_threshold": (
        lambda v: v.replace(".", "", 1).isdigit() and 0 < float(v) < 1, "a number in (0.0, 1.0)"),
    **{k: (lambda v: v in ("True", "False"), "True or False, spelled so (ConfigTokenizer::toBool)")
       for k in _BOOL_KEYS},
}


@dataclass(frozen=True)
class AllocatorConfig:
    """The allocator options the model honours (see the module docstring for the others)."""

    max_split_size: int | None = None     # bytes; None = unlimited (the default)
    expandable_segments: bool = False

    def __post_init__(self):
        ms = self.max_split_size
        if ms is not None and (type(ms) is not int or ms <= 0):
            raise HfMemkitError(f"max_split_size {ms!r} is not a positive number of bytes; "
                                "give bytes (e.g. 128 * 2**20) or None for no limit")

    @classmethod
    def from_env(cls, value: str | None = None) -> AllocatorConfig:
        """Parse ``PYTORCH_CUDA_ALLOC_CONF``-style text; with ``value`` None read that variable,
        else ``PYTORCH_ALLOC_CONF`` (the order of ``CUDAAllocatorConfig::instance()``; torch
        2.13 also applies the CUDA variable when both are set). Last occurrence of a key wins."""
        source = "the allocator config"
        if value is None:
            var = next((v for v in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
                        if v in os.environ), None)
            value, source = (os.environ[var], var) if var else ("", source)
        max_split, expandable = None, False
        for key, val in _config_items(value or ""):
            if key not in _KEYS:
                raise HfMemkitError(
                    f"unknown allocator option `{key}` in {source}{did_you_mean(key, _KEYS)}; "
                    f"known keys: {', '.join(sorted(_KEYS))}. Fix the spelling or remove it")
            check, allowed = _VALUE_RULES.get(key, (bool, ""))
            if not check(val):
                raise HfMemkitError(f"`{key}:{val}` in {source}: {key} takes {allowed}; correct "
                                    "the value or remove the key (its default applies then)")
            if key == "max_split_size_mb":
                max_split = int(val) * MiB
            elif key == "expandable_segments":
                expandable = val == "True"
        return cls(max_split_size=max_split, expandable_segments=expandable)


_DEFAULT_CONFIG = AllocatorConfig()


class _Segment:
    __slots__ = ("sid", "small", "expandable", "page", "mapped")

    def __init__(self, sid: int, small: bool, expandable: bool):
        self.sid, self.small, self.expandable = sid, small, expandable
        self.page = _SMALL_BUFFER if small else _LARGE_BUFFER  # expandable page (segment_size_)
        self.mapped = 0  # bytes of mapped pages (expandable segments)


class _Block:  # allocated, cached (free, mapped) or unmapped; prev/next in address order
    __slots__ = ("seg", "offset", "size", "allocated", "mapped", "prev", "next")

    def __init__(self, seg: _Segment, offset: int, size: int, mapped: bool = True):
        self.seg, self.offset, self.size, self.mapped = seg, offset, size, mapped
        self.allocated, self.prev, self.next = False, None, None


def _splice(new: _Block, prev: _Block | None, nxt: _Block | None) -> None:  # Block::splice
    new.prev, new.next = prev, nxt
    if prev is not None:
        prev.next = new
    if nxt is not None:
        nxt.prev = new


def _expandable_size(b: _Block) -> int:  # get_free_block: the size it can grow to in place
    nxt = b.next
    return b.size + (nxt.size if nxt is not None and not nxt.mapped else 0)


def _whole(b: _Block) -> bool:  # the block is its whole segment (!is_split())
    return b.prev is None and b.next is None


class CachingAllocator:
    """Replays ``malloc``/``free`` through a model of ``DeviceCachingAllocator``; sizes in bytes.
    ``allocated_at_peak_reserved``: allocated just after the malloc that set ``peak_reserved``."""

    def __init__(self, config: AllocatorConfig = _DEFAULT_CONFIG, capacity: int | None = None):
        if capacity is not None and (type(capacity) is not int or capacity <= 0):
            raise HfMemkitError(f"capacity {capacity!r} is not a positive number of bytes; "
                                "give the device's bytes, or None for no limit")
        self.config, self.capacity = config, capacity
        self._max_split = config.max_split_size or _NO_LIMIT
        self._expandable = config.expandable_segments
        # per pool (0 large, 1 small): cached blocks by (size, segment, offset) as
        # BlockPool::blocks, unmapped blocks by (segment, offset) as BlockPool::unmapped
        self._free: tuple[list, list] = ([], [])
        self._unmapped: tuple[list, list] = ([], [])
        self._live: dict[Hashable, _Block] = {}
        self._empty: set = set()  # live handles that hold no memory: 0-byte requests and OOMs
        self._sids = itertools.count(1)  # segment ids, in creation (address) order
        self.allocated = self.reserved = self.peak_allocated = self.peak_reserved = 0
        self.segments = self.ooms = self.allocated_at_peak_reserved = 0

    def malloc(self, handle: Hashable, nbytes: int) -> None:
        """``DeviceCachingAllocator::malloc``; 0 bytes holds no block (torch returns nullptr)."""
        if handle in self._live or handle in self._empty:
            raise HfMemkitError(f"allocation handle {handle!r} is already live; free it first or "
                                "give each live allocation its own handle")
        if type(nbytes) is not int or nbytes < 0:
            raise HfMemkitError(f"allocation of {nbytes!r} bytes for {handle!r}: give a "
                                "non-negative whole number of bytes")
        if nbytes == 0:
            self._empty.add(handle)
            return
        size = _round_size(nbytes)
        small, peak_before = size <= _SMALL_SIZE, self.peak_reserved
        block = (self._get_free_block(small, size) or self._alloc_block(small, size)
                 or (self._release_available_cached_blocks(small, size)
                     and self._alloc_block(small, size))
                 or (self._release_cached_blocks() and self._alloc_block(small, size)))
        if not block:
            self.ooms += 1  # stats.num_ooms; torch raises OutOfMemoryError here
            self._empty.add(handle)
        else:
            self._live[handle] = self._alloc_found_block(block, size)
        if self.peak_reserved > peak_before:
            self.allocated_at_peak_reserved = self.allocated

    def free(self, handle: Hashable) -> None:
        """``free`` -> ``free_block``: cache the block, merged with its free neighbours."""
        block = self._live.pop(handle, None)
        if block is None:
            if handle not in self._empty:
                raise HfMemkitError(f"free of unknown allocation handle {handle!r}: never "
                                    "allocated or already freed; free each handle once")
            self._empty.discard(handle)
            return
        block.allocated = False
        self.allocated -= block.size
        self._merge(block, block.prev)
        self._merge(block, block.next)
        self._add(block)

    def reset_peak(self) -> None:
        """``resetPeakStats`` (torch.cuda.reset_peak_memory_stats): peaks become the current."""
        self.peak_allocated, self.peak_reserved = self.allocated, self.reserved
        self.allocated_at_peak_reserved = self.allocated

    def _index(self, b: _Block) -> tuple[list, tuple]:
        if b.mapped:
            return self._free[b.seg.small], (b.size, b.seg.sid, b.offset)
        return self._unmapped[b.seg.small], (b.seg.sid, b.offset)

    def _add(self, b: _Block) -> None:
        lst, key = self._index(b)
        insort(lst, (*key, b))

    def _drop(self, b: _Block) -> None:
        lst, key = self._index(b)
        del lst[bisect_left(lst, key)]

    def _reserve(self, nbytes: int) -> None:
        self.reserved += nbytes
        self.peak_reserved = max(self.peak_reserved, self.reserved)

    def _get_free_block(self, small: bool, size: int) -> _Block | None:  # get_free_block
        lst = self._free[small]
        i, n = bisect_left(lst, (size,)), len(lst)
        if i == n:
            return None
        b, j = lst[i][3], i + 1
        while b.seg.expandable and j < n and _expandable_size(lst[j][3]) < _expandable_size(b):
            i, b, j = j, lst[j][3], j + 1
        # oversize rules: no block >= max_split_size for a smaller request, and a larger request
        # takes a block less than max_non_split_rounding_size (default kLargeBuffer) bigger only
        limit = self._max_split
        if size < limit <= b.size or (size >= limit and b.size >= size + _LARGE_BUFFER):
            return None
        del lst[i]
        return b

    def _alloc_found_block(self, b: _Block, size: int) -> _Block:
        """``should_split`` + ``alloc_found_block``: hand out the front ``size`` bytes."""
        rest = b.size - size
        if (rest >= _MIN_BLOCK if b.seg.small or self._expandable
                else size < self._max_split and rest > _SMALL_SIZE):
            front = _Block(b.seg, b.offset, size)
            _splice(front, b.prev, b)
            b.offset, b.size = b.offset + size, rest
            self._add(b)
            b = front
        b.allocated = True
        self.allocated += b.size  # allocated_bytes: the whole block, an unsplit remainder too
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        return b

    def _merge(self, dst: _Block, src: _Block | None) -> None:
        """``try_merge_blocks``: ``dst`` (in no index) absorbs a free neighbour of its kind."""
        if src is None or src.allocated or src.mapped != dst.mapped:
            return
        self._drop(src)
        if src is dst.prev:
            _splice(dst, src.prev, dst.next)
            dst.offset = src.offset
        else:
            _splice(dst, dst.prev, src.next)
        dst.size += src.size

    def _alloc_block(self, small: bool, size: int) -> _Block | None:
        """``alloc_block``: a cudaMalloc'd segment, or pages mapped; None past ``capacity``."""
        if self._expandable:
            return self._try_allocate_expandable_block(small, size)
        nbytes = _allocation_size(size)
        if self.capacity is not None and self.reserved + nbytes > self.capacity:
            return None
        self._reserve(nbytes)
        self.segments += 1
        return _Block(_Segment(next(self._sids), small, False), 0, nbytes)

    def _find_expandable_block(self, small: bool, size: int) -> _Block:
        """``find_expandable_block``: the lowest address with ``size`` free-or-unmapped bytes."""
        for _sid, _off, u in self._unmapped[small]:
            c = u.prev if u.prev is not None and not u.prev.allocated else u
            got, b = 0, c
            while got < size and b is not None and not b.allocated:
                got, b = got + b.size, b.next
            if got >= size:
                return c
        seg = _Segment(next(self._sids), small, True)
        space = _UNBOUNDED_SPACE
        if self.capacity is not None:
            space = -(-(self.capacity + self.capacity // 8) // seg.page) * seg.page
        u = _Block(seg, 0, space, mapped=False)
        self._add(u)
        return u

    def _try_allocate_expandable_block(self, small: bool, size: int) -> _Block | None:
        c = self._find_expandable_block(small, size)
        if not c.mapped and not self._map_block(c, min(c.size, size)):
            return None
        while c.size < size:  # c is free and followed by unmapped space: map it, merge
            nxt = c.next
            if not self._map_block(nxt, min(size - c.size, nxt.size)):
                return None
            c = nxt
        self._drop(c)
        return c

    def _map_block(self, b: _Block, nbytes: int) -> bool:
        """``map_block``: ``ExpandableSegment::map`` maps whole pages from the block's start."""
        mapped = min(-(-nbytes // b.seg.page) * b.seg.page, b.size)
        if self.capacity is not None and self.reserved + mapped > self.capacity:
            return False
        self._drop(b)
        b.mapped = True
        if mapped < b.size:
            _splice(_Block(b.seg, b.offset + mapped, b.size - mapped, mapped=False), b, b.next)
            b.size = mapped
            self._add(b.next)
        self._merge(b, b.prev)
        self._merge(b, b.next)
        self._add(b)
        self.segments += b.seg.mapped == 0
        b.seg.mapped += mapped
        self._reserve(mapped)
        return True

    def _release_block(self, b: _Block) -> int:  # release_block: cudaFree a whole segment
        self._drop(b)
        self.reserved -= b.size
        self.segments -= 1
        return b.size

    def _release_available_cached_blocks(self, small: bool, size: int) -> bool:
        """Free the smallest oversize segment covering the request, else the largest ones."""
        if self._max_split == _NO_LIMIT or self._expandable:
            return False  # the newer source skips expandable blocks here (older ones assert)
        lst, target = self._free[small], max(size, self._max_split)
        i = bisect_left(lst, (target,))
        if i < len(lst):
            if _whole(lst[i][3]):  # oversize free blocks are whole segments
                self._release_block(lst[i][3])
            return True
        released, i = 0, len(lst) - 1
        while released < target and i >= 0 and lst[i][0] >= self._max_split:
            if _whole(lst[i][3]):
                released += self._release_block(lst[i][3])
            i -= 1
        return released >= target

    def _release_cached_blocks(self) -> bool:
        """``release_cached_blocks`` -> ``release_blocks``: large pool, then small."""
        for small in (False, True):
            to_unmap = []
            for _size, _sid, _off, b in list(self._free[small]):
                if b.seg.expandable:
                    to_unmap.append(b)
                elif _whole(b):
                    self._release_block(b)
            for b in to_unmap:
                self._unmap_block(b)
                if _whole(b) and not b.mapped:
                    self._drop(b)  # release_expandable_segment
        return True

    def _unmap_block(self, b: _Block) -> None:
        """``unmap_block``: unmap the whole pages inside a free block (OOM path)."""
        page, end_b = b.seg.page, b.offset + b.size
        begin, end = -(-b.offset // page) * page, end_b // page * page
        if end <= begin:
            return
        self._drop(b)
        if begin > b.offset:
            _splice(_Block(b.seg, b.offset, begin - b.offset), b.prev, b)
            self._add(b.prev)
        if end_b > end:
            _splice(_Block(b.seg, end, end_b - end), b, b.next)
            self._add(b.next)
        b.offset, b.size, b.mapped = begin, end - begin, False
        self._merge(b, b.prev)
        self._merge(b, b.next)
        self._add(b)
        self.reserved -= end - begin
        b.seg.mapped -= end - begin
        self.segments -= b.seg.mapped == 0


@dataclass(frozen=True)
class ReplayStats:
    peak_allocated: int
    peak_reserved: int
    allocated_at_peak_reserved: int
    segments: int  # at the end of the replay
    ooms: int


def replay(events: Iterable[tuple[str, Hashable, int]], config: AllocatorConfig = _DEFAULT_CONFIG,
           capacity: int | None = None, allocator: CachingAllocator | None = None) -> ReplayStats:
    """Replay ``("alloc", handle, nbytes)``, ``("free", handle, 0)`` and ``("reset_peak", None,
    0)`` events; a given ``allocator`` goes on from its state (``config``/``capacity`` unused)."""
    a = allocator if allocator is not None else CachingAllocator(config, capacity)
    for event in events:
        op, handle, nbytes = event
        if op == "alloc":
            a.malloc(handle, nbytes)
        elif op == "free":
            a.free(handle)
        elif op == "reset_peak":
            a.reset_peak()
        else:
            raise HfMemkitError(f"allocator event {event!r}: op is 'alloc', 'free' or 'reset_peak'")
    return ReplayStats(a.peak_allocated, a.peak_reserved, a.allocated_at_peak_reserved,
                       a.segments, a.ooms)
