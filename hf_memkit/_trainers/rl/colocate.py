"""A colocated vLLM engine beside GRPO / RLOO on the training GPU (``use_vllm=True``,
``vllm_mode="colocate"``): its bytes in the estimate (``tenant``, ``GRPO.tenant``) and how the
planner plans around it (``plan_beside_vllm``, ``GRPO.plan_around``). The engine's own memory
follows vLLM's rules in ``vllm``.

**The estimate.** vLLM is built in the trainer's ``__init__``, when the device holds the context,
the policy and a reference model (the optimizer state comes later): its start-up rule is judged
against what that leaves. While the trainer scores and trains, vLLM holds what stays resident
(weights, KV cache, graphs; with sleep mode only its graphs); while it generates (its activations
on top), the trainer holds only its weights, optimizer state and a reference.

**The plan.** vLLM takes ``vllm_gpu_memory_utilization`` of the GPU. Unless that is pinned, the
plan gives vLLM the smallest share (in steps of 0.05) whose KV cache holds the generation's
demand: ``max_num_seqs`` (the per-rank batch, = per-device batch x ``steps_per_generation`` with
``steps_per_generation`` the accumulation, x vLLM's tensor parallelism) sequences of prompt +
``max_completion_length`` tokens. Then the trainer is planned in the rest; when no setup fits
beside an awake engine and sleep mode is not pinned, the plan turns ``vllm_enable_sleep_mode``
on (vLLM releases its weights and KV cache while the trainer scores and trains) and says so;
when even that does not fit, the error says to run vLLM in server mode on other GPUs.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

from ..._errors import ConfigError, HfMemkitError
from ..._units import format_bytes
from ..base import Tenant
from .rollout import steps_of
from .vllm import VllmMemory, VllmSettings, colocated_vllm

SHARE_STEP = 0.05
# bytes a parameter of the policy takes when vLLM starts, by the lightest method the plan may use
START_BYTES = {"qlora": 0.5, "fsdp-qlora": 0.5, "lora-8bit": 1.0}


def colocates(options: Any, device_kind: str) -> bool:
    """Whether a GRPO / RLOO config (``options``: its fields, a mapping) runs vLLM colocated on
    a CUDA GPU."""
    return bool(options.get("use_vllm")) and \
        options.get("vllm_mode", "colocate") == "colocate" and device_kind == "cuda"


# -- the estimate ------------------------------------------------------------------------------

def vllm_weights(spec: Any) -> tuple[int, int]:
    """(bytes, itemsize) of the weights vLLM loads: the base model from its checkpoint, in 16
    bits (vLLM's dtype "auto" runs an fp32 checkpoint in 16 bits too; TRL passes no dtype), or
    4-bit with a bitsandbytes QLoRA policy (TRL passes quantization="bitsandbytes")."""
    base = spec.meta.get_base_model() if hasattr(spec.meta, "get_base_model") else spec.meta
    numel = sum(p.numel() for n, p in base.named_parameters() if "lora_" not in n)
    if spec.quant_bits == 4:
        return spec.states()[0] - sum(p.nbytes for p in spec.states()[1]), 2
    return numel * 2, 2


def colocated(spec: Any, setup: Any, dev: Any, *, seq_len: int, held: int,
              context: int) -> VllmMemory | None:
    """The colocated vLLM engine of ``setup`` on ``dev``, or None where there is none."""
    o = setup.trainer_options
    if not colocates(o, dev.kind):
        return None
    settings = VllmSettings.from_trl(o.get, per_device_train_batch_size=setup.micro_batch,
                                     steps_per_generation=steps_of(setup))
    weights = spec.states()[0]
    base, itemsize = vllm_weights(spec)
    return colocated_vllm(spec.config, settings, total_memory=dev.total_memory,
                          weight_bytes=base, dtype_itemsize=itemsize,
                          tokens_per_seq=seq_len + int(o["max_completion_length"]),
                          free_at_startup=dev.total_memory - context - weights - held)


def with_vllm(vm: VllmMemory, used: int, hold: int, context: int, sleep: bool
              ) -> tuple[int, int, str, bool]:
    """(device_used with the engine, the engine's bytes at that moment, a note, whether that
    moment is vLLM's generation rather than the trainer's peak phase). ``hold``: what the
    trainer keeps while vLLM generates (weights, optimizer state, a reference)."""
    train, gen = used + vm.asleep, context + hold + vm.awake
    held = "asleep: only its CUDA graphs stay (vllm_enable_sleep_mode)" if sleep else \
        "its weights, KV cache and graphs stay resident (no sleep mode)"
    if train >= gen:
        return train, vm.asleep, f"while the trainer trains vLLM is {held}" if sleep else \
            f"while the trainer trains, {held}", False
    return gen, vm.awake, "the peak is while vLLM generates (awake) beside the trainer's " \
        "weights and optimizer state", True


def tenant(spec: Any, setup: Any, dev: Any, *, seq_len: int, held: int, parts: Any, rs: Any,
           used: int, phase: str) -> Tenant | None:
    """The colocated vLLM as the estimate adds it (``TrainerKind.tenant``), or None."""
    vm = colocated(spec, setup, dev, seq_len=seq_len, held=held, context=parts["context"])
    if vm is None:
        return None
    grown, nbytes, why, generating = with_vllm(
        vm, used, rs.weights + rs.optimizer + held, parts["context"],
        bool(setup.trainer_options.get("vllm_enable_sleep_mode")))
    notes = []
    if generating:
        notes.append(f"device_used is the moment vLLM generates: the trainer's weights, "
                     f"optimizer state and context beside the awake engine; the rows above are "
                     f"the trainer's own peak ({phase})")
        phase = "generate (vLLM)"
    return Tenant("vllm", nbytes, grown, phase, notes + [f"colocated vLLM: {why}"]
                  + list(vm.notes), list(vm.refusals))


# -- the plan ----------------------------------------------------------------------------------

def smallest_share(req: Any, spec: Any) -> tuple[float, str]:
    """The smallest ``vllm_gpu_memory_utilization`` whose KV cache holds the demand, and why
    (the demand's tokens and bytes). 0.95 with a note when none up to it does. ``req``: the
    ``PlanRequest``; ``spec``: the model as loaded."""
    completion = int(req.get("max_completion_length"))
    weights, itemsize = vllm_weights(spec)
    share, vm = SHARE_STEP, None
    while share <= 0.95 + 1e-9:
        settings = VllmSettings.from_trl(lambda k, s=share: s if k ==
                                         "vllm_gpu_memory_utilization" else req.get(k),
                                         per_device_train_batch_size=req.per_rank,
                                         steps_per_generation=1)
        vm = colocated_vllm(spec.config, settings, total_memory=req.dev.total_memory,
                            weight_bytes=weights, dtype_itemsize=itemsize,
                            tokens_per_seq=req.seq_len + completion)
        if vm.kv_capacity_tokens >= vm.kv_demand_tokens and vm.kv_cache > 0:
            break
        share = round(share + SHARE_STEP, 2)
    share = min(share, 0.95)
    why = (f"vLLM's share {share:.2f} of the GPU: the smallest (in steps of {SHARE_STEP}) "
           f"whose KV cache holds the generation's {vm.kv_demand_tokens} tokens "
           f"({format_bytes(vm.kv_demand)}: {req.per_rank} sequences of {req.seq_len} + "
           f"{completion} tokens) beside its copy of the weights ({format_bytes(vm.weights)})")
    if vm.kv_capacity_tokens < vm.kv_demand_tokens:
        why += "; even 0.95 does not hold it all: vLLM preempts sequences (slower, not an OOM)"
    return share, why


def startup_problem(req: Any, share: float, spec: Any) -> str | None:
    """vLLM's start-up rule against the lightest policy the plan may load: it starts only if
    the free memory (the card less the CUDA context and the policy, loaded in the trainer's
    ``__init__`` before vLLM) holds ``share x total`` (``vllm/v1/worker/utils.py:
    request_memory``). None when some setup can start it."""
    from ..._cuda.runtime import cuda_runtime
    from ..._methods import ladder

    numel = sum(p.numel() for p in spec.meta.parameters())
    per_param = min([START_BYTES.get(m.name, 2.0) for m in ladder(req.method)] or [2.0])
    total = req.dev.total_memory
    free = total - cuda_runtime(req.cuda_version).context - int(numel * per_param)
    if math.ceil(share * total) <= free:
        return None
    most = math.floor(free / total / SHARE_STEP) * SHARE_STEP
    return (f"vllm_gpu_memory_utilization={share} asks vLLM for {format_bytes(share * total)} "
            f"at start-up, but with the policy loaded ({format_bytes(numel * per_param)} at "
            f"{per_param:g} bytes a parameter, the lightest method allowed) and the CUDA "
            f"context at most {format_bytes(free)} is free, and vLLM refuses to start "
            f"(request_memory); use at most {most:.2f}, or vllm_mode='server'")


def with_pin(req: Any, **pins: Any) -> Any:
    return dataclasses.replace(req, constraints={**req.constraints, **pins})


def plan_beside_vllm(req: Any, run: Callable[[Any], Any], base: Callable[[], Any]) -> Any:
    """``run(req)`` (the plan) with vLLM's share chosen and sleep mode as the fallback (module
    docstring); ``run(req)`` as it is where vLLM is not colocated."""
    if not colocates(req.pins, req.dev.kind):
        return run(req)
    notes, spec = [], base()
    if "vllm_max_model_length" not in req.constraints:
        # unset, vLLM sizes one request at the model's positions (131,072 for Qwen2.5) and
        # refuses to start when its KV cache cannot hold one such request
        longest = req.seq_len + int(req.get("max_completion_length"))
        req = with_pin(req, vllm_max_model_length=longest)
        notes.append(f"vllm_max_model_length={longest}: the longest sequence generated (seq_len "
                     f"{req.seq_len} + max_completion_length {longest - req.seq_len}); unset, "
                     "vLLM would size one request at the model's positions")
    if "vllm_gpu_memory_utilization" not in req.constraints:
        share, why = smallest_share(req, spec)
        req = with_pin(req, vllm_gpu_memory_utilization=share)
        notes.append(why)
    problem = startup_problem(req, float(req.constraints["vllm_gpu_memory_utilization"]), spec)
    if problem:
        raise ConfigError([problem], source="plan_training")
    try:
        plan = run(req)
    except HfMemkitError as exc:
        if "vllm_enable_sleep_mode" in req.constraints:
            raise HfMemkitError(f"{exc}\nbeside a colocated vLLM ({_share_words(req)}) no setup "
                                "fits: run vLLM in server mode on other GPUs "
                                "(vllm_mode='server'), or lower its share") from None
        try:
            plan = run(with_pin(req, vllm_enable_sleep_mode=True))
        except HfMemkitError as again:
            raise HfMemkitError(
                f"{again}\nbeside a colocated vLLM ({_share_words(req)}), even with its sleep "
                "mode (vllm_enable_sleep_mode=True), no setup fits: run vLLM in server mode on "
                "other GPUs (vllm_mode='server': `trl vllm-serve`), where this GPU holds the "
                "trainer alone") from None
        notes.append("vllm_enable_sleep_mode=True: no setup fits beside an awake vLLM, so "
                     "vLLM releases its weights and KV cache while the trainer scores and "
                     "trains (it reloads them before each generation)")
    plan.notes[:0] = notes
    return plan


def _share_words(req: Any) -> str:
    return f"vllm_gpu_memory_utilization={req.constraints.get('vllm_gpu_memory_utilization')}"
