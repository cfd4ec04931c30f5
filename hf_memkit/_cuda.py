"""What CUDA adds on top of live tensor bytes: allocator rounding and segments, the CUDA context,
and cuBLAS workspaces. (No SDPA kernel term: the CPU trace runs torch's flash kernel, which saves
what CUDA's flash/memory-efficient kernels save, the output and a log-sum-exp per row.)

Constants marked FIT are calibrated on the declared fit half of ``shared/anchors`` (see
``bench/estimator_gpu_anchors.py``, which reports the other half separately); the rest cite the
PyTorch source they come from.
"""

from __future__ import annotations

from dataclasses import dataclass

from ._units import MiB

# c10/cuda/CUDACachingAllocator.cpp: kMinBlockSize = 512 (every block is a multiple of 512 B),
# kSmallSize = 1 MiB (small pool, 2 MiB segments: kSmallBuffer), kLargeBuffer = 20 MiB segments for
# requests in (1 MiB, 10 MiB], kRoundLarge = 2 MiB rounding above kMinLargeAlloc = 10 MiB.
MIN_BLOCK = 512
SMALL_SIZE = 1 * MiB
SMALL_SEGMENT = 2 * MiB
LARGE_SEGMENT = 20 * MiB
MIN_LARGE_ALLOC = 10 * MiB
ROUND_LARGE = 2 * MiB


def round_block(nbytes: int) -> int:
    """Bytes the caching allocator hands out for a request (what max_memory_allocated counts)."""
    if nbytes <= 0:
        return 0
    return -(-nbytes // MIN_BLOCK) * MIN_BLOCK


def segment_bytes(nbytes: int) -> int:
    """Bytes cudaMalloc'd for a request that finds no cached block (what reserved counts)."""
    size = round_block(nbytes)
    if size <= SMALL_SIZE:
        return SMALL_SEGMENT
    if size < MIN_LARGE_ALLOC:
        return LARGE_SEGMENT
    return -(-size // ROUND_LARGE) * ROUND_LARGE


# CUDA context + loaded kernels, as NVML sees it before any tensor. shared/anchors
# hf_perf_cuda_context_overhead: 1343 MiB on V100, CUDA 11.2 (eager module loading). With lazy
# loading (CUDA >= 11.7, the default of every torch 2.x wheel) the kernels load on first use;
# a training step loads the GEMM, SDPA and elementwise kernels it runs. FIT: see CALIBRATION.
CONTEXT_EAGER_LOADING = 1343 * MiB


@dataclass(frozen=True)
class CudaCalibration:
    """The fitted CUDA constants (bench/estimator_gpu_anchors.py --fit prints them)."""

    # context + lazily loaded kernels during training, NVML-visible, outside the allocator.
    # NOT fitted: shared/anchors has no NVML figure of a training step under lazy loading (its one
    # context figure, 1343 MiB, is eager loading on CUDA 11.2 = CONTEXT_EAGER_LOADING).
    context: int = 600 * MiB
    # reserved = allocated * (1 + frag_ratio) + frag_const, for a training step's churn.
    # NOT fitted: no usable anchor measures max_memory_reserved of a fixed-shape training step.
    frag_ratio: float = 0.06
    frag_const: int = 64 * MiB
    # relative uncertainty of an estimate: std of the relative residuals of the fit half
    # (32 max_memory_allocated rows) in bench/estimator_gpu_anchors.py (holdout: 33 rows, median
    # |err| 0.7%, worst 6.4%). FIT.
    rel_sigma: float = 0.0236
    # allocated bytes beyond the traced tensors and the cuBLAS workspaces (cuBLASLt workspace,
    # 512 B block rounding, small scalar/RNG blocks). FIT: median residual of the fit half
    # (CRC32(case id) even) of the shared/anchors sdpa_* rows, bench/estimator_gpu_anchors.py.
    alloc_const: int = 3_800_780


CALIBRATION = CudaCalibration()


def cublas_workspace(compute_capability: tuple[int, int] | None) -> int:
    """cuBLAS workspace kept by torch per (handle, stream): forward and the autograd thread each
    get one. aten/src/ATen/cuda/CublasHandlePool.cpp: default ":4096:2:16:8" = 4096 KiB x 2 +
    16 KiB x 8 (8.125 MiB); on Hopper (sm_90) ":4096:8:16:8" ... 32 MiB + 128 KiB.
    """
    per = (32 * MiB + 128 * 1024) if compute_capability and compute_capability >= (9, 0) else (
        8 * MiB + 128 * 1024)
    return 2 * per
