"""What CUDA adds on top of live tensor bytes: allocator rounding and segments, the CUDA context
(by CUDA version and module loading), cuBLAS workspaces (``CUBLAS_WORKSPACE_CONFIG``) and NCCL
buffers. (What CUDA's kernels
allocate is traced: ``_cuda.emulation``.)

Constants marked FIT are calibrated on the declared fit half of the published GPU anchors
(docs/anchors.md; see ``bench/estimator_gpu_anchors.py``, which reports the other half
separately); the rest cite the PyTorch source they come from.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from .._errors import ConfigError
from .._units import MiB, format_bytes

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


# CUDA context + loaded kernels, as NVML sees it before any tensor. Anchor
# hf_perf_cuda_context_overhead (docs/anchors.md): 1343 MiB on V100, CUDA 11.2 (eager module
# loading: every kernel of every library loads at context creation). Measured.
CONTEXT_EAGER_LOADING = 1343 * MiB
# Lazy module loading (CUDA >= 11.7; torch sets CUDA_MODULE_LOADING=LAZY when it is unset,
# torch/cuda/__init__.py _lazy_init). FIT on bench/results/gpu (FIT_SET: one H200, CUDA 13.0,
# driver 580.159, torch 2.11): NVML's used memory grows by 523.6 MiB when the context is created,
# before any tensor (every run of the file alike; bench/fit_constants.py). Older reports:
# ~300-400 MB (pytorch/pytorch #107667, #109888).
CONTEXT_LAZY_INIT = 524 * MiB
# Kernels a training step then loads (cuBLAS/cuBLASLt GEMMs, attention, elementwise, reductions,
# the optimizer's). FIT on the same file: NVML used - max_memory_reserved after the steps is
# 747.6 MiB in the runs without a fused attention kernel and 763.6 MiB in those with one (fp16 /
# bf16 SDPA): 224 and 240 MiB over the context; the larger is taken (bench/fit_constants.py).
LAZY_TRAINING_KERNELS = 240 * MiB
LAZY_LOADING_SINCE = (11, 7)
# The CUDA of the default `pip install torch` wheel (PyPI) when this torch has none (a CPU build):
# CUDA 13.0 since torch 2.11 (pytorch/pytorch#190355: "the PyPI-published wheel (currently 13.0)").
DEFAULT_WHEEL_CUDA = "13.0"
# NCCL: NCCL_BUFFSIZE (default 4 MiB, NCCL environment-variable docs) per channel, per ring peer
# (send + receive), for the Simple protocol, and about as much again for LL128. Channels: NCCL
# picks up to 16+ over NVLink and a few over PCIe; we take 16 and 4. Cited defaults, not measured.
NCCL_BUFFSIZE = 4 * MiB
NCCL_CHANNELS = {"nvlink": 16, "pcie": 4}


@dataclass(frozen=True)
class CudaCalibration:
    """The constants of a CUDA estimate's band (``_estimate.device``) and the one constant fitted
    on published GPU measurements (bench/estimator_gpu_anchors.py; fit set: the rows of the
    published GPU anchors, docs/anchors.md, whose CRC32(case id) is even). The context is not
    here: it follows the CUDA version (``cuda_runtime``); fragmentation is not here: it is
    replayed (``_estimate.allocation``); a user calibration (``hf-memkit calibrate``) replaces the
    context, the workspaces and the band for that GPU.

    The band is built from the uncertainty of each term, combined as independent errors (model
    states carry none: they follow from the parameter list). Each sigma says where it comes
    from; the ASSUMED ones are replaced once a GPU results file (bench/results/gpu/) measures
    them."""

    # traced activations and temporaries, relative 1-sigma, CPU part: the residuals of
    # bench/estimator_cpu.py (26 real Trainer runs: std 0.22%, worst 0.97%), rounded up to 0.5%
    # for architectures the bench does not cover. MEASURED (CPU).
    traced_cpu_sigma: float = 0.005
    # what the CUDA emulation (autocast policy, SDPA kernel, dropout masks: ``_cuda.emulation``)
    # adds to the traced bytes, relative 1-sigma. FIT on bench/results/gpu (FIT_SET: 32 real
    # Trainer runs on an H200, Llama / Qwen2 / GPT-2 / BERT, fp32, AMP and pure bf16, SDPA and
    # eager, checkpointing, LoRA): (estimated - measured max_memory_allocated) / traced bytes has
    # RMS 1.7% and worst +4.6% / -4.2%; 1-sigma is the worst rounded up to a whole percent, 5%
    # (computed by bench/fit_constants.py; was 4.5%, typed below the worst, and 10% assumed
    # before). The holdout file is reported apart by bench/gpu_reestimate.py. (The published
    # anchors, bench/estimator_gpu_anchors.py, are transformers-4.4x rows whose model code kept more
    # tensors: their gap is the old code's, not the emulation's.)
    traced_cuda_sigma: float = 0.05
    # the same where the emulation does not act on the step (no autocast, SDPA kernel, fused
    # dropout, bitsandbytes base, CUDA-only technique or TRL head: ``phases.emulation_acts``):
    # CUDA then runs the ops the CPU trace measured, whose saved tensors autograd's formulas fix
    # whatever the device (tools/autograd/derivatives.yaml); what differs is kernels' private
    # buffers (index sorts of the embedding backward, reduction scratch), cuBLAS's workspaces
    # being a term of their own. MEASURED on the fit file's fp32 eager runs without dropout
    # (Llama, Qwen2): worst -2.4% of the traced bytes; 1-sigma 3% (the worst rounded up to a whole
    # percent, bench/fit_constants.py).
    traced_cuda_floor_sigma: float = 0.03
    # the CUDA context with lazy module loading: measured on one GPU, CUDA and driver (764 MiB
    # on an H200, bench/results/gpu); it varies with the GPU, the driver and the CUDA version
    # (older reports: 300-400 MiB at init): 1-sigma 100 MiB for the others. ASSUMED.
    context_sigma: int = 100 * MiB
    # the context with eager loading is one measured row (1343 MiB, V100): 1-sigma 50 MiB for
    # other GPUs and drivers. ASSUMED.
    context_eager_sigma: int = 50 * MiB
    # what the caching allocator adds over live bytes when the step runs at its smallest
    # capacity, relative 1-sigma. The replay runs the allocator's own algorithm, so its error is
    # the traced stream's: bench/allocator_sensitivity.py replays each stream with every
    # activation-sized request off by up to 5% (share moves 24% median, 37% max over 5 cases).
    # MEASURED on a GPU by bench/band_fit.py (FIT_SET, 32 H200 runs; measured - predicted
    # fragmentation relative to the fragmentation at the smallest capacity): 68th percentile of
    # |error| 31% (a robust 1-sigma), RMS 109% from heavy tails (Qwen2 pure bf16 +130%, BERT's
    # small blocks 2-4x); 0.35 is the 68th percentile rounded up to 5% (bench/fit_constants.py).
    # Refitting to the RMS would make this term 87-95% of every margin; the tails are runs whose centre is off, which a wider band would not fix. Holdout
    # (8 runs re-estimated with transformers 5.17): 7/8 reserved errors inside the band.
    allocator_sigma: float = 0.35
    # NCCL buffers, relative 1-sigma: cited defaults, not measured (``nccl_buffers``). ASSUMED.
    nccl_sigma: float = 0.5
    # allocated bytes beyond the traced tensors and the cuBLAS workspaces (cuBLASLt workspace,
    # 512 B block rounding, small scalar/RNG blocks). FIT: median residual of the fit half with
    # the reconstruction terms (setting it to 0 moves the holdout median by 0.2 points).
    alloc_const: int = 3_800_780


CALIBRATION = CudaCalibration()


def cublas_workspace(compute_capability: tuple[int, int] | None) -> int:
    """cuBLAS workspace kept by torch per (handle, stream): forward and the autograd thread each
    get one. aten/src/ATen/cuda/CublasHandlePool.cpp: default ":4096:2:16:8" = 4096 KiB x 2 +
    16 KiB x 8 (8.125 MiB); on Hopper (sm_90) ":4096:8:16:8" ... 32 MiB + 128 KiB. Torch's
    default only: ``cublas_workspaces`` reads the environment.
    """
    per = (32 * MiB + 128 * 1024) if compute_capability and compute_capability >= (9, 0) else (
        8 * MiB + 128 * 1024)
    return 2 * per


# CUBLAS_WORKSPACE_CONFIG: ":SIZE_KiB:COUNT" groups (several may follow one another, as in
# ":4096:2:16:8"); parseChosenWorkspaceSize sums SIZE x 1024 x COUNT over every match of this
# pattern, and warns and keeps its default when nothing matches.
_WORKSPACE_GROUP = re.compile(r":([0-9]+):([0-9]+)")
# CUBLASLT_WORKSPACE_SIZE (KiB): the cuBLASLt workspace when torch keeps it apart from cuBLAS's,
# which it does only with TORCH_CUBLASLT_UNIFIED_WORKSPACE=0 (torch >= 2.11 unifies them by
# default: cuBLASLt then works in the cuBLAS workspace and the variable only caps its use);
# parseCUDABlasLtWorkspaceSize's default there is 1024 KiB.
LT_DEFAULT_KIB = 1024


@dataclass(frozen=True)
class CublasWorkspaces:
    """The workspaces torch allocates per thread that runs matmuls (forward, autograd's)."""

    per_thread: tuple[int, ...]   # bytes of each workspace one thread allocates
    notes: tuple[str, ...] = ()   # what the environment changed, for a person
    configured: bool = False      # CUBLAS_WORKSPACE_CONFIG set the cuBLAS workspace

    @property
    def total(self) -> int:
        return 2 * sum(self.per_thread)


def cublas_workspaces(compute_capability: tuple[int, int] | None,
                      env: Mapping[str, str] | None = None) -> CublasWorkspaces:
    """The cuBLAS workspace (``CUBLAS_WORKSPACE_CONFIG``, else torch's default by GPU) and, with
    ``TORCH_CUBLASLT_UNIFIED_WORKSPACE=0``, a separate cuBLASLt one (``CUBLASLT_WORKSPACE_SIZE``
    KiB). A ``CUBLAS_WORKSPACE_CONFIG`` that torch cannot read keeps the default with a warning,
    as torch does."""
    env = os.environ if env is None else env
    default = cublas_workspace(compute_capability) // 2
    size, notes = default, []
    text = env.get("CUBLAS_WORKSPACE_CONFIG")
    groups = _WORKSPACE_GROUP.findall(text) if text is not None else []
    if text is not None:
        if groups:
            size = sum(int(kib) * 1024 * int(count) for kib, count in groups)
            notes.append(f"CUBLAS_WORKSPACE_CONFIG={text}: cuBLAS workspace "
                         f"{format_bytes(size)} per thread (torch's default here: "
                         f"{format_bytes(default)})")
        else:
            _warn(f"CUBLAS_WORKSPACE_CONFIG={text!r} has no `:SIZE_KiB:COUNT` group (e.g. "
                  "`:4096:8` or `:16:8`); torch ignores it with a warning and keeps its default "
                  f"workspace ({format_bytes(default)} per thread), and so does the estimate")
    workspaces = (size,)
    if env.get("TORCH_CUBLASLT_UNIFIED_WORKSPACE") == "0":  # c10::utils::check_env: "0" only
        lt_text = env.get("CUBLASLT_WORKSPACE_SIZE")
        kib = LT_DEFAULT_KIB
        if lt_text is not None and lt_text.strip().isdigit():  # std::stoi
            kib = int(lt_text)
        elif lt_text is not None:
            _warn(f"CUBLASLT_WORKSPACE_SIZE={lt_text!r} is not a whole number of KiB; torch "
                  f"keeps its default ({LT_DEFAULT_KIB} KiB), and so does the estimate")
        workspaces += (kib * 1024,)
        notes.append(f"TORCH_CUBLASLT_UNIFIED_WORKSPACE=0: a cuBLASLt workspace of its own, "
                     f"{format_bytes(kib * 1024)} per thread (CUBLASLT_WORKSPACE_SIZE)")
    elif env.get("CUBLASLT_WORKSPACE_SIZE") is not None:
        notes.append("CUBLASLT_WORKSPACE_SIZE: cuBLASLt works in the cuBLAS workspace (torch "
                     "unifies them unless TORCH_CUBLASLT_UNIFIED_WORKSPACE=0), so it adds no "
                     "memory")
    return CublasWorkspaces(workspaces, tuple(notes), configured=bool(groups))


def _warn(message: str) -> None:
    import warnings

    warnings.warn(message, UserWarning, stacklevel=3)


_VERSION = re.compile(r"^\s*(\d{1,2})\.(\d{1,2})(?:\.\d+)?\s*$")


def parse_cuda_version(value: object) -> tuple[int, int]:
    """``"12.8"`` -> (12, 8); a clear error for anything else."""
    m = _VERSION.match(str(value)) if isinstance(value, (str, int, float)) else None
    if m is None:
        raise ConfigError([f"cuda_version must look like '12.8' or '11.2' (major.minor), got "
                           f"{value!r}; leave it out to use the installed torch's CUDA "
                           f"(else {DEFAULT_WHEEL_CUDA}, the default torch wheel's)"],
                          source="cuda_version")
    return int(m.group(1)), int(m.group(2))


@dataclass(frozen=True)
class CudaRuntime:
    """The target's CUDA version and what follows from it."""

    version: str
    lazy_loading: bool
    context: int       # NVML-visible bytes outside the allocator during training
    source: str        # where the version came from

    def note(self) -> str:
        loading = "lazy module loading" if self.lazy_loading else "eager module loading"
        return (f"CUDA {self.version} ({self.source}): {loading}, context "
                f"{self.context // MiB} MiB")


def cuda_runtime(cuda_version: str | None = None,
                 env: Mapping[str, str] | None = None) -> CudaRuntime:
    """The target's runtime: ``cuda_version``, else the installed torch's CUDA, else the default
    torch wheel's. ``CUDA_MODULE_LOADING=EAGER`` (or a CUDA before 11.7) loads every kernel at
    start: the measured eager context; otherwise the lazy one."""
    env = os.environ if env is None else env
    if cuda_version is not None:
        source = "given"
    else:
        import torch

        cuda_version, source = (torch.version.cuda, "this torch") if torch.version.cuda else (
            DEFAULT_WHEEL_CUDA, "default torch wheel")
    major, minor = parse_cuda_version(cuda_version)
    mode = str(env.get("CUDA_MODULE_LOADING", "")).strip().upper()
    lazy = (major, minor) >= LAZY_LOADING_SINCE and mode != "EAGER"
    context = CONTEXT_LAZY_INIT + LAZY_TRAINING_KERNELS if lazy else CONTEXT_EAGER_LOADING
    return CudaRuntime(f"{major}.{minor}", lazy, context, source)


def nccl_buffers(ranks: int, interconnect: str | None,
                 env: Mapping[str, str] | None = None) -> int:
    """NCCL communicator buffers one rank holds outside the caching allocator (0 for one rank)."""
    if ranks <= 1:
        return 0
    env = os.environ if env is None else env
    try:
        buffsize = int(env.get("NCCL_BUFFSIZE", NCCL_BUFFSIZE))
    except ValueError:
        buffsize = NCCL_BUFFSIZE
    link = "nvlink" if interconnect and "nvlink" in interconnect.lower() else "pcie"
    return NCCL_CHANNELS[link] * 2 * buffsize * 2
