"""The caching-allocator model (hf_memkit._cuda.allocator) on hand-worked event sequences.

Each expected figure is worked out in a comment from the rule of c10/cuda/CUDACachingAllocator.cpp
it checks (round_size, get_allocation_size, get_free_block, should_split, free_block,
release_*_cached_blocks, the expandable-segment functions). MiB = 2**20 bytes throughout.
"""

from __future__ import annotations

import random

import pytest

from hf_memkit._cuda.allocator import AllocatorConfig, CachingAllocator, ReplayStats, replay
from hf_memkit._errors import HfMemkitError

KiB = 1024
MiB = 1024 * KiB


def _run(*steps, config=None, capacity=None):
    """Apply ``("alloc", handle, nbytes)`` / ``("free", handle)`` steps to a fresh allocator."""
    a = CachingAllocator(config or AllocatorConfig(), capacity)
    for op, handle, *nbytes in steps:
        if op == "alloc":
            a.malloc(handle, *nbytes)
        else:
            a.free(handle)
    return a


def test_512_byte_rounding_and_a_one_byte_request():
    # round_size: < 512 B -> 512 (kMinBlockSize); else up to a multiple of 512. The first small
    # request makes a 2 MiB segment (get_allocation_size: <= 1 MiB -> kSmallBuffer).
    a = _run(("alloc", "x", 1))
    assert (a.allocated, a.reserved, a.segments) == (512, 2 * MiB, 1)
    a.malloc("y", 513)       # -> 1024
    a.malloc("z", 1024)      # -> 1024 exactly
    assert a.allocated == 512 + 1024 + 1024
    assert (a.reserved, a.segments) == (2 * MiB, 1)  # all split from the one small segment
    a.malloc("empty", 0)     # torch hands out a null pointer: no block, nothing counted
    a.free("empty")
    assert (a.allocated, a.peak_allocated) == (2560, 2560)


def test_small_requests_share_one_2mib_segment():
    # Small pool (<= 1 MiB, kSmallSize): 4 x 512 KiB fill one 2 MiB segment. should_split in the
    # small pool splits any remainder >= 512 B: 2 MiB -> 512K + 1.5M -> ... -> the 4th takes the
    # last 512 KiB exactly. The 5th needs a second segment.
    a = _run(*[("alloc", i, 512 * KiB) for i in range(4)])
    assert (a.allocated, a.reserved, a.segments) == (2 * MiB, 2 * MiB, 1)
    a.malloc(4, 512 * KiB)
    assert (a.allocated, a.reserved, a.segments) == (2 * MiB + 512 * KiB, 4 * MiB, 2)
    # kSmallSize is inclusive: 1 MiB is small (2 MiB segment), 1 MiB + 1 B is large (20 MiB)
    b = _run(("alloc", "s", MiB))
    assert b.reserved == 2 * MiB
    b.malloc("l", MiB + 1)  # rounds to 1 MiB + 512; 20 MiB segment split (remainder > 1 MiB)
    assert (b.reserved, b.allocated) == (22 * MiB, 2 * MiB + 512)


def test_3mib_takes_a_20mib_segment_and_a_second_3mib_splits_the_rest():
    # get_allocation_size: 1 MiB < size < 10 MiB (kMinLargeAlloc) -> 20 MiB (kLargeBuffer);
    # should_split (large pool): remainder 17 MiB > 1 MiB -> split; the second 3 MiB request is
    # served best-fit from the 17 MiB remainder (-> 3 + 14 MiB free).
    a = _run(("alloc", "a", 3 * MiB), ("alloc", "b", 3 * MiB))
    assert (a.allocated, a.reserved, a.segments) == (6 * MiB, 20 * MiB, 1)
    # 15 MiB does not fit the 14 MiB left: a new segment, rounded to 2 MiB (kRoundLarge) = 16 MiB;
    # its 1 MiB remainder is not split (needs > kSmallSize), so the whole 16 MiB is allocated.
    a.malloc("c", 15 * MiB)
    assert (a.allocated, a.reserved, a.segments) == (22 * MiB, 36 * MiB, 2)


def test_11mib_request_rounds_to_a_12mib_segment_and_counts_12mib_allocated():
    # >= 10 MiB: get_allocation_size rounds up to 2 MiB -> 12 MiB. Remainder 1 MiB is not
    # > kSmallSize, so no split: allocated_bytes counts the whole 12 MiB block.
    a = _run(("alloc", "a", 11 * MiB))
    assert (a.allocated, a.reserved, a.peak_allocated, a.segments) == (12 * MiB, 12 * MiB,
                                                                       12 * MiB, 1)


