"""One step's peak from model states (``_engines``) and traced excess (``activations``).

The peak of a Trainer optimizer step (steady state, step >= 2):

    forward / backward, micro-step 1:  W + inputs + O + X          (X: activations, temporaries
    forward / backward, micro-step 2+: W + inputs + O + G + X'      and gradients being created)
    optimizer.step():                  W + inputs + G + O + T_opt
    (W weights, G gradients, O optimizer state, T_opt the optimizer's transient buffers)

Data-parallel engines: W, G and O become one rank's shards, and the forward and backward add
the layers gathered at that moment (FSDP, ZeRO-3), one layer's unsharded gradients, and
persistent communication buckets (DDP, DeepSpeed). Activations are replicated: each rank traces
its own micro-batch, with the dtype the engine computes in. CUDA adds allocator rounding and
segments, the context and cuBLAS workspaces (``_cuda``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from .._device.probe import DeviceInfo
from .._engines import RankStates, ReferenceSizes, StateSizes, rank_states
from .._model.spec import ModelSpec
from .._optimizers import (
    OptimizerContext,
    OptimizerMemory,
    ParamInfo,
    get_optimizer_profile,
)
from .._setup.setup import TrainingSetup
from .._techniques import TECHNIQUES
from .._units import format_bytes
from .activations import Excess

BREAKDOWN_SUM_KEYS = ("weights", "gradients", "optimizer", "activations", "temporaries")
TRACE_PHASE = {"forward": "forward", "backward": "backward", "eval forward": "eval",
               "forward (accumulating)": "forward_accum",
               "backward (accumulating)": "backward_accum"}


def states_for(spec: ModelSpec, setup: TrainingSetup,
               dev: DeviceInfo) -> tuple[RankStates, OptimizerMemory]:
    """One rank's model states and the optimizer's memory for ``setup`` (the planner's cheap
    bound uses it alone, before any trace)."""
    weights, trainable = spec.states()
    sh, engine = setup.sharding, setup.engine
    # the dtype the optimizer steps each trainable parameter in (Engine.master_itemsize: FSDP's
    # fp32 upcast under mixed precision, DeepSpeed's fp32 master partitions)
    master = [dataclasses.replace(p, itemsize=engine.master_itemsize(sh, p.itemsize,
                                                                     spec.quant_bits == 4))
              for p in trainable]
    profile = get_optimizer_profile(setup.optim)
    om = profile.estimate(master, OptimizerContext(device_kind=dev.kind,
                                                   optim_args=setup.optim_args))
    facts = spec.facts() if engine.sharded else None
    # an engine that steps flat fp32 partitions (ZeRO-3's sub-groups): the optimizer's
    # temporaries on one such tensor, as a parameter of its own
    flat = engine.stepped_elements(sh, sum(p.numel for p in trainable), facts)
    flat_transient = profile.estimate(
        [ParamInfo(flat, (flat,), 4)], OptimizerContext(device_kind=dev.kind, num_groups=1,
                                                        optim_args=setup.optim_args)
    ).transient if flat else 0
    held = master if engine.holds_masters else trainable
    parts = spec.weight_parts()
    # tensor parallelism: the vocab-split input embedding's gradient is a Replicate DTensor of
    # the whole table on every rank (measured: _parallel_worker's TP runs)
    whole_table = sum(p.nbytes * (spec.tp - 1) for p in held if p.embedding)
    sizes = StateSizes(weights + sum(m.nbytes - p.nbytes for m, p in zip(held, trainable,
                                                                         strict=True)),
                       sum(p.nbytes for p in held) + whole_table,
                       sum(p.numel for p in trainable), om.state,
                       om.transient, spec.dtype.itemsize, buffers=parts.buffers,
                       packed_4bit=parts.packed_4bit, quant_constants=parts.quant_constants,
                       storage_floating=parts.storage_floating,
                       upcast=sum(p.numel for m, p in zip(held, trainable, strict=True)
                                  if m.itemsize != p.itemsize), flat_transient=flat_transient)
    return rank_states(sh, sizes, facts=facts, device_kind=dev.kind), om


def state_notes(setup: TrainingSetup, rs: RankStates, om: OptimizerMemory,
                 dev: DeviceInfo) -> list[str]:
    notes = list(setup.notes)
    notes.extend(setup.engine.notes(setup.sharding, dev.kind))
    notes.extend(rs.notes)
    if rs.host:
        notes.append(f"{format_bytes(rs.host)} per rank offloaded to host (CPU) memory")
    if om.paged:
        notes.append(f"{format_bytes(om.paged)} of paged optimizer state lives in CUDA managed "
                     "memory, outside device memory: the driver pages it out to host memory when "
                     f"the device runs short; device_used counts {format_bytes(om.paged_resident)}"
                     ", the largest parameter's state pages, which the step needs on the device "
                     "at once (NVML shows more while unpressed pages stay there)")
    return notes


def technique_host_bytes(spec: ModelSpec, setup: TrainingSetup, seq_len: int, *,
                         device_kind: str = "cuda", stage: str = "train") -> int:
    """Host memory the setup's techniques keep for a training step (``Technique.host_bytes``;
    none for an eval step or a technique that does not act on ``device_kind``)."""
    total = 0
    compute_dtype = trace_variant(spec, setup)[0].dtype  # the dtype each rank computes in
    for use in setup.techniques if stage != "eval" else ():
        t = TECHNIQUES.get(use.name)
        if t.acts_on(device_kind):
            total += int(t.host_bytes(spec, setup, seq_len, dict(use.options), compute_dtype))
    return total


def trained_spec(spec: ModelSpec, setup: TrainingSetup) -> ModelSpec:
    """The model as the setup's trainer trains it: its adapters in the dtype the trainer casts
    them to (``TrainerKind.adapter_dtype``: TRL's bf16 for a quantized base)."""
    if spec.lora is None:
        return spec
    dtype = setup.trainer_kind.adapter_dtype(
        quantized=spec.quant_bits is not None, zero3=setup.engine.zero3_enabled(setup.sharding),
        base=spec.dtype, given=spec.lora.adapter_dtype)
    return spec.with_adapter_dtype(dtype) if dtype is not None else spec


def trace_variant(spec: ModelSpec, setup: TrainingSetup) -> tuple[ModelSpec, TrainingSetup]:
    """What each rank computes with: engines that gather or keep 16-bit parameters under mixed
    precision (``Engine.traces_half``) run a 16-bit model without autocast, whatever dtype it
    was loaded in (FSDP upcasts a 16-bit model's trainable parameters to fp32 and gathers them
    in 16-bit again)."""
    if not setup.amp or spec.quant_bits or not setup.engine.traces_half(setup.sharding):
        return spec, setup
    half = torch.bfloat16 if setup.amp == "bf16" else torch.float16
    return (spec if spec.dtype == half else spec.in_dtype(half)), setup.replace(amp=None)


@dataclass
class Step:
    """The per-phase totals of one step and what is alive at its peak."""

    phases: dict[str, int]
    excess: Excess
    rs: RankStates
    grad_factor: float
    G_acc: int
    reference: int = 0   # a DPO reference model's share on this rank, held through the step
    ref_gather: int = 0  # ... and what its forward gathers (in the forward phases)


def _train_phases(ex: Excess, xp: dict[str, int], rs: RankStates) -> dict[str, int]:
    W, G, O, B = rs.weights, rs.gradients, rs.optimizer, rs.buckets  # noqa: E741
    gf, gb, gbuf = rs.gathered_forward, rs.gathered_backward, rs.grad_buffers
    G_acc = G if rs.accum_gradients is None else rs.accum_gradients
    base = W + ex.inputs + O + B
    if rs.resident_gradients:  # in every phase already
        base, G, G_acc = base + G, 0, 0
    phases = {"forward": base + gf + xp["forward"]}
    if "backward" in xp:  # (a forward-only probe has none: its phases bound the step below)
        phases["backward"] = base + gb + gbuf + xp["backward"]
    phases["optimizer step"] = base + G + rs.optimizer_transient
    if "forward_accum" in xp:
        phases["forward (accumulating)"] = base + G_acc + gf + xp["forward_accum"]
    if "backward_accum" in xp:
        phases["backward (accumulating)"] = base + G_acc + gb + gbuf + xp["backward_accum"]
    return phases


def step_phases(spec: ModelSpec, trace_spec: ModelSpec, setup: TrainingSetup, ex: Excess,
          rs: RankStates, stage: str, ref: tuple[int, int] = (0, 0)) -> Step:
    xp = dict(ex.phases)
    trainable = spec.states()[1]
    # gradients made during the backward are reduce-scattered layer by layer: one rank keeps
    # its shard, in the dtype of its sharded parameters (G per full set, offloaded: none)
    traced_total = sum(p.numel for p in trainable) * trace_spec.dtype.itemsize \
        if trace_spec is not spec else sum(p.nbytes for p in trainable)
    sharded = setup.engine.grads_sharded(setup.sharding)
    grad_factor = rs.gradients / traced_total if sharded and traced_total else 1.0
    if rs.resident_gradients:  # a buffer alive from the start (in base), not grown by backward
        grad_factor = 0.0
    if sharded:
        for key in ("backward", "backward_accum"):
            if key in xp:
                # the gradients this backward made. An accumulating micro-step's category also
                # counts the ones the previous micro-steps left, which its excess holds out:
                # where they are sharded (G_acc), only the new ones are scaled; unsharded
                # (FSDP's no_sync) they are reduce-scattered in the syncing micro-step as it
                # goes, and the category is scaled whole
                held = traced_total if key.endswith("_accum") and rs.accum_gradients is None \
                    else 0
                made = max(0, ex.categories.get(key, {}).get("Gradient", 0) - held)
                # a category extrapolated in depth from traces whose peaks fall at different
                # moments (2 blocks: the start of backward, 3: after the head's gradient) can
                # exceed the phase's own excess: it must not take the phase below its base
                rest = xp[key] + int(made * grad_factor) - made
                xp[key] = max(0, rest) if xp[key] >= 0 else rest
    G_acc = rs.gradients if rs.accum_gradients is None else rs.accum_gradients
    if stage == "train":
        phases = _train_phases(ex, xp, rs)
    elif stage == "forward_backward":  # a custom loop: no optimizer, so no optimizer state
        base = rs.weights + ex.inputs + rs.buckets
        phases = {"forward": base + rs.gathered_forward + xp["forward"]}
        if "backward" in xp:
            phases["backward"] = base + rs.gathered_backward + rs.grad_buffers + xp["backward"]
    else:
        phases = {"eval forward": rs.weights + ex.inputs + rs.optimizer + rs.buckets
                  + rs.gathered_forward + xp["eval"]}
    held, gather = ref  # the reference forward runs inside the step's forward
    return Step({k: v + held + (gather if "forward" in k else 0) for k, v in phases.items()},
                 ex, rs, grad_factor, G_acc, held, gather)


def reference_share(spec: ModelSpec, setup: TrainingSetup) -> tuple[int, int]:
    """The trainer's separate reference model (DPO without PEFT): a frozen copy of the policy as
    loaded (its base, without adapters, when the user passes one to a PEFT policy), prepared by
    the engine (``Engine.reference_share``: a replica, or sharded by ZeRO-3 / FSDP). Returns the
    bytes one rank holds through the step and those its forward gathers on top."""
    kind = setup.trainer_kind
    if kind.reference(setup.trainer_options, spec.lora is not None) != "copy":
        return 0, 0
    weights, trainable = spec.states()
    adapters = sum(p.nbytes for p in trainable) if spec.lora is not None else 0
    numels = tuple(p.numel() for p in spec.meta.parameters()
                   if spec.lora is None or not p.requires_grad)
    buffers = spec.weight_parts().buffers
    ref = ReferenceSizes(weights - adapters, sum(numels) + buffers // spec.dtype.itemsize,
                         spec.dtype.itemsize, numels,
                         int(getattr(spec.config.get_text_config(), "hidden_size", 0) or 0))
    engine = setup.engine
    return engine.reference_share(setup.sharding, ref,
                                  spec.facts() if engine.sharded else None)


def breakdown(step: Step, phase: str) -> dict[str, int]:
    """weights, gradients, optimizer, activations, temporaries at the peak (sum = peak)."""
    rs, ex = step.rs, step.excess
    cats = ex.categories.get(TRACE_PHASE.get(phase, ""), {})
    grads_now = {"optimizer step": rs.gradients, "forward (accumulating)": step.G_acc,
                 "backward (accumulating)": step.G_acc}.get(phase, 0)
    if rs.resident_gradients:
        grads_now = rs.gradients
    if phase.startswith("backward"):
        grads_now += rs.grad_buffers
    if phase in ("forward", "backward", "eval forward"):
        traced = cats.get("Gradient", 0)
        grads_now += int(traced * step.grad_factor) if phase == "backward" else traced
    gathered = rs.gathered_backward if phase.startswith("backward") else \
        0 if phase == "optimizer step" else rs.gathered_forward
    ref = step.reference + (step.ref_gather if "forward" in phase else 0)
    parts = {"weights": rs.weights + gathered + ref,
             "gradients": grads_now + rs.buckets,
             "optimizer": rs.optimizer, "activations": cats.get("Activation", 0)}
    parts["temporaries"] = step.phases[phase] - sum(parts.values())
    if parts["temporaries"] < 0:  # extrapolated categories can overshoot by a few bytes
        parts["activations"] += parts["temporaries"]
        parts["temporaries"] = 0
    return parts


def reference_note(ref: tuple[int, int]) -> list[str]:
    if not (ref[0] or ref[1]):
        return []
    return [f"the reference model: a frozen copy, {format_bytes(ref[0])} held on this rank" +
            (f" and {format_bytes(ref[1])} gathered for its forward" if ref[1] else "") +
            " (precompute_ref_log_probs=True or a PEFT policy frees it)"]
