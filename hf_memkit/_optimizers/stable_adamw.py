"""StableAdamW from torch-optimi (``optimi/stableadamw.py``; transformers
``trainer_optimizer._get_stable_adamw`` passes ``kahan_sum`` and never ``foreach`` / ``triton``).

State (``StableAdamW._init_state``, per param with a grad, in ``optimizer.state``):
  * ``exp_avg``, ``exp_avg_sq``: ``zeros_like(param)``: 2 x param bytes (param dtype);
  * ``eps_sq``: a 0-d tensor of the param dtype (itemsize bytes);
  * ``kahan_comp``: ``zeros_like(param)`` for a float16/bfloat16 param when ``kahan_sum`` is None
    (auto) or true. transformers turns the ``kahan_sum`` optim_arg into ``bool(str)``, so any
    non-empty value, ``kahan_sum=False`` included, means on. Otherwise ``None`` on the torch
    path, a 1-byte uint8 placeholder on the Triton path;
  * Triton path only: ``mean_square``, one float32 (4 bytes).
  The step counter ``group["step"]`` is one int32 tensor per param group on the CPU (not counted).
Path: ``foreach`` stays None, and ``_default_to_triton`` picks Triton when every param is a CUDA
tensor (torch's CUDA wheels ship Triton): two kernels per param, no temporaries. On CPU (and MPS)
the single-tensor loop ``_single_param_stableadamw`` runs once per param, its locals dying at
return: ``grad.pow(2)`` and ``exp_avg_sq.maximum(eps_sq)`` are alive together (2 x the param),
then ``.mean()`` of the squared ratio: for a 16-bit param torch's CPU reduction accumulates in a
float32 copy made inside the kernel (4 bytes/element beside the 2-byte ratio: 3 x the param;
measured with VmHWM, invisible to MemTracker), then ``exp_avg_sq.sqrt()`` (1 x). The Kahan
branch reuses the grad buffer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from .base import OptimizerMemory, OptimizerProfile, register

if TYPE_CHECKING:
    from .base import OptimizerContext, ParamInfo


def _stable_adamw(params: Sequence[ParamInfo], ctx: OptimizerContext) -> OptimizerMemory:
    kahan = "kahan_sum" not in ctx.optim_args or bool(ctx.optim_args["kahan_sum"])
    triton = ctx.device_kind == "cuda"
    state = 0
    for p in params:
        state += 2 * p.nbytes + p.itemsize               # exp_avg, exp_avg_sq, eps_sq
        if kahan and p.itemsize == 2:                    # float16 / bfloat16 param
            state += p.nbytes                            # kahan_comp
        elif triton:
            state += 1                                   # uint8 kahan_comp placeholder
        state += 4 * triton                              # mean_square
    if triton:
        return OptimizerMemory(state, 0)
    rms = max((p.nbytes + max(p.nbytes, 4 * p.numel * (p.itemsize < 4)) for p in params),
              default=0)
    return OptimizerMemory(state, rms)


register(OptimizerProfile("stable_adamw", _stable_adamw,
                          "optimi/stableadamw.py _init_state, _single_param_stableadamw, "
                          "_triton_stableadamw", "torch-optimi",
                          accelerate_class="optimi.StableAdamW"))