def test_free_merges_neighbours_and_a_larger_request_reuses_the_merged_block():
    # One 20 MiB segment split 4|4|4|8 (the 8 MiB request takes the last 8 MiB exactly).
    a = _run(("alloc", "a", 4 * MiB), ("alloc", "b", 4 * MiB), ("alloc", "c", 4 * MiB),
             ("alloc", "d", 8 * MiB))
    assert (a.allocated, a.reserved) == (20 * MiB, 20 * MiB)
    # free_block/try_merge_blocks: freeing b merges it with the free a -> one 8 MiB block; a 6 MiB
    # request fits it (split 6|2) instead of cudaMalloc'ing a new segment.
    a.free("a")
    a.free("b")
    a.malloc("e", 6 * MiB)
    assert (a.allocated, a.reserved, a.segments) == (18 * MiB, 20 * MiB, 1)
    # Freeing everything merges the segment back into one 20 MiB block: a 19 MiB request reuses
    # it whole (remainder 1 MiB, not split), still one segment.
    for h in ("e", "c", "d"):
        a.free(h)
    a.malloc("f", 19 * MiB)
    assert (a.allocated, a.reserved, a.segments) == (20 * MiB, 20 * MiB, 1)


def test_best_fit_takes_the_smallest_fitting_block_not_the_first():
    # 20 MiB segment laid out 6|2|3|9 MiB; free the 6 (offset 0) and the 3 (offset 8): two
    # non-adjacent free blocks. get_free_block's lower_bound picks the smallest block >= request:
    # 2 MiB goes to the 3 MiB block (remainder 1 MiB: not split, the block counts 3 MiB), so a
    # 5 MiB request still finds the 6 MiB block (remainder 1 MiB: not split). First fit would
    # have split the 6 into 2|4 and needed a new 20 MiB segment for the 5 MiB.
    a = _run(("alloc", "a", 6 * MiB), ("alloc", "x", 2 * MiB), ("alloc", "b", 3 * MiB),
             ("alloc", "y", 9 * MiB), ("free", "a"), ("free", "b"),
             ("alloc", "s", 2 * MiB), ("alloc", "t", 5 * MiB))
    assert (a.reserved, a.segments) == (20 * MiB, 1)
    assert a.allocated == 6 * MiB + 2 * MiB + 3 * MiB + 9 * MiB


def test_large_pool_split_threshold_remainder_of_1mib_is_not_split():
    # should_split, large pool: split only if remainder > kSmallSize (1 MiB).
    # 5 MiB in a 20 MiB segment, freed -> one 20 MiB block. 19 MiB takes it, remainder exactly
    # 1 MiB: not split, so allocated = 20 MiB and a 2 MiB request needs a second segment.
    a = _run(("alloc", "p", 5 * MiB), ("free", "p"), ("alloc", "q", 19 * MiB))
    assert (a.allocated, a.reserved) == (20 * MiB, 20 * MiB)
    a.malloc("r", 2 * MiB)
    assert (a.reserved, a.segments) == (40 * MiB, 2)
    # 18.5 MiB leaves 1.5 MiB > 1 MiB: split, and a 1.5 MiB request reuses the remainder.
    b = _run(("alloc", "p", 5 * MiB), ("free", "p"), ("alloc", "q", 18 * MiB + 512 * KiB))
    assert b.allocated == 18 * MiB + 512 * KiB
    b.malloc("r", MiB + 512 * KiB)
    assert (b.allocated, b.reserved, b.segments) == (20 * MiB, 20 * MiB, 1)


