"""RMSprop (torch/optim/rmsprop.py): square_avg (+ momentum_buffer, + grad_avg if centered);
`avg = square_avg.sqrt().add_(eps)` is one param-sized temporary (foreach: the whole group)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from .base import OptimizerMemory, OptimizerProfile, foreach, largest, per_tensor_state, register

if TYPE_CHECKING:
    from .base import OptimizerContext, ParamInfo


def _rmsprop(params: Sequence[ParamInfo], ctx: OptimizerContext) -> OptimizerMemory:
    copies = 1 + (float(ctx.optim_args.get("momentum", 0) or 0) != 0) + (
        str(ctx.optim_args.get("centered", "false")).lower() in ("true", "1"))
    transient = sum(p.nbytes for p in params) if foreach(ctx) else largest(params)
    return OptimizerMemory(per_tensor_state(params, copies), transient)


register(OptimizerProfile("rmsprop", _rmsprop, "torch/optim/rmsprop.py",
                          accelerate_class="torch.optim.RMSprop", shardable=True))
