"""Adafactor (transformers/optimization.py Adafactor; the Trainer sets scale_parameter=False,
relative_step=False, beta1=None): no first moment. For >= 2-D params the second moment is
factored: exp_avg_sq_row (rows) + exp_avg_sq_col (cols), fp32; 1-D params keep a full fp32
exp_avg_sq. step() works per parameter on fp32 copies: `grad.float()` (when not fp32),
`update = grad**2 + eps`, the rsqrt outer product, and the update itself: ~3 fp32 copies of
the parameter being updated at once.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from .base import ALL_DEVICES, OptimizerMemory, OptimizerProfile, register

if TYPE_CHECKING:
    from .base import OptimizerContext, ParamInfo


def _adafactor(params: Sequence[ParamInfo], ctx: OptimizerContext) -> OptimizerMemory:
    state = 0
    for p in params:
        if len(p.shape) >= 2:
            # exp_avg_sq_row: shape[:-1]; exp_avg_sq_col: shape[:-2] + shape[-1:]
            rows = math.prod(p.shape[:-1])
            cols = math.prod(p.shape[:-2]) * p.shape[-1]
            state += 4 * (rows + cols)
        else:
            state += 4 * p.numel
        state += 4  # RMS scalar kept in state
    largest = max((p.numel for p in params), default=0)
    return OptimizerMemory(state, 3 * 4 * largest)


register(OptimizerProfile("adafactor", _adafactor, "transformers/optimization.py Adafactor.step",
                          step_cost=2.0, accelerate_class="transformers.Adafactor",
                          accelerate_kwargs={"scale_parameter": False, "relative_step": False},
                          plan_on=ALL_DEVICES))