def test_max_split_size_oversize_blocks_are_not_split_nor_given_to_small_requests():
    cfg = AllocatorConfig(max_split_size=40 * MiB)   # max_split_size_mb:40
    # A 50 MiB segment (>= max_split_size), freed. get_free_block: a 25 MiB request (< 40 MiB)
    # may not take a block >= max_split_size -> new 26 MiB segment (not split: remainder 1 MiB).
    a = _run(("alloc", "big", 50 * MiB), ("free", "big"), ("alloc", "r", 25 * MiB), config=cfg)
    assert (a.allocated, a.reserved, a.segments) == (26 * MiB, 76 * MiB, 2)
    # Without max_split_size the 25 MiB request splits the cached 50 MiB block: 50 reserved.
    b = _run(("alloc", "big", 50 * MiB), ("free", "big"), ("alloc", "r", 25 * MiB))
    assert (b.allocated, b.reserved, b.segments) == (25 * MiB, 50 * MiB, 1)
    # A 45 MiB request (>= 40) may take the 50 MiB block (< 45 + 20), and should_split never
    # splits for a request >= max_split_size: the whole 50 MiB is allocated.
    a.malloc("s", 45 * MiB)
    assert (a.allocated, a.reserved) == (76 * MiB, 76 * MiB)


def test_max_split_size_plus_20mib_rounding_limit():
    # get_free_block: a request >= max_split_size takes a cached block only if it is smaller than
    # request + 20 MiB (kLargeBuffer, max_non_split_rounding_size's default).
    cfg = AllocatorConfig(max_split_size=40 * MiB)
    a = _run(("alloc", "x", 64 * MiB), ("free", "x"), ("alloc", "y", 44 * MiB), config=cfg)
    # 64 >= 44 + 20: the cached 64 MiB block is refused, a 44 MiB segment is made
    assert (a.allocated, a.reserved, a.segments) == (44 * MiB, 108 * MiB, 2)
    a.free("y")
    a.malloc("z", 45 * MiB)  # best fit is the 64 MiB block (44 < 45) and 64 < 45 + 20: taken whole
    assert (a.allocated, a.reserved, a.segments) == (64 * MiB, 108 * MiB, 2)


def test_capacity_releases_only_enough_oversize_segments_first():
    # release_available_cached_blocks (max_split_size set): with 50 and 60 MiB oversize segments
    # cached (110 of 120 MiB reserved), a 5 MiB request may not use them and a new 20 MiB segment
    # does not fit. The smallest cached block >= max(5, 40) MiB, the 50 MiB one, is freed; the
    # retry fits (60 + 20 = 80 MiB) and the 60 MiB segment stays cached.
    cfg = AllocatorConfig(max_split_size=40 * MiB)
    a = _run(("alloc", "a", 50 * MiB), ("alloc", "b", 60 * MiB), ("free", "a"), ("free", "b"),
             ("alloc", "c", 5 * MiB), config=cfg, capacity=120 * MiB)
    assert (a.allocated, a.reserved, a.segments, a.ooms) == (5 * MiB, 80 * MiB, 2, 0)
    assert a.peak_reserved == 110 * MiB
    a.malloc("d", 55 * MiB)  # >= 40 MiB and 60 < 55 + 20: reuses the cached 60 MiB segment
    assert (a.allocated, a.reserved) == (65 * MiB, 80 * MiB)


def test_capacity_releases_cached_segments_then_retries_and_counts_ooms():
    cap = 40 * MiB
    # Two 16 MiB segments (>= 10 MiB: rounded to 2 MiB, no split), a freed. A 20 MiB request:
    # 32 + 20 > 40, so release_cached_blocks frees the wholly free 16 MiB segment and the retry
    # fits: 16 + 20 = 36 MiB.
    a = _run(("alloc", "a", 16 * MiB), ("alloc", "b", 16 * MiB), ("free", "a"),
             ("alloc", "c", 20 * MiB), capacity=cap)
    assert (a.allocated, a.reserved, a.peak_reserved, a.segments, a.ooms) == (
        36 * MiB, 36 * MiB, 36 * MiB, 2, 0)
    # 8 MiB needs a 20 MiB segment: 56 > 40, nothing cached to release -> OOM, nothing allocated.
    a.malloc("d", 8 * MiB)
    assert (a.allocated, a.reserved, a.ooms) == (36 * MiB, 36 * MiB, 1)
    a.free("d")  # the failed allocation's free is accepted
    # The cache is dropped even when the retry still fails: b's 16 MiB goes, 30 MiB does not fit.
    a.free("b")
    a.malloc("e", 30 * MiB)  # 20 + 30 > 40 after releasing b
    assert (a.allocated, a.reserved, a.segments, a.ooms) == (20 * MiB, 20 * MiB, 1, 2)


def _growth(n=5):
    # alternating "allocate the next, larger buffer / free the previous one": 11, 13, 15, 17,
    # 19 MiB, as a growing batch or sequence length does
    events = []
    for i in range(n):
        events.append(("alloc", i, (11 + 2 * i) * MiB))
        if i:
            events.append(("free", i - 1, 0))
    return events


