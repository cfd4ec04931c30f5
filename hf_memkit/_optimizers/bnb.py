"""bitsandbytes 8-bit blockwise optimizers (bitsandbytes/optim/optimizer.py Optimizer2State /
Optimizer1State.init_state).

  * numel < min_8bit_size (4096): state kept in fp32 (4 B per state per element);
  * else uint8 state (1 B) + fp32 absmax per 256-element block, per state;
  * qmap tables (256 fp32 each) are shared across parameters.
  * The Trainer registers every nn.Embedding weight for 32-bit state (transformers/trainer.py
    create_optimizer: GlobalOptimManager.register_module_override(module, "weight",
    {"optim_bits": 32})), and the measured CPU runs confirm it.
  * Paged variants (``is_paged``; the Trainer's ``paged_*`` optims): only the param-sized state
    buffers can be paged. ``Optimizer8bit.get_state_buffer`` returns ``torch.zeros_like`` for a
    CPU param or one of ``numel < 1e5``, else ``F.get_paged`` (functional.py: ``cget_managed_ptr``,
    i.e. ``cudaMallocManaged(..., cudaMemAttachHost)`` in csrc/pythonInterface.cpp); it is called
    for ``state1``/``state2`` only (AdEMAMix: ``_get_state_double_buffer`` for its (2, ...)
    ``state1``, same rule). ``absmax1``/``absmax2``, ``unorm_vec`` and the qmaps are
    ``torch.zeros(..., device=p.device)`` in ``init_state``: ordinary caching-allocator memory.
    Managed pages are not the caching allocator's: the driver migrates them to the host when
    device memory runs short (cudaMalloc's physical allocator evicts them: nvidia-uvm registers
    its eviction callbacks with it, ``pmaRegisterEvictionCb`` in NVIDIA's open-gpu-kernel-modules;
    the QLoRA paper's "paged optimizers"), so they sit outside what must fit (``paged``). What
    the step needs at once: ``Optimizer8bit.step`` runs ``prefetch_state(p)`` (functional.py
    ``prefetch_tensor`` of ``state1`` and ``state2``: ``cudaMemPrefetchAsync`` to the device),
    then ``update_step``, then ``sync_gpu(p)``, param by param, so the pages of one param's
    state must be on the device together: the largest paged param's buffers
    (``paged_resident``). Unpressed, pages stay where they were last used: NVML then shows all
    of ``paged`` as used.
  * On CUDA the update kernels work in place; on CPU bnb's torch fallback dequantises the two
    states of the parameter being updated to fp32 (measured: ~3 fp32 copies of the largest
    param).
  * AdEMAMix (bitsandbytes/optim/ademamix.py AdEMAMix.init_state) overrides Optimizer2State's
    layout: ``state1`` is a (2, *p.shape) buffer holding m1 and m2 and ``state2`` is nu, so 3
    param-sized slots (fp32, or uint8 + ``absmax1`` (2, blocks) + ``absmax2`` (blocks)), the same
    min_8bit_size rule and embedding override, the two shared qmaps, and paging of both buffers
    at >= 1e5 elements (``_get_state_double_buffer``). Its CPU step (bitsandbytes/backends/cpu/
    ops.py) is measured per element of the largest param: 8-bit 37 B (9 fp32 copies: the two
    dequantised m's and their ``torch.stack``, nu, the scaled grad, then 3 expression temporaries
    or the update and the re-stack; plus the uint8 ``quantize_blockwise`` output), 32-bit 16 B (the scaled grad + 3 temporaries of
    ``(m1/c1 + alpha*m2) / (sqrt(nu)/c2 + eps)``); +4 B when the param is not fp32 (its fp32 copy).
  * RMSprop (bitsandbytes/optim/rmsprop.py): Optimizer1State, one state like Lion; the Trainer
    passes no ``is_paged`` for it.
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


def _bnb(slots: int, bits: int, paged: bool, *, qmaps: int | None = None,
         cpu_bytes: tuple[int, int] | None = None,
         ) -> Callable[[Sequence[ParamInfo], OptimizerContext], OptimizerMemory]:
    """``slots``: param-sized state buffers (each with its absmax blocks when 8-bit); ``qmaps``:
    shared 256-entry fp32 tables (default one per slot); ``cpu_bytes``: measured CPU step bytes per
    element of a param on its (8-bit, 32-bit) path; params step one at a time, so the transient
    is the largest over params (None: the AdamW/Lion rule below)."""
    n_qmaps = slots if qmaps is None else qmaps

    def estimate(params: Sequence[ParamInfo], ctx: OptimizerContext) -> OptimizerMemory:
        resident = paged_bytes = at_once = transient = 0
        for p in params:
            eight = bits == 8 and p.numel >= MIN_8BIT_SIZE and not p.embedding
            # get_state_buffer's buffers (pageable) and the fp32 absmax blocks (never paged)
            buffers = slots * p.numel if eight else slots * 4 * p.numel
            absmax = slots * 4 * -(-p.numel // BNB_BLOCK) if eight else 0
            resident += absmax
            if paged and ctx.device_kind == "cuda" and p.numel >= PAGED_MIN_NUMEL:
                paged_bytes += buffers
                at_once = max(at_once, buffers)  # prefetch_state(p): this param's pages
            else:
                resident += buffers
            if cpu_bytes is not None and ctx.device_kind != "cuda":
                per = cpu_bytes[0 if eight else 1] + (4 if p.itemsize != 4 else 0)
                transient = max(transient, per * p.numel)
        if bits == 8:
            resident += n_qmaps * 256 * 4  # shared qmaps
        if ctx.device_kind == "cuda":
            transient = 0
        elif cpu_bytes is None:  # torch fallback: fp32 dequantised copies of the states + update
            largest = max((p.numel for p in params), default=0)
            transient = (slots + 1) * 4 * largest if bits == 8 else 4 * largest
        return OptimizerMemory(resident, transient, paged_bytes, at_once)

    return estimate


_SRC = "bitsandbytes/optim/optimizer.py Optimizer{1,2}State.init_state"


def _entry(name: str, states: int, bits: int, paged: bool, cls: str, *,
           qmaps: int | None = None, cpu_bytes: tuple[int, int] | None = None,
           src: str = _SRC, **kw) -> OptimizerProfile:
    return OptimizerProfile(name, _bnb(states, bits, paged, qmaps=qmaps, cpu_bytes=cpu_bytes),
                            src, "bitsandbytes", accelerate_class=f"bitsandbytes.optim.{cls}",
                            **kw)


register(_entry("adamw_bnb_8bit", 2, 8, False, "AdamW8bit", step_cost=1.2, plan_on=ALL_DEVICES),
         "adamw_8bit")
register(_entry("paged_adamw_8bit", 2, 8, True, "PagedAdamW8bit", step_cost=1.5,
                plan_on=("cuda",)))
register(_entry("paged_adamw_32bit", 2, 32, True, "PagedAdamW32bit"))
register(_entry("lion_8bit", 1, 8, False, "Lion8bit"))
register(_entry("lion_32bit", 1, 32, False, "Lion32bit"))
register(_entry("paged_lion_8bit", 1, 8, True, "PagedLion8bit"))
register(_entry("paged_lion_32bit", 1, 32, True, "PagedLion32bit"))
register(_entry("rmsprop_bnb", 1, 32, False, "RMSprop"))
register(_entry("rmsprop_bnb_32bit", 1, 32, False, "RMSprop32bit"))
register(_entry("rmsprop_bnb_8bit", 1, 8, False, "RMSprop8bit"))

# AdEMAMix: 3 slots (m1, m2 stacked in state1; nu), 2 qmaps; transformers/trainer_optimizer.py
# _get_bitsandbytes_optimizer builds bitsandbytes.optim.AdEMAMix(optim_bits=8|32, is_paged=...).
_ADEMAMIX = dict(qmaps=2, cpu_bytes=(37, 16),
                 src="bitsandbytes/optim/ademamix.py AdEMAMix.init_state")
register(_entry("ademamix", 3, 32, False, "AdEMAMix", **_ADEMAMIX))
register(_entry("ademamix_8bit", 3, 8, False, "AdEMAMix8bit", **_ADEMAMIX))
register(_entry("paged_ademamix_32bit", 3, 32, True, "PagedAdEMAMix", **_ADEMAMIX))
register(_entry("paged_ademamix_8bit", 3, 8, True, "PagedAdEMAMix8bit", **_ADEMAMIX))
