"""GrokAdamW (package ``grokadamw``, ``grokadamw/grokadamw.py``; transformers
``trainer_optimizer._get_grokadamw``).

State: ``GrokAdamW._update_group`` keeps ``exp_avg``, ``exp_avg_sq`` and the extra gradient EMA
``grok_ema`` per param, each ``torch.zeros_like(p, device='cpu')``, and ``step`` as a Python
int. They live in ``param_group['state']``, not in ``optimizer.state``, and always on the CPU:
3 x param bytes of host memory.
  * CPU params: ``.to(p.device)`` / ``.to('cpu')`` return the same tensors, so the 3 x param bytes
    are the device's own state. Per param, ``grok_grad = grad + lamb * grok_ema`` builds two
    param-sized tensors while the previous param's ``grok_grad`` is still bound, and
    ``exp_avg_sq.sqrt()`` one more: max over consecutive params of a group of
    (previous + 2 x current).
  * CUDA / MPS params: nothing stays on the device between steps; each param's three states are
    copied in (``.to(p.device)``) and back (``.to('cpu')``), the device copies staying bound
    until the next param replaces them. Device peak per param: the previous param's three
    copies and ``grok_grad`` while the next two are made (4 x previous + 2 x current), or the
    previous ``grok_grad`` + three copies + ``lamb * grok_ema`` + the new ``grok_grad``
    (previous + 5 x current); ``exp_avg_sq.sqrt()`` is 5 x current. The host then holds the
    3 x param bytes, which this device-side estimate does not count.
``_update_group`` is called once per param group, so nothing carries over between groups.
``clip_grad_norm_(p)`` per param makes scalars only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from .base import OptimizerMemory, OptimizerProfile, register, trainer_groups

if TYPE_CHECKING:
    from .base import OptimizerContext, ParamInfo


def _grokadamw(params: Sequence[ParamInfo], ctx: OptimizerContext) -> OptimizerMemory:
    on_host = ctx.device_kind == "cpu"
    peak = 0
    for g in trainer_groups(params):
        prev = 0
        for p in g:
            cur = p.nbytes
            peak = max(peak, prev + 2 * cur if on_host else max(4 * prev + 2 * cur,
                                                                prev + 5 * cur))
            prev = cur
    state = sum(3 * p.nbytes for p in params) if on_host else 0
    return OptimizerMemory(state, peak)


register(OptimizerProfile("grokadamw", _grokadamw, "grokadamw/grokadamw.py _update_group",
                          "grokadamw", accelerate_class="grokadamw.GrokAdamW"))