def test_expandable_segments_reserve_less_than_segments_on_a_growing_pattern():
    # Segmented: each request >= 10 MiB gets its own segment rounded to 2 MiB (12, 14, 16, 18,
    # 20) and none fits a freed smaller one: 80 MiB reserved; peak allocated 18 + 20 = 38 MiB.
    seg = replay(_growth())
    assert seg == ReplayStats(peak_allocated=38 * MiB, peak_reserved=80 * MiB,
                              allocated_at_peak_reserved=38 * MiB, segments=5, ooms=0)
    # Expandable (large-pool pages of 20 MiB, remainders >= 512 B split):
    #   11 -> map 1 page [0,20), 11 at 0;  13 -> free tail 9 + 1 page: 13 at 11, reserved 40;
    #   free 11 -> [0,11) free;  15 -> best fit [24,40) (16): 15 at 24;  free 13 -> [0,24) free;
    #   17 -> [0,24): 17 at 0;  free 15 -> [17,40) free;  19 -> 19 at 17.  Reserved stays 40.
    # allocated_at_peak_reserved: 11 + 13 when the second page was mapped.
    exp = replay(_growth(), AllocatorConfig(expandable_segments=True))
    assert exp == ReplayStats(peak_allocated=36 * MiB, peak_reserved=40 * MiB,
                              allocated_at_peak_reserved=24 * MiB, segments=1, ooms=0)


def test_expandable_segments_map_whole_pages_and_keep_them_after_free():
    cfg = AllocatorConfig(expandable_segments=True)
    # map_block maps the request rounded up to 20 MiB pages (large pool): 3 MiB -> 20 reserved,
    # 3 MiB allocated (not get_allocation_size, and the 17 MiB remainder is split off).
    a = _run(("alloc", "a", 3 * MiB), ("alloc", "b", 3 * MiB), config=cfg)
    assert (a.allocated, a.reserved, a.segments) == (6 * MiB, 20 * MiB, 1)
    # 30 MiB: find_expandable_block starts at the free tail [6,20) (14 MiB) just before the
    # unmapped space, so only 16 MiB more are needed: one page -> 40 MiB reserved, not 60
    a.malloc("c", 30 * MiB)
    assert (a.allocated, a.reserved, a.segments) == (36 * MiB, 40 * MiB, 1)
    # pages are not unmapped on free (only release_cached_blocks, on the OOM path, unmaps)
    for h in "abc":
        a.free(h)
    assert (a.allocated, a.reserved) == (0, 40 * MiB)
    # small pool: 2 MiB pages
    s = _run(("alloc", "x", 600 * KiB), ("alloc", "y", MiB), config=cfg)
    assert (s.allocated, s.reserved) == (600 * KiB + MiB, 2 * MiB)
    # should_split with expandable segments: any remainder >= 512 B is split off, in the large
    # pool too: 19.5 MiB in a 20 MiB page counts 19.5 MiB (the segmented allocator: 20 MiB)
    big = 19 * MiB + 512 * KiB
    assert _run(("alloc", "z", big), config=cfg).allocated == big
    assert _run(("alloc", "z", big)).allocated == 20 * MiB


def test_expandable_best_fit_keeps_the_growable_tail_for_last():
    # get_free_block with expandable segments ranks a free block followed by unmapped space by
    # the size it could grow to, so a bigger block elsewhere is preferred to the tail.
    #   a1 12 MiB: page [0,20), a1 at 0, tail [12,20) free
    #   a2 18 MiB: tail 8 + one page -> a2 at [12,30), tail [30,40) free (10 MiB); reserved 40
    #   free a1 -> [0,12) free (12 MiB, not growable: a2 follows it)
    #   9 MiB: the 10 MiB tail is the smallest fit, but the walk moves on to [0,12): 9 | 3 free
    #   11 MiB: free are 3 and the 10 MiB tail: the tail grows by a page -> reserved 60
    a = _run(("alloc", "a1", 12 * MiB), ("alloc", "a2", 18 * MiB), ("free", "a1"),
             ("alloc", "b", 9 * MiB), ("alloc", "c", 11 * MiB),
             config=AllocatorConfig(expandable_segments=True))
    assert (a.allocated, a.reserved, a.segments) == (38 * MiB, 60 * MiB, 1)


