"""What an out-of-memory error is (``is_oom_error``), which ones are the host's memory rather
than the device's (``host_memory_error``), and the CUDA caching allocator's history with a
snapshot of it on OOM (pytorch.org/memory_viz)."""

from __future__ import annotations

import itertools
import linecache
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
    # torch.AcceleratorError): "CUDA error: out of memory" (RUNTIME_OOM below)
    "CUDA error: out of memory", "HIP error: out of memory",
    # libraries that allocate their own handles and workspaces; torch names their status:
    # "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`" (cuBLAS, cuBLASLt)
    "CUBLAS_STATUS_ALLOC_FAILED",
    # "cuDNN error: CUDNN_STATUS_ALLOC_FAILED" (cuDNN <= 8); cuDNN 9 split it into sub-codes
    "CUDNN_STATUS_ALLOC_FAILED", "CUDNN_STATUS_INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED",
    "CUDNN_STATUS_INTERNAL_ERROR_HOST_ALLOCATION_FAILED",
    "CUSOLVER_STATUS_ALLOC_FAILED", "CUSPARSE_STATUS_ALLOC_FAILED", "CUFFT_ALLOC_FAILED",
)


# Host memory, not the device's: a smaller batch on the device is not the remedy.
# * Pinned (page-locked) host memory: torch's CachingHostAllocator (behind Tensor.pin_memory(),
#   torch.empty(..., pin_memory=True), the DataLoader's pin_memory, a non_blocking copy to the
#   CPU) calls C10_CUDA_CHECK(cudaHostAlloc(...)) (or cudaHostRegister): when that fails it raises
#   torch.AcceleratorError (a plain RuntimeError on older torch) "CUDA error: out of memory",
#   the same words as any CUDA runtime call outside the device caching allocator (a kernel
#   module loaded lazily into a full device, a stream or event created there), which stay device
#   OOMs. torch.OutOfMemoryError ("CUDA out of memory. Tried to allocate ...") is the device
#   caching allocator's alone, so never pinned memory. A pinned failure is told by where it
#   happened (``_while_pinning``); one we cannot place (a non_blocking copy to the CPU) stays a
#   device OOM.
# * The CPU allocator, on a run whose device is not the CPU (nor MPS, whose memory is the
#   host's): host RAM.
RUNTIME_OOM = ("CUDA error: out of memory", "HIP error: out of memory")
CPU_OOM = "DefaultCPUAllocator: can't allocate memory"
PIN_MODULE = "torch/utils/data/_utils/pin_memory.py"     # the DataLoader's pinning (no other work)
PINNED, HOST = "pinned (page-locked) host memory", "host memory (RAM)"
HOST_FIX = {
    PINNED: "set dataloader_pin_memory=False (the DataLoader pins every batch), offload less to "
            "the host (activation_offloading, checkpoint offload, CPU offload of parameters or "
            "optimizer state), or free host RAM (pinned pages cannot be swapped out, and torch "
            "rounds each pinned block up to a power of two)",
    HOST: "free host RAM: fewer or lighter dataloader workers (dataloader_num_workers), less "
          "offload to the CPU, fewer predictions gathered on the CPU in evaluation "
          "(prediction_loss_only=True, preprocess_logits_for_metrics), or a machine with more RAM",
}


def host_memory_error(exc: BaseException, device: str | None = None) -> str | None:
    """``PINNED`` or ``HOST`` when ``exc`` says the host's memory ran out, not the device's;
    else ``None``. ``device``: the run's device type ("cuda", "cpu", ...); on an accelerator
    other than MPS the CPU allocator's failure is host RAM too (unknown device: not counted)."""
    if not isinstance(exc, RuntimeError):
        return None
    text = str(exc)
    if (not isinstance(exc, torch.OutOfMemoryError) and any(m in text for m in RUNTIME_OOM)
            and _while_pinning(exc, text)):
        return PINNED
    if device not in (None, "cpu", "mps") and CPU_OOM in text:
        return HOST
    return None


def _while_pinning(exc: BaseException, text: str) -> bool:
    """Whether a CUDA runtime OOM came from pinning host memory: the DataLoader's pin-memory
    thread (its re-raised message says so), a frame in torch's DataLoader pinning module, or a
    failing call that asks for pinned memory (``t.pin_memory()``, ``pin_memory=True``)."""
    if "in pin memory thread" in text:
        return True
    tb, last = exc.__traceback__, None
    while tb is not None:
        if tb.tb_frame.f_code.co_filename.replace(os.sep, "/").endswith(PIN_MODULE):
            return True
        last, tb = tb, tb.tb_next
    return last is not None and "pin_memory" in _failing_call(last)


def _failing_call(tb) -> str:
    """The source of the call that raised in the innermost frame (all its lines; Python 3.10:
    its first line)."""
    code, first = tb.tb_frame.f_code, tb.tb_lineno
    last = first
    if hasattr(code, "co_positions") and tb.tb_lasti >= 0:
        pos = next(itertools.islice(code.co_positions(), tb.tb_lasti // 2, None), None)
        if pos and pos[0] and pos[1]:
            first, last = pos[0], pos[1]
    return "".join(linecache.getline(code.co_filename, n) for n in range(first, last + 1))


def first_line(exc: BaseException) -> str:
    """``Type: first line of the message``, as the guard quotes an error."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def is_oom_error(exc: BaseException) -> bool:
    """Whether ``exc`` says the device ran out of memory: ``torch.OutOfMemoryError``, or a
    ``RuntimeError`` (``torch.AcceleratorError`` included) whose message says so: the caching
    allocators' wording, CUDA's ``out of memory`` error, or a cuBLAS / cuDNN / cuSOLVER /
    cuSPARSE / cuFFT allocation failure (``OOM_MESSAGES``). Not pinned host memory running out
    (``cudaHostAlloc``: the DataLoader's ``pin_memory``, ``Tensor.pin_memory()``): a smaller
    batch does not free host memory (``host_memory_error``)."""
    if host_memory_error(exc) is not None:
        return False
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
    except Exception as exc:  # private API (docs/style.md §11): say which feature is lost
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
