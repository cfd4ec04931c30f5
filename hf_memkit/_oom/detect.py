"""What an out-of-memory error is (``is_oom_error``), and the CUDA caching allocator's history
with a snapshot of it on OOM (pytorch.org/memory_viz)."""

from __future__ import annotations

import logging
import os

import torch

logger = logging.getLogger("hf_memkit._oom.guard")
MEMORY_VIZ = "https://pytorch.org/memory_viz"

# What torch puts in the message when memory ran out, one entry per source. Not OOMs, though often
# met near one: cuDNN's bare CUDNN_STATUS_INTERNAL_ERROR and CUDNN_STATUS_NOT_SUPPORTED (the
# latter is in accelerate's batch-size list), CUBLAS_STATUS_NOT_INITIALIZED and
# CUBLAS_STATUS_EXECUTION_FAILED: they have other causes too, so they stay errors.
OOM_MESSAGES = (
    # the caching allocators (torch.OutOfMemoryError): "CUDA out of memory. Tried to allocate ..."
    # (HIP, XPU alike), "MPS backend out of memory", and the CPU allocator
    "CUDA out of memory", "HIP out of memory", "XPU out of memory", "MPS backend out of memory",
    "DefaultCPUAllocator: can't allocate memory",
    # cudaErrorMemoryAllocation from a runtime call outside the allocator (C10_CUDA_CHECK,
    # torch.AcceleratorError): "CUDA error: out of memory"
    "CUDA error: out of memory", "HIP error: out of memory",
    # libraries that allocate their own handles and workspaces; torch names their status:
    # "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`" (cuBLAS, cuBLASLt)
    "CUBLAS_STATUS_ALLOC_FAILED",
    # "cuDNN error: CUDNN_STATUS_ALLOC_FAILED" (cuDNN <= 8); cuDNN 9 split it into sub-codes
    "CUDNN_STATUS_ALLOC_FAILED", "CUDNN_STATUS_INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED",
    "CUDNN_STATUS_INTERNAL_ERROR_HOST_ALLOCATION_FAILED",
    "CUSOLVER_STATUS_ALLOC_FAILED", "CUSPARSE_STATUS_ALLOC_FAILED", "CUFFT_ALLOC_FAILED",
)


def first_line(exc: BaseException) -> str:
    """``Type: first line of the message``, as the guard quotes an error."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def is_oom_error(exc: BaseException) -> bool:
    """``torch.OutOfMemoryError``, or a ``RuntimeError`` (``torch.AcceleratorError`` included)
    whose message says memory ran out: the caching allocators' wording, CUDA's
    ``out of memory`` error, or a cuBLAS / cuDNN / cuSOLVER / cuSPARSE / cuFFT allocation
    failure (``OOM_MESSAGES``)."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc) for m in OOM_MESSAGES)


_recording = False
_snapshots: list[str] = []


def start_memory_history(max_entries: int = 100_000) -> bool:
    """Record the CUDA caching allocator's history (for a snapshot on OOM); call on CUDA only.

    Every alloc/free event with its stack (``context="all"``), Python frames only
    (``stacks="python"``): torch's default, ``stacks="all"``, also unwinds the C++ stack at
    every allocation and free, which makes each entry larger and the dump on OOM slower (C++
    frames are symbolized when the snapshot is written), for frames pytorch.org/memory_viz
    rarely needs to place an allocation in the model's code. These keywords of
    ``_record_memory_history`` are the same from torch 2.1 to 2.13."""
    global _recording
    try:
        torch.cuda.memory._record_memory_history(
            enabled="all", context="all", stacks="python", max_entries=max_entries)
    except Exception as exc:  # private API (STYLE.md §11): say which feature is lost
        logger.warning("cannot record CUDA memory history (%s); no snapshot on OOM", exc)
        return False
    _recording = True
    return True


def stop_memory_history() -> None:
    global _recording
    if _recording:
        try:
            torch.cuda.memory._record_memory_history(enabled=None)
        except Exception:
            pass
    _recording = False


def recording_memory_history() -> bool:
    return _recording


def dump_snapshot(directory: str, name: str) -> str | None:
    """Write ``<directory>/<name>.pickle`` (pytorch.org/memory_viz format) if history is on."""
    if not _recording:
        return None
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"{name}.pickle")
    try:
        torch.cuda.memory._dump_snapshot(path)
    except Exception as exc:
        logger.warning("could not dump the CUDA memory snapshot (%s)", exc)
        return None
    _snapshots.append(path)
    logger.warning("CUDA memory snapshot written to %s (open it at %s)", path, MEMORY_VIZ)
    return path


def snapshot_paths() -> tuple[str, ...]:
    return tuple(_snapshots)
