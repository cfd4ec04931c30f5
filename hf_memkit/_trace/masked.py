"""Boolean-mask selections of a known size on fake tensors.

``x[mask]`` with a boolean ``mask`` has as many rows as ``mask`` has True entries: a
data-dependent size, which ``FakeTensorMode`` refuses (``DynamicOutputShapeException``). Where
the trace knows how many entries are True (TRL's fused head on CUDA selects the labelled
positions, ``_trainers.fused_head``), ``MaskedSelect`` answers the selection with a fresh tensor
of that many rows, and the backward's scatter (``index_put`` with the same mask) with the
tensor it writes into: the allocations are the real ones, only the values are not. It touches
``torch.utils._python_dispatch`` (a dispatch mode below autograd, so the selection keeps its
gradient edge).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
_SCATTER = (aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default)


def _bool_index(indices: Any) -> torch.Tensor | None:
    """The boolean mask of ``x[mask]`` (one boolean index, nothing else), else None."""
    if len(indices) == 1 and indices[0] is not None and indices[0].dtype == torch.bool:
        return indices[0]
    return None


class MaskedSelect(TorchDispatchMode):
    """While active, ``x[mask]`` for a boolean ``mask`` returns ``count(mask.shape)`` rows, and
    ``index_put`` through such a mask writes nothing it would not allocate (out of place: a
    copy of its target, as the real op returns; in place: the target)."""

    def __init__(self, count: Callable[[tuple[int, ...]], int]) -> None:
        super().__init__()
        self.count = count

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is aten.index.Tensor:
            x, indices = args
            mask = _bool_index(indices)
            if mask is not None:
                rows = self.count(tuple(mask.shape))
                return x.new_empty((rows, *x.shape[mask.dim():]))
        elif func in _SCATTER and any(i is not None and i.dtype == torch.bool for i in args[1]):
            return args[0].clone() if func is aten.index_put.default else args[0]
        return func(*args, **kwargs)
