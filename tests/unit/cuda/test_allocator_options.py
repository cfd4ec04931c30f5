"""The allocator options torch reads from PYTORCH_CUDA_ALLOC_CONF that change what it allocates,
against torch's own rules worked by hand (c10/core/AllocatorConfig.cpp, CUDAAllocatorConfig.cpp,
CUDACachingAllocator.cpp ``round_size`` / ``roundup_power2_next_division``), and the values
torch's parser rejects."""

from __future__ import annotations

import pytest

from hf_memkit._cuda.allocator import AllocatorConfig, CachingAllocator, replay
from hf_memkit._errors import HfMemkitError
from hf_memkit._units import GiB, MiB

# three requests, one per rounding regime: a small-pool one above 512 B x 4, a 64-128 MiB one,
# a second 64-128 MiB one (allocated and never freed, so both peaks are the sums)
SEQ = [("alloc", "a", 5200), ("alloc", "b", 70 * MiB + 1), ("alloc", "c", 100_000_000)]


def test_roundup_power2_divisions_4_rounds_each_request_as_torch():
    st = replay(SEQ, AllocatorConfig.from_env("roundup_power2_divisions:4"))
    # 5200 B: between 4096 and 8192 in steps of 1024 -> 6144 (small pool: one 2 MiB segment)
    # 70 MiB + 1: between 64 and 128 MiB in steps of 16 MiB -> 80 MiB (its own 80 MiB segment)
    # 100,000,000 B: 64 MiB + 2 x 16 MiB < it <= 96 MiB -> 96 MiB (a 96 MiB segment)
    assert st.peak_allocated == 6144 + 80 * MiB + 96 * MiB
    assert st.peak_reserved == (2 + 80 + 96) * MiB
    # without the option: 512 B blocks, segments rounded to 2 MiB; 100,000,256 B leave 663,040 B
    # of their 96 MiB segment, under 1 MiB: not split off, so allocated counts the whole block
    plain = replay(SEQ)
    assert plain.peak_allocated == 5632 + (70 * MiB + 512) + 96 * MiB
    assert plain.peak_reserved == (2 + 72 + 96) * MiB


def test_roundup_power2_divisions_list_sets_intervals_by_size():
    from hf_memkit._cuda.allocator.config import parse_divisions

    # [64:8,>:2]: 8 divisions below and in [64 MiB, 128 MiB), 2 from 128 MiB on
    cfg = AllocatorConfig.from_env("roundup_power2_divisions:[64:8,>:2]")
    assert cfg.roundup_power2_divisions == (8,) * 7 + (2,) * 9
    st = replay([("alloc", "b", 70 * MiB + 1), ("alloc", "d", 300 * MiB + 1)], cfg)
    # 70 MiB + 1 in steps of 8 MiB -> 72 MiB; 300 MiB + 1 in steps of 128 MiB -> 384 MiB
    assert st.peak_allocated == 72 * MiB + 384 * MiB
    # torch's documented example: [256:1,512:2,1024:4,>:8] (keys in MiB, each its own interval)
    assert parse_divisions("[256:1,512:2,1024:4,>:8]") == (1,) * 9 + (2, 4) + (8,) * 5


def test_next_division_matches_torchs_own_example():
    from hf_memkit._cuda.allocator.config import next_division

    # CUDACachingAllocator.cpp: "if we need to round-up 1200 and number of divisions is 4 ...
    # the function will return 1280"
    assert next_division(1200, 4) == 1280
    assert next_division(1024, 4) == 1024          # a power of two stays
    assert next_division(1280, 4) == 1280          # on a division stays
    # 1 or 0 divisions, or a request not above 512 B x divisions: plain 512 B rounding
    assert AllocatorConfig(roundup_power2_divisions=1) == AllocatorConfig()
    assert AllocatorConfig(roundup_power2_divisions=8).round_size(4000) == 4096


def test_max_non_split_rounding_mb_lets_a_request_take_a_bigger_cached_block():
    # max_split_size 40 MiB: a 50 MiB request takes a cached 80 MiB block only when it is less
    # than max_non_split_rounding_mb (default 20 MiB) bigger
    events = [("alloc", "x", 80 * MiB), ("free", "x", 0), ("alloc", "y", 50 * MiB)]
    assert replay(events, AllocatorConfig.from_env("max_split_size_mb:40")).peak_reserved == (
        130 * MiB)
    cfg = AllocatorConfig.from_env("max_split_size_mb:40,max_non_split_rounding_mb:64")
    assert replay(events, cfg).peak_reserved == 80 * MiB


def test_cuda_malloc_async_is_not_the_caching_allocator():
    cfg = AllocatorConfig.from_env("backend:cudaMallocAsync")
    assert cfg.backend == "cudaMallocAsync"
    with pytest.raises(HfMemkitError, match="stream-ordered allocator"):
        CachingAllocator(cfg)


def test_per_process_memory_fraction_is_the_allocators_limit():
    cfg = AllocatorConfig.from_env("per_process_memory_fraction:0.5")
    assert cfg.limit(80 * GiB) == 40 * GiB
    # 1.0 is no limit (setMemoryFraction); 0 leaves nothing
    assert AllocatorConfig.from_env("per_process_memory_fraction:1").limit(80 * GiB) is None
    assert AllocatorConfig.from_env("per_process_memory_fraction:0").limit(80 * GiB) == 0
    # the limit is the replay's capacity: past it the allocator frees its cache, then raises
    assert replay(SEQ, capacity=cfg.limit(160 * MiB)).ooms == 1


def test_options_the_model_does_not_follow_are_named_not_dropped():
    cfg = AllocatorConfig.from_env("garbage_collection_threshold:0.6,expandable_segments:True,"
                                   "pinned_use_cuda_host_register:True")
    assert cfg.modelled() == ["expandable_segments:True"]
    note = cfg.unmodelled_note()
    assert "NOT modelled" in note and "garbage_collection_threshold:0.6" in note
    assert "pinned_use_cuda_host_register:True" in note
    assert AllocatorConfig.from_env("").unmodelled_note() is None


@pytest.mark.parametrize("text, named", [
    ("roundup_power2_divisions:3", "`roundup_power2_divisions:3`"),       # not a power of 2
    ("roundup_power2_divisions:[256:3]", "`256:3`"),
    ("roundup_power2_divisions:[300:2]", "`300:2`"),                      # size not a power of 2
    ("roundup_power2_divisions:[256:2", "closing `]`"),
    ("per_process_memory_fraction:1.5", "in [0.0, 1.0]"),
    ("per_process_memory_fraction:half", "`per_process_memory_fraction:half`"),
    ("backend:cudaMalloc", "`native` or `cudaMallocAsync`"),
    ("pinned_num_register_threads:3", "power of 2 <= 128"),
    ("max_non_split_rounding_mb:10", ">= 20"),
    ("per_process_memory_fractions:0.5", "did you mean `per_process_memory_fraction`"),
])
def test_values_torch_rejects_are_errors_naming_the_value_and_the_rule(text, named):
    with pytest.raises(HfMemkitError) as err:
        AllocatorConfig.from_env(text)
    assert named in str(err.value)
