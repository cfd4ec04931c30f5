"""SGD (torch/optim/sgd.py): momentum_buffer (param dtype) only when momentum != 0 (the Trainer
passes optim_args "momentum=0.9"); no temporaries beyond one param-sized buffer on first step.
"""

from __future__ import annotations

from collections.abc import Sequence

from .base import OptimizerContext, OptimizerMemory, OptimizerProfile, ParamInfo, register


def _sgd(params: Sequence[ParamInfo], ctx: OptimizerContext) -> OptimizerMemory:
    momentum = float(ctx.optim_args.get("momentum", 0) or 0)
    if momentum == 0:
        return OptimizerMemory(0, 0)
    # first step: `buf = torch.clone(grad).detach()` becomes the state; no extra transient
    return OptimizerMemory(sum(p.nbytes for p in params), 0)


register(OptimizerProfile("sgd", _sgd, "torch/optim/sgd.py _single_tensor_sgd", step_cost=0.5,
                          accelerate_class="torch.optim.SGD", shardable=True))