def test_expandable_segments_oom_path_unmaps_free_pages_and_maps_them_again():
    cfg = AllocatorConfig(expandable_segments=True)
    # capacity 60 MiB -> address space 9/8 * 60 = 67.5, i.e. 4 pages (80 MiB) per segment.
    # a: 40 MiB = pages 0-1, b: 20 MiB = page 2; reserved 60. Free a.
    a = _run(("alloc", "a", 40 * MiB), ("alloc", "b", 20 * MiB), ("free", "a"),
             config=cfg, capacity=60 * MiB)
    assert (a.reserved, a.allocated) == (60 * MiB, 20 * MiB)
    # 45 MiB: the free 40 is too small and b blocks growing it, page 3 alone is too small, so
    # find_expandable_block opens a second segment: 3 pages do not fit. release_cached_blocks
    # unmaps the free pages 0-1 (reserved 20); the retry still needs 60 more: OOM.
    a.malloc("c", 45 * MiB)
    assert (a.reserved, a.allocated, a.ooms, a.segments) == (20 * MiB, 20 * MiB, 1, 1)
    # 30 MiB: the unmapped hole [0,40) is the lowest fitting address; 2 pages are mapped again
    a.malloc("d", 30 * MiB)
    assert (a.reserved, a.allocated, a.ooms, a.segments) == (60 * MiB, 50 * MiB, 1, 1)


def test_reset_peak_sets_peaks_to_current():
    # 4 MiB + 8 MiB in one 20 MiB segment; both freed: current 0 allocated, 20 reserved.
    a = _run(("alloc", "a", 4 * MiB), ("alloc", "b", 8 * MiB), ("free", "a"), ("free", "b"))
    assert (a.peak_allocated, a.peak_reserved) == (12 * MiB, 20 * MiB)
    a.reset_peak()  # torch.cuda.reset_peak_memory_stats: peak := current
    assert (a.peak_allocated, a.peak_reserved, a.allocated_at_peak_reserved) == (0, 20 * MiB, 0)
    a.malloc("c", KiB)  # a new 2 MiB small segment
    assert (a.peak_allocated, a.peak_reserved, a.allocated_at_peak_reserved) == (
        KiB, 22 * MiB, KiB)
    # the same through replay's ("reset_peak", None, 0) event
    st = replay([("alloc", 1, 4 * MiB), ("free", 1, 0), ("reset_peak", None, 0),
                 ("alloc", 2, MiB)])
    assert (st.peak_allocated, st.peak_reserved) == (MiB, 22 * MiB)


def test_churn_freed_activations_reused_by_smaller_requests_leaves_reserved_above_allocated():
    # Forward: three 12 MiB activations, one 12 MiB segment each (>= 10 MiB, rounded, no split).
    # Backward: each freed activation is reused by a smaller 8 MiB gradient (best fit, split
    # 8|4); freeing a gradient merges it back into its 12 MiB block. Then a 14 MiB optimizer
    # buffer fits none of the cached pieces (12 and 4 MiB, in different segments): new segment.
    events = [("alloc", "a1", 12 * MiB), ("alloc", "a2", 12 * MiB), ("alloc", "a3", 12 * MiB),
              # allocated 36 = peak; reserved 36
              ("free", "a3", 0), ("alloc", "g3", 8 * MiB),   # seg3: g3 8 | 4 free   -> alloc 32
              ("free", "a2", 0), ("alloc", "g2", 8 * MiB),   # best fit 12 (seg2), not 4 -> 28
              ("free", "g3", 0),                             # seg3 whole 12 free    -> 20
              ("alloc", "opt", 14 * MiB),                    # free 4, 12 < 14: +14 -> 34, R 50
              ("free", "a1", 0), ("free", "g2", 0)]          # leaves opt: 14
    st = replay(events)
    assert st == ReplayStats(peak_allocated=36 * MiB, peak_reserved=50 * MiB,
                             allocated_at_peak_reserved=34 * MiB, segments=4, ooms=0)


