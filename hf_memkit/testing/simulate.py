"""A simulated device-memory budget on CPU, for testing plans without a GPU.

``SimulatedMemoryBudget(limit)`` is a ``TorchDispatchMode`` that counts the bytes of every live
tensor storage (tensors alive when it starts, plus every storage an op creates while it is
active, released when the storage is freed) and raises ``torch.OutOfMemoryError`` with CUDA's
wording when the count would exceed ``limit``, so accelerate's ``find_executable_batch_size`` and
the Trainer's ``auto_find_batch_size`` react as they do on a GPU
(docs/stack-facts.md#oom-wording-and-batch-size-retry). It also records the peak, which tests
compare with the budget.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from .._units import format_bytes

OOM_TEMPLATE = ("CUDA out of memory. Tried to allocate {req}. GPU 0 has a total capacity of "
                "{cap} of which {free} is free. (simulated by hf_memkit.SimulatedMemoryBudget)")


class SimulatedMemoryBudget(TorchDispatchMode):
    """Raise a CUDA-worded OOM when live tensor bytes would exceed ``limit``."""

    def __init__(self, limit: int, existing: Iterable[torch.Tensor] = ()):
        super().__init__()
        self.limit = int(limit)
        self.live: dict[int, int] = {}
        self.current = 0
        self.peak = 0
        self.ooms = 0
        for t in existing:
            self._track(t, check=False)

    def _free(self, key: int) -> None:
        n = self.live.pop(key, 0)
        self.current -= n

    def _track(self, t: torch.Tensor, *, check: bool) -> None:
        try:
            st = t.untyped_storage()
        except Exception:  # sparse / exotic tensors: not counted
            return
        if st.device.type == "meta":
            return
        key = id(st) if not st.data_ptr() else st.data_ptr()
        if key in self.live:
            return
        n = st.nbytes()
        self.live[key] = n
        self.current += n
        weakref.finalize(st, self._free, key)
        if self.current > self.peak:
            self.peak = self.current
        if check and self.current > self.limit:
            self.ooms += 1
            free = max(0, self.limit - (self.current - n))
            raise torch.OutOfMemoryError(OOM_TEMPLATE.format(
                req=format_bytes(n), cap=format_bytes(self.limit), free=format_bytes(free)))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._track(t, check=True)
        return out
