"""Planning TRL's online RL trainers beside a colocated vLLM (``_trainers.rl``, ``vllm``).

With ``use_vllm=True`` in colocate mode the trainer shares the GPU with vLLM, which takes
``vllm_gpu_memory_utilization`` of it. Unless that is pinned, the plan gives vLLM the smallest
share (in steps of 0.05) whose KV cache holds the generation's demand: ``max_num_seqs`` (the
per-rank batch, = per-device batch x ``steps_per_generation`` with ``steps_per_generation``
the accumulation, x vLLM's tensor parallelism) sequences of prompt + ``max_completion_length``
tokens. Then the trainer is planned in the rest; when no setup fits beside an awake engine
and sleep mode is not pinned, the plan turns ``vllm_enable_sleep_mode`` on (vLLM releases its
weights and KV cache while the trainer scores and trains) and says so; when even that does
not fit, the error says to run vLLM in server mode on other GPUs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .._estimate.rollout import vllm_weights
from .._setup.fields import config_fields
from .._trainers import TRAINERS
from .._trainers.vllm import VllmSettings, colocated_vllm
from .._units import format_bytes
from .request import PlanRequest

SHARE_STEP = 0.05


def colocates(req: PlanRequest) -> bool:
    """Whether ``req`` plans an online-RL trainer beside a colocated vLLM on a CUDA GPU."""
    if req.trainer not in ("grpo", "rloo") or req.dev.kind != "cuda":
        return False
    pins = req.pins
    return bool(pins.get("use_vllm")) and pins.get("vllm_mode", "colocate") == "colocate"


def _get(req: PlanRequest) -> Callable[[str], Any]:
    fields = config_fields(TRAINERS.get(req.trainer).config_type())
    return lambda name: req.pins.get(name, fields.get(name))


def smallest_share(req: PlanRequest, spec: Any) -> tuple[float, str]:
    """The smallest ``vllm_gpu_memory_utilization`` whose KV cache holds the demand, and why
    (the demand's tokens and bytes). 0.95 with a note when none up to it does."""
    get = _get(req)
    completion = int(get("max_completion_length"))
    weights, itemsize = vllm_weights(spec)
    share, vm = SHARE_STEP, None
    while share <= 0.95 + 1e-9:
        settings = VllmSettings.from_trl(lambda k, s=share: s if k ==
                                         "vllm_gpu_memory_utilization" else get(k),
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


# bytes a parameter of the policy takes when vLLM starts, by the lightest method the plan may use
START_BYTES = {"qlora": 0.5, "fsdp-qlora": 0.5, "lora-8bit": 1.0}


def startup_problem(req: PlanRequest, share: float, spec: Any) -> str | None:
    """vLLM's start-up rule against the lightest policy the plan may load: it starts only if
    the free memory (the card less the CUDA context and the policy, loaded in the trainer's
    ``__init__`` before vLLM) holds ``share x total`` (``vllm/v1/worker/utils.py:
    request_memory``). None when some setup can start it."""
    import math

    from .._cuda.runtime import cuda_runtime
    from .._methods import ladder

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


def with_pin(req: PlanRequest, **pins: Any) -> PlanRequest:
    import dataclasses

    return dataclasses.replace(req, constraints={**req.constraints, **pins})


def plan_beside_vllm(req: PlanRequest, run: Callable[[PlanRequest], Any]) -> Any:
    """``run(req)`` (the plan) with vLLM's share chosen and sleep mode as the fallback (module
    docstring); ``req`` unchanged where vLLM is not colocated."""
    from .._errors import ConfigError, HfMemkitError
    from .space import SpecBook

    if not colocates(req):
        return run(req)
    notes, spec = [], SpecBook(req, {}).base
    if "vllm_gpu_memory_utilization" not in req.constraints:
        share, why = smallest_share(req, spec)
        req, notes = with_pin(req, vllm_gpu_memory_utilization=share), [why]
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


def _share_words(req: PlanRequest) -> str:
    return f"vllm_gpu_memory_utilization={req.constraints.get('vllm_gpu_memory_utilization')}"