def test_from_env_parses_torch_syntax(monkeypatch):
    assert AllocatorConfig.from_env("") == AllocatorConfig()
    assert AllocatorConfig.from_env("max_split_size_mb:128,expandable_segments:True") == (
        AllocatorConfig(max_split_size=128 * MiB, expandable_segments=True))
    # whitespace is dropped (ConfigTokenizer); known options we do not model are accepted and
    # named as not modelled; bracketed lists are read; the last occurrence of a key wins
    cfg = AllocatorConfig.from_env(
        " expandable_segments : True , garbage_collection_threshold:0.6,"
        "roundup_power2_divisions:[256:1,512:2,>:4],backend:native,"
        "pinned_use_cuda_host_register:True,max_split_size_mb:64,max_split_size_mb:20")
    # [256:1,512:2,>:4]: intervals [1 MiB, 512 MiB) 1, [512 MiB, 1 GiB) 2, from 1 GiB on 4
    assert cfg == AllocatorConfig(max_split_size=20 * MiB, expandable_segments=True,
                                  roundup_power2_divisions=(1,) * 9 + (2,) + (4,) * 6)
    assert cfg.unmodelled == ("garbage_collection_threshold:0.6",
                              "pinned_use_cuda_host_register:True")
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    assert AllocatorConfig.from_env() == AllocatorConfig()
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:True")
    assert AllocatorConfig.from_env() == AllocatorConfig(expandable_segments=True)
    # both set: the CUDA variable is read first (CUDAAllocatorConfig::instance(); torch 2.13 too)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:256")
    assert AllocatorConfig.from_env() == AllocatorConfig(max_split_size=256 * MiB)


@pytest.mark.parametrize("text, named", [
    ("max_split_size_mb:19", "`max_split_size_mb:19`"),     # torch: must be >= 20
    ("max_split_size_mb:abc", "`max_split_size_mb:abc`"),
    ("expandable_segments:true", "`expandable_segments:true`"),  # toBool wants True/False
    ("expandable_segment:True", "did you mean `expandable_segments`"),
    ("garbage_collection_threshold:1.5", "`garbage_collection_threshold:1.5`"),
    ("max_split_size_mb", "`max_split_size_mb` is not `key:value`"),
])
def test_from_env_rejects_bad_input_naming_it(text, named):
    with pytest.raises(HfMemkitError) as err:
        AllocatorConfig.from_env(text)
    assert named in str(err.value)


def test_from_env_error_names_the_variable_and_the_rule(monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:8")
    with pytest.raises(HfMemkitError, match=r"PYTORCH_CUDA_ALLOC_CONF.*>= 20"):
        AllocatorConfig.from_env()


def test_bad_calls_raise():
    a = CachingAllocator()
    with pytest.raises(HfMemkitError, match="unknown allocation handle 'nope'"):
        a.free("nope")
    a.malloc("h", 10)
    with pytest.raises(HfMemkitError, match="already live"):
        a.malloc("h", 10)
    with pytest.raises(HfMemkitError, match="non-negative"):
        a.malloc("k", -1)
    with pytest.raises(HfMemkitError, match="op is"):
        replay([("malloc", 1, 10)])
    with pytest.raises(HfMemkitError, match="positive"):
        CachingAllocator(capacity=0)
    with pytest.raises(HfMemkitError, match="positive"):
        AllocatorConfig(max_split_size=0)


@pytest.mark.parametrize("config", [AllocatorConfig(), AllocatorConfig(max_split_size=64 * MiB),
                                    AllocatorConfig(expandable_segments=True)])
def test_random_churn_keeps_the_books(config):
    # 20k random events: freeing everything returns allocated to 0, nothing is ever reserved
    # past what was peaked, and a second replay of the same stream gives the same figures.
    rng = random.Random(0)
    sizes = [1, 700, 300 * KiB, MiB, 3 * MiB, 9 * MiB, 12 * MiB, 40 * MiB, 90 * MiB]
    events, live = [], []
    for i in range(20_000):
        if live and (rng.random() < 0.5 or len(live) > 200):
            events.append(("free", live.pop(rng.randrange(len(live))), 0))
        else:
            events.append(("alloc", i, rng.choice(sizes) + rng.randrange(4096)))
            live.append(i)
    events += [("free", h, 0) for h in live]
    a = CachingAllocator(config)
    st = replay(events, allocator=a)
    assert a.allocated == 0 and a.reserved <= st.peak_reserved
    assert st.peak_allocated <= st.peak_reserved
    assert replay(events, config) == st
    # capacity below the peak: some OOMs, and the books still balance
    b = CachingAllocator(config, capacity=st.peak_reserved // 2)
    replay(events, allocator=b)
    assert b.ooms > 0 and b.allocated == 0 and b.peak_reserved <= st.peak_reserved // 2
