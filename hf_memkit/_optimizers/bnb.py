"""bitsandbytes 8-bit blockwise optimizers (bitsandbytes/optim/optimizer.py Optimizer2State /
Optimizer1State.init_state).

  * numel < min_8bit_size (4096): state kept in fp32 (4 B per state per element);
  * else uint8 state (1 B) + fp32 absmax per 256-element block, per state;
  * qmap tables (256 fp32 each) are shared across parameters.
  * The Trainer registers every nn.Embedding weight for 32-bit state (transformers/trainer.py
    create_optimizer: GlobalOptimManager.register_module_override(module, "weight",
    {"optim_bits": 32})), and the measured CPU runs confirm it.
  * Paged variants (get_state_buffer): on CUDA, buffers of >= 1e5 elements go to managed memory.
  * On CUDA the update kernels work in place; on CPU bnb's torch fallback dequantises the two
    states of the parameter being updated to fp32 (measured: ~3 fp32 copies of the largest
    param).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from .base import ALL_DEVICES, OptimizerMemory, OptimizerProfile, register

if TYPE_CHECKING:
    from .base import OptimizerContext, ParamInfo

MIN_8BIT_SIZE = 4096
BNB_BLOCK = 256
PAGED_MIN_NUMEL = 100_000


def _bnb(states: int, bits: int, paged: bool) -> Callable[[Sequence[ParamInfo], OptimizerContext],
                                                         OptimizerMemory]:
    def estimate(params: Sequence[ParamInfo], ctx: OptimizerContext) -> OptimizerMemory:
        resident = paged_bytes = 0
        for p in params:
            if bits == 32 or p.numel < MIN_8BIT_SIZE or p.embedding:
                b = states * 4 * p.numel
            else:
                blocks = -(-p.numel // BNB_BLOCK)
                b = states * (p.numel + 4 * blocks)
            if paged and ctx.device_kind == "cuda" and p.numel >= PAGED_MIN_NUMEL:
                paged_bytes += b
            else:
                resident += b
        if bits == 8:
            resident += states * 256 * 4  # shared qmaps
        if ctx.device_kind == "cuda":
            transient = 0
        else:  # torch fallback: fp32 dequantised copies of the states of one parameter + update
            largest = max((p.numel for p in params), default=0)
            transient = (states + 1) * 4 * largest if bits == 8 else 4 * largest
        return OptimizerMemory(resident, transient, paged_bytes)

    return estimate


_SRC = "bitsandbytes/optim/optimizer.py Optimizer{1,2}State.init_state"


def _entry(name: str, states: int, bits: int, paged: bool, cls: str, **kw) -> OptimizerProfile:
    return OptimizerProfile(name, _bnb(states, bits, paged), _SRC, "bitsandbytes",
                            accelerate_class=f"bitsandbytes.optim.{cls}", **kw)


register(_entry("adamw_bnb_8bit", 2, 8, False, "AdamW8bit", step_cost=1.2, plan_on=ALL_DEVICES),
         "adamw_8bit")
register(_entry("paged_adamw_8bit", 2, 8, True, "PagedAdamW8bit", step_cost=1.5,
                plan_on=("cuda",)))
register(_entry("paged_adamw_32bit", 2, 32, True, "PagedAdamW32bit"))
register(_entry("lion_8bit", 1, 8, False, "Lion8bit"))
register(_entry("lion_32bit", 1, 32, False, "Lion32bit"))
register(_entry("paged_lion_8bit", 1, 8, True, "PagedLion8bit"))
register(_entry("paged_lion_32bit", 1, 32, True, "PagedLion32bit"))
