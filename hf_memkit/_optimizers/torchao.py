"""torchao low-bit AdamW (``optim="adamw_torch_8bit"`` / ``"adamw_torch_4bit"``; transformers
``trainer_optimizer._get_torchao_optimizer`` builds ``torchao.optim.AdamW8bit`` / ``AdamW4bit``
with ``block_size=optim_args.get("block_size", 256)`` for both, so the Trainer's 4-bit block is
256, not the class default 128, and ``bf16_stochastic_round``; no ``amsgrad``).

State (torchao/optim/adam.py ``_AdamBase.step`` / ``_new_buffer``, checked on torchao 0.18):
  * ``step = torch.tensor(0.0)``: a float32 0-d tensor per param (4 B);
  * ``exp_avg`` and ``exp_avg_sq``: when ``numel >= 4096 and numel % block_size == 0`` (the
    bitsandbytes size rule plus divisibility), a quantized tensor subclass, else
    ``torch.zeros_like(p)``: in the *param's* dtype (2 x param bytes, bf16 stays bf16).
      - 8-bit (torchao/optim/subclass_8bit.py ``OptimState8bit.zeros``): ``codes`` uint8 of the
        param's shape (1 B/element), ``scale`` fp32 per block (numel // block_size), and its own
        ``qmap`` (256 fp32 = 1 KiB) per state tensor: qmaps are not shared across params;
      - 4-bit (subclass_4bit.py ``OptimState4bit.zeros``): ``codes`` uint8 of numel // 2 (two
        codes a byte), ``scale`` fp32 per block, and a 16-entry fp32 ``qmap`` (64 B) per state.
Step: ``torch.compile(single_param_adam, fullgraph=True, dynamic=False)`` per param (adam.py
lines 142-156, torchao 0.18), one Inductor graph per param; params step one at a time, so the
transient is the largest over params. A dense-state param's step is fused in place (0 B). For a
quantized one, ``single_param_adam`` (adam.py 190-195) dequantises each moment, lerps it in fp32
and ``copy_``s it back into the subclass, whose ``copy_`` (subclass_4bit.py 155-159,
subclass_8bit.py 137-141) runs ``scale_tensor`` (a per-block absmax, quant_utils.py 64-72) and
``quantize_{8,4}bit_with_qmap`` (quant_utils.py 75-112: a binary search whose
``torch.where(..., 8, 0)`` makes int64 codes, reading the scaled input 5-9 times); 4-bit then
packs ``(codes[::2] << 4) | codes[1::2]`` over numel / 2 elements. What Inductor keeps in memory
(torch 2.13, read from its generated wrapper, ``TORCH_LOGS=output_code``):
  * CPU (measured by RSS with ``MALLOC_MMAP_THRESHOLD_=65536``, steady steps, fp32 or bf16
    params alike, and equal to the wrapper's buffers): 8-bit 8 B/element (the scaled fp32 input
    of each moment); 4-bit 26 B/element (per moment: the scaled fp32 input 4, the int64 codes
    8, and the unpacked uint8 codes 1, which Inductor's ``cat`` lowering realises for an
    extern ``aten.cat`` on CPU only, ``lowering.py`` ``cat``: "uint8 ... fallback" on cpu).
  * CUDA (Triton scheduling; not measured on a GPU here: the wrapper Inductor generates with
    ``cpu_backend="triton"``, which schedules and fuses as for CUDA, and CUDA's pointwise ``cat``
    lowering): the unpacked codes are computed inline; the per-block absmax fuses with its
    pointwise users and both moments' reductions share one kernel (``SIMDScheduling.can_fuse``:
    same numel/rnumel). 4-bit: the packing runs over numel / 2 ("nodes numel
    incompatibility"), so each moment's scaled fp32 input and int64 codes are written out and
    alive together until their packing kernel: 24 B/element, plus the two fp32 per-block
    scales (8 / block_size B/element). 8-bit: the new uint8 codes of each moment are staged
    (the fused kernel still reads the old ones) and copied back: 2 B/element plus the scales.
Note: a ``block_size`` given in ``optim_args`` reaches torchao as a string (transformers does not
convert it) and the first step fails; it is read here as the integer it was meant to be.

Availability: transformers (``trainer_optimizer._get_torchao_optimizer``) raises unless
``is_torchao_available()``, i.e. torchao >= ``transformers.utils.import_utils.TORCHAO_MIN_VERSION``
(0.15.0 in transformers 5.23); it asks for no CUDA. ``torchao_usable`` checks the same without
importing torchao (its import prints notices under torch 2.13).

The planner's 8-bit rung where bitsandbytes is absent (``stands_in_for="adamw_bnb_8bit"``: never
both). Devices: torchao's optim README says the optimizers are tested on CPU and CUDA only ("there
might be bugs or errors on other platforms"); the step is ``torch.compile``d (a C++ compiler on
CPU, Triton on CUDA), nothing in ``_AdamBase.step`` is device-specific. So ``plan_on`` is CUDA and
CPU, not MPS. ``step_cost`` (bytes moved per param, fp32 params, vs fused AdamW's 28 B): the
compiled ``single_param_adam`` reads p, g (4 + 4) and the two code tensors (1 + 1), writes the two
fp32 moments that the blockwise absmax needs whole before quantising (8 B; the 8 B/element step
transient measured above) and reads them back (8), then writes p and the codes (4 + 2): 32 B,
1.14 x fused AdamW, plus an 8-step binary search over the qmap per moment element (the
arithmetic bitsandbytes' fully fused kernel also does, for 16 B, and its entry prices at 1.2) and
one compiled call per param tensor instead of a multi-tensor launch: 1.3, just above
bitsandbytes' 1.2 (not timed on a GPU here).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from packaging.version import InvalidVersion, Version

from .base import STEP_TENSOR, OptimizerMemory, OptimizerProfile, register

if TYPE_CHECKING:
    from .base import OptimizerContext, ParamInfo

MIN_QUANT_NUMEL = 4096
DEFAULT_BLOCK = 256          # transformers' default for both 8-bit and 4-bit
# bits -> (code bytes per element, qmap entries, step bytes per element of a quantized param on
# CPU and on CUDA); CUDA adds the two fp32 per-block scales (module docstring)
_LAYOUT = {8: (1.0, 256, 8, 2), 4: (0.5, 16, 26, 24)}


def torchao_usable() -> bool:
    """torchao importable and as new as the installed transformers requires, found without
    importing it (its metadata only)."""
    if importlib.util.find_spec("torchao") is None:
        return False
    try:
        from transformers.utils.import_utils import TORCHAO_MIN_VERSION as minimum
    except ImportError:  # a transformers without the constant: 5.23's value
        minimum = "0.15.0"
    try:
        return Version(importlib.metadata.version("torchao")) >= Version(minimum)
    except (importlib.metadata.PackageNotFoundError, InvalidVersion):
        return False


def quantized(p: ParamInfo, block: int) -> bool:
    return p.numel >= MIN_QUANT_NUMEL and p.numel % block == 0


def _low_bit(bits: int) -> Callable[[Sequence[ParamInfo], OptimizerContext], OptimizerMemory]:
    code_bytes, qmap, cpu_step, cuda_step = _LAYOUT[bits]

    def estimate(params: Sequence[ParamInfo], ctx: OptimizerContext) -> OptimizerMemory:
        block = int(ctx.optim_args.get("block_size", DEFAULT_BLOCK))
        state = transient = 0
        for p in params:
            if quantized(p, block):
                per_moment = int(p.numel * code_bytes) + 4 * (p.numel // block) + 4 * qmap
                step = cuda_step * p.numel + 2 * 4 * (p.numel // block) \
                    if ctx.device_kind == "cuda" else cpu_step * p.numel
                transient = max(transient, step)
            else:
                per_moment = p.nbytes
            state += 2 * per_moment + STEP_TENSOR
        return OptimizerMemory(state, transient)

    return estimate


# the 8-bit one is planned (see the module docstring); the 4-bit one only when pinned
_PLANNED = {8: dict(step_cost=1.3, plan_on=("cuda", "cpu"), stands_in_for="adamw_bnb_8bit"),
            4: {}}
for _bits in (8, 4):
    register(OptimizerProfile(
        f"adamw_torch_{_bits}bit", _low_bit(_bits),
        f"torchao/optim/adam.py _AdamBase._new_buffer + subclass_{_bits}bit.py zeros",
        "torchao", accelerate_class=f"torchao.optim.AdamW{_bits}bit",
        accelerate_kwargs={"block_size": DEFAULT_BLOCK, "bf16_stochastic_round": False},
        requires=torchao_usable, **_PLANNED[_bits]))
