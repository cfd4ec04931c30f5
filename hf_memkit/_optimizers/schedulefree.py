"""Schedule-Free AdamW / RAdam / SGD (package ``schedulefree``; transformers
``trainer_optimizer._get_schedule_free_optimizer`` builds ``AdamWScheduleFree``,
``RAdamScheduleFree`` and ``SGDScheduleFree`` and never passes ``foreach``, so the classes'
default ``foreach=hasattr(torch, "_foreach_mul_")``, i.e. True, holds on every device, CPU too).

State (schedulefree/{adamw,radam,sgd}_schedulefree.py ``step``: made for params with a grad, in
``optimizer.state``; the step count ``k`` is a Python int in the param group, no step tensor):
  * AdamW, RAdam: ``z = torch.clone(p)`` + ``exp_avg_sq = torch.zeros_like(p)``: 2 x param bytes.
    There is no first moment: the parameter holds the interpolated point y, the state holds z,
    and the average x is never stored;
  * SGD: ``z`` only: 1 x param bytes.
  ``train()`` / ``eval()`` (the Trainer calls them when training starts and at each evaluation)
  swap the parameter between y and x with ``p.lerp_(end=state['z'], ...)``, in place: no memory.
Transients (the foreach path):
  * AdamW, RAdam: ``denom = torch._foreach_div(exp_avg_sq, bias_correction2)`` is a copy of the
    group's exp_avg_sq (sqrt_/add_/div_ then work in place). ``denom`` is a local of the loop over
    param groups, so the previous group's copy is still bound while the next is built: max over
    consecutive groups of (previous + current), i.e. every trainable parameter with the Trainer's
    decay / no-decay groups. RAdam skips it while ``rho_t <= 4`` (its first 4 steps with
    beta2=0.999); the steady state has it.
  * SGD: in-place foreach ops only: none.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from .base import OptimizerMemory, OptimizerProfile, register, trainer_groups

if TYPE_CHECKING:
    from .base import OptimizerContext, ParamInfo


def _state(params: Sequence[ParamInfo], copies: int) -> int:
    return sum(copies * p.nbytes for p in params)


def _adam_like(params: Sequence[ParamInfo], ctx: OptimizerContext) -> OptimizerMemory:
    sizes = [sum(p.nbytes for p in g) for g in trainer_groups(params)]
    denom = max((sizes[i - 1] * (i > 0) + sizes[i] for i in range(len(sizes))), default=0)
    return OptimizerMemory(_state(params, 2), denom)


def _sgd(params: Sequence[ParamInfo], ctx: OptimizerContext) -> OptimizerMemory:
    return OptimizerMemory(_state(params, 1), 0)


def _entry(name: str, estimate, cls: str) -> OptimizerProfile:
    return OptimizerProfile(name, estimate, f"schedulefree/{cls} step (foreach path)",
                            "schedulefree", accelerate_class=f"schedulefree.{cls}")


register(_entry("schedule_free_adamw", _adam_like, "AdamWScheduleFree"))
register(_entry("schedule_free_radam", _adam_like, "RAdamScheduleFree"))
register(_entry("schedule_free_sgd", _sgd, "SGDScheduleFree"))
