"""The phases of an online-RL step besides its train micro-steps (``_trainers.rl``): generation
with the policy's own ``generate`` and the no-grad scoring of the completions.

Each is an eval trace of its own (the trainer entry's ``shape`` and ``step`` for that phase),
on top of what the step holds between optimizer steps: weights, optimizer state, a reference
model, and the accumulated gradients where a generation falls inside an accumulation (when the
accumulation steps do not divide ``steps_per_generation x num_iterations``). The Trainer frees
the gradients after each optimizer step (``zero_grad(set_to_none=True)``), so a generation at
the start of a step holds none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .._cuda.target import CudaTarget
from .._engines import RankStates
from .._model.spec import ModelSpec
from .._setup.setup import TrainingSetup
from .._techniques import TechniqueUse
from .._trainers.rl import generation_steps
from .._trainers.vllm import VllmMemory, VllmSettings, colocated_vllm
from .activations import Excess, TraceCache, trace_excess

TRACED = {"prefill": "generate (prefill)", "decode": "generate (decode)", "eval": "score"}


@dataclass
class RolloutPhase:
    """One phase's peak (``total``), its breakdown (summing to it) and its trace."""

    total: int
    parts: dict[str, int]
    excess: Excess


def _steps(setup: TrainingSetup) -> int:
    return generation_steps(setup.trainer_options, setup.micro_batch, setup.grad_accum,
                            setup.sharding.world_size)


def _phase_setup(setup: TrainingSetup, phase: str) -> TrainingSetup:
    kind, o = setup.trainer_kind, dict(setup.trainer_options)
    spg = _steps(setup)
    rows = setup.micro_batch * spg
    o.update(phase=phase, generation_rows=rows,
             old_logps=kind.old_logps(o, spg, setup.grad_accum))
    return setup.replace(eval_batch=rows if phase == "generate" else setup.micro_batch,
                         trainer=TechniqueUse.of(kind.name, o))


def grads_at_generation(setup: TrainingSetup) -> bool:
    """Whether a generation can fall between micro-steps of one optimizer step (``_step %
    (steps_per_generation x num_iterations) == 0`` over micro-steps), gradients alive."""
    o = setup.trainer_options
    every = _steps(setup) * int(o.get("num_iterations") or 1)
    return setup.grad_accum > 1 and every % setup.grad_accum != 0


def rollout_phases(spec: ModelSpec, setup: TrainingSetup, rs: RankStates, *, seq_len: int,
                   held: int, target: CudaTarget | None, cache: TraceCache | None = None
                   ) -> dict[str, RolloutPhase]:
    """The rollout phases of ``setup``'s trainer (``TrainerKind.rollout``; none for a trainer
    without them), each traced at ``seq_len`` (the longest prompt). ``held``: a reference
    model's bytes held on this rank through the step."""
    rollout = getattr(setup.trainer_kind, "rollout", None)
    if rollout is None:
        return {}
    grads = (rs.gradients if rs.accum_gradients is None else rs.accum_gradients) \
        if grads_at_generation(setup) else 0
    out: dict[str, RolloutPhase] = {}
    for phase in rollout(setup.trainer_options, _steps(setup), setup.grad_accum):
        s = _phase_setup(setup, phase)
        kw = dict(seq_len=seq_len, stage="eval", target_len=None, padded=False, target=target)
        ex = trace_excess(spec, s, **kw) if cache is None else cache.excess(spec, s, **kw)
        gathered = gathered_for(spec, setup, rs, phase)
        base = rs.weights + rs.optimizer + rs.buckets + held + grads + ex.inputs + gathered
        for name, extra in ex.phases.items():
            cats = ex.categories.get(name, {})
            parts = {"weights": rs.weights + held + gathered, "gradients": grads + rs.buckets,
                     "optimizer": rs.optimizer, "activations": cats.get("Activation", 0)}
            parts["temporaries"] = max(0, base + extra - sum(parts.values()))
            out[TRACED[name]] = RolloutPhase(sum(parts.values()), parts, ex)
    return out


def zero3_gathers(setup: TrainingSetup) -> bool:
    """Whether generation gathers the whole model at once: DeepSpeed ZeRO-3 with
    ``ds3_gather_for_generation`` (TRL's ``unwrap_model_for_generation``:
    ``GatheredParameters(model.parameters())``)."""
    sh = setup.sharding
    return sh.engine == "deepspeed" and sh.stage == 3 and \
        setup.trainer_options.get("ds3_gather_for_generation", True) is not False


def gathered_for(spec: ModelSpec, setup: TrainingSetup, rs: RankStates, phase: str) -> int:
    """Unsharded parameters a rollout phase holds on top of this rank's shards: the whole
    16-bit model while ZeRO-3 generates with ``ds3_gather_for_generation``; otherwise what the
    engine's forward gathers (FSDP's ``summon_full_params(recurse=False)`` gathers only the
    root's own parameters, its forward the layers one by one; ZeRO-3 without the gather, its
    modules one by one)."""
    if not setup.engine.sharded:
        return 0
    if phase == "generate" and zero3_gathers(setup):   # DeepSpeed's 16-bit parameters
        half = 2 if setup.amp else spec.dtype.itemsize
        return sum(p.numel() for p in spec.meta.parameters()) * half
    return rs.gathered_forward


