"""APOLLO (package ``apollo-torch`` 1.0.3; transformers ``trainer_optimizer._get_apollo_optimizer``
builds ``apollo_torch.APOLLOAdamW`` (apollo_torch/apollo.py ``AdamW``) through the same
``_setup_low_rank_optimizer`` as GaLore: the ``nn.Linear`` weights matched by
``optim_target_modules`` form the second group with ``rank`` (128), ``proj`` ("random"),
``scale_type`` ("channel"), ``update_proj_gap`` (200), ``scale`` (1.0), ``proj_type`` ("std") from
``optim_args``; every other param is plain AdamW in the first group).

State (``AdamW.__init__`` / ``step``; ``step`` and ``seed`` are Python ints):
  * non-targets: ``exp_avg``, ``exp_avg_sq`` = ``zeros_like(grad)``: 2 x param bytes;
  * targets: ``exp_avg``, ``exp_avg_sq`` of the low-rank grad ((m, rank) when m >= n with
    ``proj_type="std"``, else (rank, n)), in the param's dtype; the projector's matrix
    (apollo_torch/random_projector.py ``GradientProjector.get_orthogonal_matrix``:
    ``stable_randn((rank, n))`` or ``((m, rank))``, *not* clipped to min(m, n), in the param's
    dtype), and ``state["scaled_grad"]``, the 0-d norm of the scaled grad (param dtype).
    ``proj="svd"`` uses a GaLore projector (apollo_torch/svd_projector.py, the same layout as
    galore.py's ``projection``).
Step transients (``Frame``, steady state; the projection matrix is redrawn every
``update_proj_gap`` steps): per target the low-rank grad, ``denom`` and ``norm_grad``, then
``scaled_grad = p.grad * grad_scaling_factor`` (a full param-sized copy) and, from the second
step on, ``scaled_grad / limiter`` (another) while the previous target's ``scaled_grad`` is
still bound until it is replaced.
``apollo_adamw_layerwise`` is refused (lomo.py says why).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from .base import OptimizerMemory, OptimizerProfile, register
from .galore import Frame, projection, split_targets

if TYPE_CHECKING:
    from .base import OptimizerContext, ParamInfo


def _apollo(params: Sequence[ParamInfo], ctx: OptimizerContext) -> OptimizerMemory:
    non, tgt = split_targets(params, ctx, "apollo_adamw")
    svd = ctx.optim_args.get("proj", "random") == "svd"
    frame = Frame()
    state = 0
    for p in non:
        frame.alias("grad", None)                           # grad = p.grad
        frame.new("denom", p.nbytes)
        frame.new("norm_grad", p.nbytes)
        state += 2 * p.nbytes
    for p in tgt:
        frame.alias("grad", None)
        low, proj = projection(p, ctx, svd=svd)
        lr = math.prod(low) * p.itemsize
        frame.new("grad", lr)                               # projector.project(grad)
        frame.new("denom", lr)
        frame.new("norm_grad", lr)
        frame.new("scaled_grad", p.nbytes)                  # p.grad * grad_scaling_factor
        frame.new("scaled_grad", p.nbytes)                  # scaled_grad / limiter
        frame.alias("norm_grad", "scaled_grad")             # norm_grad = scaled_grad
        state += 2 * lr + proj + p.itemsize                 # + state["scaled_grad"]
    return OptimizerMemory(state, frame.peak)


register(OptimizerProfile("apollo_adamw", _apollo,
                          "apollo_torch/apollo.py AdamW.step + random_projector.py",
                          "apollo_torch", accelerate_class="apollo_torch.APOLLOAdamW"))
