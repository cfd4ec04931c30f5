"""Adagrad (torch/optim/adagrad.py): state "sum" (param dtype) + step; `std =
state_sum.sqrt().add_(eps)` is one param-sized temporary (foreach: the whole group)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from .base import OptimizerMemory, OptimizerProfile, foreach, largest, per_tensor_state, register

if TYPE_CHECKING:
    from .base import OptimizerContext, ParamInfo


def _adagrad(params: Sequence[ParamInfo], ctx: OptimizerContext) -> OptimizerMemory:
    transient = sum(p.nbytes for p in params) if foreach(ctx) else largest(params)
    return OptimizerMemory(per_tensor_state(params, 1), transient)


register(OptimizerProfile("adagrad", _adagrad, "torch/optim/adagrad.py",
                          accelerate_class="torch.optim.Adagrad", shardable=True))
