"""torch.optim AdamW (torch/optim/adamw.py -> adam.py).

State: exp_avg + exp_avg_sq, zeros_like(param): 2 x param bytes (8 B/param in fp32) + step.
  * single-tensor (CPU): `denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)` holds
    the sqrt() result and the quotient together while the previous parameter's `denom` is still
    bound: max over consecutive params of one group of (previous + 2 x current).
  * foreach (CUDA): `exp_avg_sq_sqrt = torch._foreach_sqrt(device_exp_avg_sqs)` materialises a
    copy of the whole param group (the decay group holds almost every parameter).
  * fused: `torch._fused_adamw_` updates in place, no temporaries.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from .base import (
    ALL_DEVICES,
    OptimizerMemory,
    OptimizerProfile,
    foreach,
    per_tensor_state,
    register,
    trainer_groups,
)

if TYPE_CHECKING:
    from .base import OptimizerContext, ParamInfo


def _adamw_torch(params: Sequence[ParamInfo], ctx: OptimizerContext) -> OptimizerMemory:
    state = per_tensor_state(params, 2)
    groups = trainer_groups(params)
    if foreach(ctx):
        transient = max((sum(p.nbytes for p in g) for g in groups), default=0)
    else:
        transient = max((g[i - 1].nbytes * (i > 0) + 2 * g[i].nbytes
                         for g in groups for i in range(len(g))), default=0)
    return OptimizerMemory(state, transient)


def _adamw_fused(params: Sequence[ParamInfo], ctx: OptimizerContext) -> OptimizerMemory:
    return OptimizerMemory(per_tensor_state(params, 2), 0)


register(OptimizerProfile("adamw_torch", _adamw_torch,
                          "torch/optim/adam.py _single/_multi_tensor_adam", step_cost=1.6,
                          accelerate_class="torch.optim.AdamW", shardable=True))
register(OptimizerProfile("adamw_torch_fused", _adamw_fused, "torch/optim/adam.py _fused_adam",
                          step_cost=1.0, accelerate_class="torch.optim.AdamW",
                          accelerate_kwargs={"fused": True}, plan_on=ALL_DEVICES, shardable=True))
