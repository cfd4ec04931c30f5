"""Memory readings per device kind, behind one small interface (bytes throughout).

* CUDA: the caching allocator's host-side counters (``memory_allocated``, ``memory_reserved``,
  ``memory_stats``' allocated, active and reserved peaks / ``reset_peak_memory_stats``): none of
  them synchronises the device. NVML (nvidia-ml-py, where installed) adds what ``nvidia-smi``
  shows, the utilisation and the other processes on the device, each on its own (``_nvml``).
* CPU: resident set size from ``/proc/self/status``; the peak is ``VmHWM``, reset by writing
  ``5`` to ``/proc/self/clear_refs`` (docs/stack-facts.md#cpu-ground-truth). "Allocated" is
  RSS minus the process's non-tensor baseline (RSS minus the bytes of live CPU tensors, measured
  once when training starts and once more after the first optimizer step, when thread pools and
  kernel caches exist), so it is comparable with ``MemoryEstimate.peak_allocated``. It is exact
  when the process runs with ``MALLOC_MMAP_THRESHOLD_=65536``; without it, freed heap memory that
  glibc keeps counts.
* MPS: ``torch.mps.current_allocated_memory`` / ``driver_allocated_memory``; MPS keeps no peak,
  so the peak is the largest reading taken.
"""

from __future__ import annotations

import gc
import logging

import torch

from .._device import rss as _rss
from ._nvml import NvmlFields

logger = logging.getLogger(__name__)


class Reader:
    kind = "none"

    def allocated(self) -> int | None:
        return None

    def reserved(self) -> int | None:
        return None

    def peak(self) -> int | None:
        """Peak allocated since the last ``reset_peak``."""
        return None

    def peaks(self) -> dict[str, int | None]:
        """Peaks since the last ``reset_peak``: ``allocated``, ``active`` (CUDA: bytes of blocks
        in use, blocks freed but still awaiting another stream included) and ``reserved``."""
        return {"allocated": self.peak(), "active": None, "reserved": None}

    def reset_peak(self) -> None:
        pass

    def anchor(self) -> None:
        """Re-measure any baseline (CPU); called when training starts and after step 1."""

    def extra(self) -> dict[str, float]:
        """Further readings in bytes or plain numbers, keyed by metric name (NVML, RSS)."""
        return {}

    def close(self) -> None:
        pass


class CudaReader(Reader):
    kind = "cuda"

    def __init__(self, index: int | None):
        self.index = torch.cuda.current_device() if index is None else index
        self.nvml = NvmlFields(self.index)

    def allocated(self) -> int:
        return int(torch.cuda.memory_allocated(self.index))

    def reserved(self) -> int:
        return int(torch.cuda.memory_reserved(self.index))

    def peak(self) -> int:
        return int(torch.cuda.max_memory_allocated(self.index))

    def peaks(self) -> dict[str, int | None]:
        stats = torch.cuda.memory_stats(self.index) or {}
        alloc = stats.get("allocated_bytes.all.peak")
        reserved = stats.get("reserved_bytes.all.peak")
        active = stats.get("active_bytes.all.peak")
        return {"allocated": int(self.peak() if alloc is None else alloc),
                "active": None if active is None else int(active),
                "reserved": int(torch.cuda.max_memory_reserved(self.index)
                                if reserved is None else reserved)}

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.index)

    def open_nvml(self) -> bool:
        """Start NVML for this device; False (with one warning) where it is missing or fails."""
        return self.nvml.open()

    def extra(self) -> dict[str, float]:
        return self.nvml.read()

    def close(self) -> None:
        self.nvml.close()


class CpuReader(Reader):
    kind = "cpu"

    def __init__(self):
        self.baseline = 0  # RSS bytes that are not tensors
        self.can_reset = True

    def anchor(self) -> None:
        gc.collect()
        self.baseline = max(0, _rss.current_rss() - _rss.alive_cpu_tensor_bytes(collect=False))

    def allocated(self) -> int:
        return max(0, _rss.current_rss() - self.baseline)

    def reserved(self) -> int:
        return self.allocated()

    def peak(self) -> int | None:
        hwm = _rss.peak_rss()
        return None if hwm is None else max(0, hwm - self.baseline)

    def peaks(self) -> dict[str, int | None]:
        peak = self.peak()
        return {"allocated": peak, "active": None, "reserved": peak}   # reserved = allocated

    def reset_peak(self) -> None:
        if self.can_reset and not _rss.reset_peak_rss():
            self.can_reset = False
            logger.warning("cannot reset the peak RSS (/proc/self/clear_refs); "
                           "memory/peak_* are peaks since the process started")

    def extra(self) -> dict[str, float]:
        return {"rss": float(_rss.current_rss())}


class MpsReader(Reader):
    kind = "mps"

    def __init__(self):
        self._peak = 0

    def allocated(self) -> int:
        a = int(torch.mps.current_allocated_memory())
        self._peak = max(self._peak, a)
        return a

    def reserved(self) -> int:
        return int(torch.mps.driver_allocated_memory())

    def peak(self) -> int:
        return max(self._peak, self.allocated())

    def reset_peak(self) -> None:
        self._peak = 0


def make_reader(device: torch.device) -> Reader:
    if device.type == "cuda":
        return CudaReader(device.index)
    if device.type == "mps":
        return MpsReader()
    return CpuReader()
