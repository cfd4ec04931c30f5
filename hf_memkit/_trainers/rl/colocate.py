"""A colocated vLLM engine beside GRPO / RLOO on the training GPU (``use_vllm=True``,
``vllm_mode="colocate"``): its bytes in the estimate (``tenant``, ``GRPO.tenant``) and how the
planner plans around it (``plan_beside_vllm``, ``GRPO.plan_around``). The engine's own memory
follows vLLM's rules in ``vllm``.

**The estimate.** vLLM is built in the trainer's ``__init__`` (TRL 1.16 ``GRPOTrainer.__init__``
builds ``VLLMGeneration`` after ``Trainer.__init__``, before ``accelerator.prepare``), when the
device holds the context and what of the policy and a reference model is there already (the
optimizer state comes later): its start-up rule is judged against what that leaves
(``at_startup``). The whole policy on one process or under DDP (the Trainer moves it to the
device in its ``__init__``); under DeepSpeed and FSDP the Trainer leaves it where it loaded, on
the host, except ZeRO-3, whose ``zero.Init`` partitioned it onto the device as it loaded, 1/N a
rank (``Engine.resident_at_init_fraction``). vLLM takes its share of the total CUDA reports
(``cuda_total``). While the trainer scores and trains, vLLM holds what stays resident
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
from .steps import completion_width
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


def cuda_total(dev: Any) -> int:
    """The total ``torch.cuda.mem_get_info`` (``cudaMemGetInfo``) reports on ``dev``, of which
    vLLM's ``request_memory`` takes its share (``MemorySnapshot.total_memory``): the card less
    what the driver reserves (``DeviceInfo.cuda_memory``: probed, or the catalog's published
    figure); NVML's total where that is not known."""
    c = dev.cuda_memory
    return c if c and c <= dev.total_memory else dev.total_memory


def at_startup(spec: Any, setup: Any, held: int) -> tuple[int, str]:
    """(bytes of the policy and a reference on this rank's device when TRL builds vLLM, in
    words). The policy: ``Engine.resident_at_init_fraction`` of its weights. The reference,
    built in ``__init__`` too (``create_model_from_path``): on the device on one process
    (``device_map="auto"``), on the host where TRL passes ``device_map=None`` (several
    processes, DeepSpeed) unless ZeRO-3's ``zero.Init`` partitioned it as the policy; it moves
    at ``accelerator.prepare``. ``held``: the reference's bytes on this rank through the step."""
    sh = setup.sharding
    share = setup.engine.resident_at_init_fraction(sh)
    policy = math.ceil(spec.states()[0] * share)
    ref = held if sh.world_size == 1 or (share and setup.engine.zero3_enabled(sh)) else 0
    if share >= 1:
        words = "the whole policy (the Trainer places it on the device in its __init__)"
    elif share:
        words = (f"1/{round(1 / share)} of the policy (partitioned as it loaded, zero.Init; "
                 "the Trainer leaves it there)")
    else:
        words = ("none of the policy: the Trainer leaves it on the host until "
                 "accelerator.prepare (a model you loaded on the device yourself would count)")
    return policy + ref, words + (f" and {format_bytes(ref)} of the reference" if ref else "")


def colocated(spec: Any, setup: Any, dev: Any, *, seq_len: int, held: int,
              context: int) -> VllmMemory | None:
    """The colocated vLLM engine of ``setup`` on ``dev``, or None where there is none."""
    o = setup.trainer_options
    if not colocates(o, dev.kind):
        return None
    settings = VllmSettings.from_trl(o.get, per_device_train_batch_size=setup.micro_batch,
                                     steps_per_generation=steps_of(setup))
    base, itemsize = vllm_weights(spec)
    total = cuda_total(dev)
    resident = at_startup(spec, setup, held)[0]
    return colocated_vllm(spec.config, settings, total_memory=total,
                          weight_bytes=base, dtype_itemsize=itemsize,
                          tokens_per_seq=seq_len + completion_width(o, padded=False),
                          free_at_startup=total - context - resident)


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
    total, (resident, words) = cuda_total(dev), at_startup(spec, setup, held)
    notes = [f"vLLM's start-up (request_memory): {format_bytes(vm.startup_free_needed)} "
             f"requested ({setup.trainer_options.get('vllm_gpu_memory_utilization')} x "
             f"{format_bytes(total)}, the total CUDA reports); the trainer holds the context "
             f"and {format_bytes(resident)} then: {words}"]
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
        vm = colocated_vllm(spec.config, settings, total_memory=cuda_total(req.dev),
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
    total = cuda_total(req.dev)
    policy = int(numel * per_param * startup_fraction(req))
    free = total - cuda_runtime(req.cuda_version).context - policy
    if math.ceil(share * total) <= free:
        return None
    most = math.floor(free / total / SHARE_STEP) * SHARE_STEP
    return (f"vllm_gpu_memory_utilization={share} asks vLLM for {format_bytes(share * total)} "
            f"at start-up, but with the policy loaded ({format_bytes(policy)} on the device: "
            f"{per_param:g} bytes a parameter, the lightest method allowed, and the least of it "
            f"any strategy allowed keeps there before accelerator.prepare) and the CUDA "
            f"context at most {format_bytes(free)} is free, and vLLM refuses to start "
            f"(request_memory); use at most {most:.2f}, or vllm_mode='server'")


def startup_fraction(req: Any) -> float:
    """The least of the policy on a rank's device when vLLM starts over the strategies the plan
    may use (``Engine.resident_at_init_fraction``): the engine the arguments pin, else the
    whole policy on one process, else the least of the sharding engine's rungs."""
    from ..._engines import ENGINES, Sharding

    pinned = next((e for e in ENGINES if e.selected(req.pins.get)), None)
    if pinned is not None:
        return pinned.resident_at_init_fraction(pinned.from_args(req.pins.get, req.ranks))
    if req.ranks == 1:
        return 1.0
    engine = req.sharding_engine
    return min([engine.resident_at_init_fraction(
        Sharding(engine.name, req.ranks, r.stage, offload_params=r.offload_params))
        for r in engine.rungs() if r.name in (req.engine_stage or (r.name,))] or [1.0])


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