def rollout_notes(setup: TrainingSetup, phases: dict[str, RolloutPhase]) -> list[str]:
    if not phases:
        return []
    o = setup.trainer_options
    rows = setup.micro_batch * _steps(setup)
    notes = []
    if "generate (decode)" in phases:
        notes.append(f"generation: {rows} rows (per_device_train_batch_size x "
                     "steps_per_generation) sampled by the policy's generate with its KV cache "
                     "(no grad); its last decode step holds the cache of prompt + "
                     f"{o['max_completion_length']} tokens")
    if grads_at_generation(setup):
        notes.append("generation falls inside a gradient accumulation (the accumulation steps "
                     "do not divide steps_per_generation x num_iterations): the accumulated "
                     "gradients are alive while it runs")
    if zero3_gathers(setup) and "generate (decode)" in phases:
        notes.append("generation under ZeRO-3 gathers the whole model at once "
                     "(ds3_gather_for_generation=True; False gathers module by module, slower)")
    return notes


def vllm_weights(spec: ModelSpec) -> tuple[int, int]:
    """(bytes, itemsize) of the weights vLLM loads: the base model from its checkpoint, in 16
    bits (vLLM's dtype "auto" runs an fp32 checkpoint in 16 bits too; TRL passes no dtype), or
    4-bit with a bitsandbytes QLoRA policy (TRL passes quantization="bitsandbytes")."""
    base = spec.meta.get_base_model() if hasattr(spec.meta, "get_base_model") else spec.meta
    numel = sum(p.numel() for n, p in base.named_parameters() if "lora_" not in n)
    if spec.quant_bits == 4:
        return spec.states()[0] - sum(p.nbytes for p in spec.states()[1]), 2
    return numel * 2, 2


def colocated(spec: ModelSpec, setup: TrainingSetup, dev: Any, *, seq_len: int, held: int,
              context: int) -> VllmMemory | None:
    """The colocated vLLM engine of a GRPO / RLOO setup on a CUDA ``dev`` (``use_vllm=True``,
    ``vllm_mode="colocate"``; ``_trainers.vllm``), or None. vLLM is built in the trainer's
    ``__init__``, when the device holds the context, the policy and a reference model (the
    optimizer state comes later): its start-up rule is judged against what that leaves."""
    o = setup.trainer_options
    if not o.get("use_vllm") or o.get("vllm_mode", "colocate") != "colocate" or \
            dev.kind != "cuda":
        return None
    settings = VllmSettings.from_trl(o.get, per_device_train_batch_size=setup.micro_batch,
                                     steps_per_generation=_steps(setup))
    weights = spec.states()[0]
    base, itemsize = vllm_weights(spec)
    return colocated_vllm(spec.config, settings, total_memory=dev.total_memory,
                          weight_bytes=base, dtype_itemsize=itemsize,
                          tokens_per_seq=seq_len + int(o["max_completion_length"]),
                          free_at_startup=dev.total_memory - context - weights - held)


def with_vllm(vm: VllmMemory, used: int, hold: int, context: int, sleep: bool
              ) -> tuple[int, int, str, bool]:
    """(device_used with the engine, the engine's bytes at that moment, a note, whether that
    moment is vLLM's generation rather than the trainer's peak phase). While the trainer scores
    and trains, vLLM holds what stays resident (weights, KV cache, graphs; with sleep mode only
    its graphs); while it generates (its activations on top), the trainer holds only ``hold``
    (weights, optimizer state, a reference) besides the context."""
    train, gen = used + vm.asleep, context + hold + vm.awake
    held = "asleep: only its CUDA graphs stay (vllm_enable_sleep_mode)" if sleep else \
        "its weights, KV cache and graphs stay resident (no sleep mode)"
    if train >= gen:
        return train, vm.asleep, f"while the trainer trains vLLM is {held}" if sleep else \
            f"while the trainer trains, {held}", False
    return gen, vm.awake, "the peak is while vLLM generates (awake) beside the trainer's " \
        "weights and optimizer state", True


def colocated_tenant(spec: ModelSpec, setup: TrainingSetup, dev: Any, *, seq_len: int,
                     held: int, parts: dict[str, int], rs: RankStates, used: int, phase: str
                     ) -> tuple[VllmMemory | None, int, str, list[str]]:
    """A colocated vLLM added to the estimate (``colocated``): (the engine, device_used with it,
    the peak phase, notes); ``parts`` gains its bytes as ``vllm``. Without one, ``used`` and
    ``phase`` as they are."""
    vm = colocated(spec, setup, dev, seq_len=seq_len, held=held, context=parts["context"])
    if vm is None:
        return None, used, phase, []
    grown, parts["vllm"], why, generating = with_vllm(
        vm, used, rs.weights + rs.optimizer + held, parts["context"],
        bool(setup.trainer_options.get("vllm_enable_sleep_mode")))
    notes = []
    if generating:
        notes.append(f"device_used is the moment vLLM generates: the trainer's weights, "
                     f"optimizer state and context beside the awake engine; the rows above are "
                     f"the trainer's own peak ({phase})")
        phase = "generate (vLLM)"
    return vm, grown, phase, notes + [f"colocated vLLM: {why}"] + list(vm.notes)
