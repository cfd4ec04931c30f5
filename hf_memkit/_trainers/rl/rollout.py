"""The phases of an online-RL step besides its train micro-steps (``entry``): generation with the
policy's own ``generate`` and the no-grad scoring of the completions (``GRPO.rollout``).

Each is an eval trace of its own (the entry's ``shape`` and ``step`` for that phase), on top of
what the step holds between optimizer steps: weights, optimizer state, a reference model, and
the accumulated gradients where a generation falls inside an accumulation (when the
accumulation steps do not divide ``steps_per_generation x num_iterations``). The Trainer frees
the gradients after each optimizer step (``zero_grad(set_to_none=True)``), so a generation at
the start of a step holds none.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ..._techniques import TechniqueUse
from ..base import RolloutPhase
from .steps import completion_width

# the eval trace's phases -> the phase names the estimate reports
TRACED = {"prefill": "generate (prefill)", "decode": "generate (decode)", "eval": "score"}


def generation_steps(options: Mapping[str, Any], micro_batch: int, grad_accum: int,
                     ranks: int) -> int:
    """``steps_per_generation`` as ``GRPOConfig.__post_init__`` resolves it: given, else
    ``generation_batch_size / (per_device_train_batch_size x processes)``, else the
    accumulation steps."""
    if options.get("steps_per_generation"):
        return int(options["steps_per_generation"])
    if options.get("generation_batch_size"):
        return max(1, int(options["generation_batch_size"]) // (micro_batch * max(1, ranks)))
    return grad_accum


def steps_of(setup: Any) -> int:
    """``setup``'s resolved ``steps_per_generation``."""
    return generation_steps(setup.trainer_options, setup.micro_batch, setup.grad_accum,
                            setup.sharding.world_size)


def phase_setup(setup: Any, phase: str) -> Any:
    """``setup`` as the trace of ``phase`` runs it: the generation batch (per-device batch x
    ``steps_per_generation`` rows) for "generate", the micro-batch for "score"."""
    kind, o = setup.trainer_kind, dict(setup.trainer_options)
    spg = steps_of(setup)
    rows = setup.micro_batch * spg
    o.update(phase=phase, generation_rows=rows,
             old_logps=kind.old_logps(o, spg, setup.grad_accum))
    return setup.replace(eval_batch=rows if phase == "generate" else setup.micro_batch,
                         trainer=TechniqueUse.of(kind.name, o))


def grads_at_generation(setup: Any) -> bool:
    """Whether a generation can fall between micro-steps of one optimizer step (``_step %
    (steps_per_generation x num_iterations) == 0`` over micro-steps), gradients alive."""
    o = setup.trainer_options
    every = steps_of(setup) * int(o.get("num_iterations") or 1)
    return setup.grad_accum > 1 and every % setup.grad_accum != 0


def zero3_gathers(setup: Any) -> bool:
    """Whether generation gathers the whole model at once: under DeepSpeed ZeRO-3
    (``Engine.zero3_enabled``) with ``ds3_gather_for_generation`` (TRL's
    ``unwrap_model_for_generation``: ``GatheredParameters(model.parameters())``)."""
    return setup.engine.zero3_enabled(setup.sharding) and \
        setup.trainer_options.get("ds3_gather_for_generation", True) is not False


def gathered_for(spec: Any, setup: Any, rs: Any, phase: str) -> int:
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


def rollout_phases(phases: tuple[str, ...], spec: Any, setup: Any, rs: Any, *, held: int,
                   trace: Callable[[Any], Any]) -> dict[str, RolloutPhase]:
    """Each of ``phases`` traced (``trace``, an eval trace at the longest prompt) on top of
    what the step holds (``TrainerKind.rollout``)."""
    grads = (rs.gradients if rs.accum_gradients is None else rs.accum_gradients) \
        if grads_at_generation(setup) else 0
    if rs.resident_gradients:  # ZeRO-3's flat gradient-partition buffer: alive from the start
        grads = rs.gradients
    out: dict[str, RolloutPhase] = {}
    for phase in phases:
        ex = trace(phase_setup(setup, phase))
        gathered = gathered_for(spec, setup, rs, phase)
        base = rs.weights + rs.optimizer + rs.buckets + held + grads + ex.inputs + gathered
        for name, extra in ex.phases.items():
            cats = ex.categories.get(name, {})
            parts = {"weights": rs.weights + held + gathered, "gradients": grads + rs.buckets,
                     "optimizer": rs.optimizer, "activations": cats.get("Activation", 0)}
            parts["temporaries"] = max(0, base + extra - sum(parts.values()))
            out[TRACED[name]] = RolloutPhase(sum(parts.values()), parts, ex)
    return out


def rollout_notes(setup: Any, phases: Mapping[str, RolloutPhase]) -> list[str]:
    """What the estimate says of the generation: its rows and cache, gradients alive through
    it, ZeRO-3's whole-model gather."""
    if not phases:
        return []
    o = setup.trainer_options
    rows = setup.micro_batch * steps_of(setup)
    notes = []
    if TRACED["decode"] in phases:
        notes.append(f"generation: {rows} rows (per_device_train_batch_size x "
                     "steps_per_generation) sampled by the policy's generate with its KV cache "
                     "(no grad); its last decode step holds the cache of prompt + "
                     f"{completion_width(o, padded=False)} tokens (the longest completion)")
    if grads_at_generation(setup):
        notes.append("generation falls inside a gradient accumulation (the accumulation steps "
                     "do not divide steps_per_generation x num_iterations): the accumulated "
                     "gradients are alive while it runs")
    if zero3_gathers(setup) and TRACED["decode"] in phases:
        notes.append("generation under ZeRO-3 gathers the whole model at once "
                     "(ds3_gather_for_generation=True; False gathers module by module, slower)")
    return notes
