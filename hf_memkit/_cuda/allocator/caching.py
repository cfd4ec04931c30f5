"""A model of PyTorch's CUDA caching allocator: replay allocation/free events to predict
``torch.cuda.max_memory_reserved`` and ``max_memory_allocated``.

Written from a reading (not a copy) of ``c10/cuda/CUDACachingAllocator.cpp``
(``DeviceCachingAllocator``; newer releases keep it in ``c10/core/CachingDeviceAllocator.h``).
One device and one stream; source names are cited where modelled:

* ``round_size`` (512 B, or ``roundup_power2_divisions``: ``config``), small (<= 1 MiB) and
  large pools, ``get_allocation_size``, ``get_free_block`` (best fit; ties: older segment, then
  lower offset, for pointer order) with the ``max_split_size`` / ``max_non_split_rounding_mb``
  oversize rules, ``should_split``, ``free_block``/``try_merge_blocks``.
* Memory goes back only on the OOM path: with a ``capacity`` (the device's memory, or
  ``per_process_memory_fraction`` of it: ``AllocatorConfig.limit``), ``malloc`` retries
  ``alloc_block`` after ``release_available_cached_blocks`` and after ``release_cached_blocks``;
  a final failure counts an OOM (torch raises) and allocates nothing.
* ``expandable_segments``: one growing segment per pool in 2 MiB (small pool) or 20 MiB (large
  pool) pages, ``find_expandable_block``, ``map_block``, ``unmap_block`` (OOM path only) and
  ``get_free_block``'s expandable size; new memory is the request rounded up to whole pages,
  remainders >= 512 B are split off in both pools; address space 9/8 of ``capacity`` (as
  ``ExpandableSegment`` does with totalGlobalMem), unbounded without one.

Not modelled: several streams and ``record_stream``, CUDA graph / ``MemPool`` private pools,
``empty_cache``, free-memory callbacks, real addresses, and the options ``config`` lists as not
modelled (``garbage_collection_threshold``, ``large_segment_size_mb``, ...).
``backend:cudaMallocAsync`` is not this allocator at all: ``CachingAllocator`` refuses it.
``segments`` counts cudaMalloc'd segments and expandable segments with mapped pages (torch's
``segment.all.current`` leaves the latter out).
"""

from __future__ import annotations

import itertools
from bisect import bisect_left, insort
from collections.abc import Hashable, Iterable
from dataclasses import dataclass

from ..._errors import HfMemkitError
from .config import (
    LARGE_BUFFER,
    MIN_BLOCK,
    MIN_LARGE_ALLOC,
    ROUND_LARGE,
    SMALL_BUFFER,
    SMALL_SIZE,
    AllocatorConfig,
)

_NO_LIMIT = 1 << 64         # std::numeric_limits<size_t>::max(): max_split_size unset
_UNBOUNDED_SPACE = 1 << 60  # address space of an expandable segment without a capacity


def _allocation_size(size: int) -> int:
    """``get_allocation_size``: bytes cudaMalloc'd for a new segment serving a rounded request."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-size // ROUND_LARGE) * ROUND_LARGE


_DEFAULT_CONFIG = AllocatorConfig()


class _Segment:
    __slots__ = ("sid", "small", "expandable", "page", "mapped")

    def __init__(self, sid: int, small: bool, expandable: bool):
        self.sid, self.small, self.expandable = sid, small, expandable
        self.page = SMALL_BUFFER if small else LARGE_BUFFER  # expandable page (segment_size_)
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
        if config.backend != "native":
            raise HfMemkitError(f"backend:{config.backend} is CUDA's stream-ordered allocator, not "
                                "the caching allocator: its block rules do not apply, so there "
                                "is nothing of it to replay")
        self.config, self.capacity = config, capacity
        self._max_split = config.max_split_size or _NO_LIMIT
        self._non_split = config.max_non_split_rounding
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
        size = self.config.round_size(nbytes)
        small, peak_before = size <= SMALL_SIZE, self.peak_reserved
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
        if size < limit <= b.size or (size >= limit and b.size >= size + self._non_split):
            return None
        del lst[i]
        return b

    def _alloc_found_block(self, b: _Block, size: int) -> _Block:
        """``should_split`` + ``alloc_found_block``: hand out the front ``size`` bytes."""
        rest = b.size - size
        if (rest >= MIN_BLOCK if b.seg.small or self._expandable
                else size < self._max_split and rest > SMALL_SIZE):
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
