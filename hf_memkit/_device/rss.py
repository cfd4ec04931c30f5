"""CPU memory readings from /proc (Linux): the peak-RSS window used as ground truth
(docs/stack-facts.md#cpu-ground-truth).

With ``MALLOC_MMAP_THRESHOLD_=65536`` set at process start, every large tensor is its own
mapping, so resident-set growth tracks live tensor bytes. Writing ``5`` to
``/proc/self/clear_refs`` resets ``VmHWM`` (the peak) to the current RSS.
"""

from __future__ import annotations

import gc
import os
import warnings

import psutil


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def current_rss() -> int:
    """Resident set size of this process, bytes."""
    kib = _status_kib("VmRSS")
    return kib * 1024 if kib is not None else psutil.Process().memory_info().rss


def peak_rss() -> int | None:
    """``VmHWM``: the highest RSS since start or since the last ``reset_peak_rss``; None off Linux."""
    kib = _status_kib("VmHWM")
    return kib * 1024 if kib is not None else None


def reset_peak_rss() -> bool:
    """Reset ``VmHWM`` to the current RSS. False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


MMAP_THRESHOLD = 65536
_mallopt_called = False   # set_mmap_threshold succeeded in this process


def mmap_threshold_set() -> bool:
    """Whether this process runs with the small mmap threshold that makes RSS exact: the env var
    ``MALLOC_MMAP_THRESHOLD_`` at start, or ``set_mmap_threshold`` called (``hf-memkit train``
    calls it before the model exists)."""
    return os.environ.get("MALLOC_MMAP_THRESHOLD_") is not None or _mallopt_called


def set_mmap_threshold(threshold: int = MMAP_THRESHOLD) -> bool:
    """Ask glibc to mmap every allocation >= ``threshold`` bytes (so RSS tracks tensors exactly).

    Only affects allocations made afterwards; the env var ``MALLOC_MMAP_THRESHOLD_`` does the same
    from process start. Returns False off glibc.
    """
    global _mallopt_called
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        m_mmap_threshold = -3  # glibc malloc.h: M_MMAP_THRESHOLD
        ok = bool(libc.mallopt(m_mmap_threshold, int(threshold)))
    except (OSError, AttributeError):
        return False
    _mallopt_called = _mallopt_called or ok
    return ok


def alive_cpu_tensor_bytes(*, collect: bool = True) -> int:
    """Bytes of the distinct CPU tensor storages reachable from Python (a gc walk: slow, rare).

    Wrapper tensor subclasses that own no storage of their own (``DTensor``: FSDP2's sharded
    parameters, their gradients and optimizer states) count through their inner tensors, i.e.
    the local shard this process holds, never the global shape.
    """
    import torch

    if collect:
        gc.collect()
    seen: dict[int, int] = {}

    def add(t: torch.Tensor, depth: int = 0) -> None:
        if t.device.type != "cpu" or t.is_meta:
            return
        try:
            st = t.untyped_storage()
            ptr = st.data_ptr()
        except Exception:  # a wrapper subclass (DTensor) has no storage: count its inner tensors
            flatten = getattr(t, "__tensor_flatten__", None)
            if flatten is None or depth > 4:
                return
            for name in flatten()[0]:
                inner = getattr(t, name, None)
                if isinstance(inner, torch.Tensor):
                    add(inner, depth + 1)
            return
        if ptr and ptr not in seen:
            seen[ptr] = st.nbytes()

    with warnings.catch_warnings():  # deprecated torch shims and fake tensors warn when probed
        warnings.simplefilter("ignore")
        for o in gc.get_objects():
            if not isinstance(o, torch.Tensor):
                continue
            try:
                add(o)
            except Exception:  # sparse, fake or other exotic tensors
                continue
    return sum(seen.values())
