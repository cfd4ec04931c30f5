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
from typing import Any

import torch

from .._cuda.runtime import CudaRuntime, cuda_runtime
from .._cuda.target import CudaTarget, this_torch_cudnn
from .._device.precision import precision_issues
from .._device.probe import DeviceInfo
from .._engines import RankStates, ReferenceSizes, StateSizes, rank_states
from .._errors import HfMemkitError
from .._model.spec import ModelSpec
from .._model.tasks import TASKS
from .._optimizers import OptimizerContext, OptimizerMemory, get_optimizer_profile
from .._setup.setup import TrainingSetup
from .._techniques import TECHNIQUES
from .._units import format_bytes
from .activations import Excess, TraceCache, trace_excess
from .budget import backend_notes
from .device import device_terms
from .parallel import rank_view
from .result import MemoryEstimate
from .rollout import colocated_tenant, rollout_notes, rollout_phases

BREAKDOWN_SUM_KEYS = ("weights", "gradients", "optimizer", "activations", "temporaries")
TRACE_PHASE = {"forward": "forward", "backward": "backward", "eval forward": "eval",
               "forward (accumulating)": "forward_accum",
               "backward (accumulating)": "backward_accum"}


def check_setup(spec: ModelSpec, setup: TrainingSetup, dev: DeviceInfo, seq_len: int,
                seq_name: str = "seq_len") -> list[str]:
    """Raise for what cannot run; return what the estimate notes about the setup.
    ``seq_name``: the argument the sequence length came from, as the user wrote it."""
    if setup.checkpointing and not spec.supports_checkpointing:
        raise HfMemkitError(
            f"{spec.model_cls.__name__} does not support gradient checkpointing; set "
            "activation_checkpointing=False (and use a smaller micro-batch or another memory "
            "saver instead)")
    learned = spec.learned_positions()
    if learned and seq_len > learned:
        raise HfMemkitError(f"{seq_name} {seq_len} exceeds this model's learned position "
                            f"embeddings ({learned}); use {seq_name} <= {learned}")
    notes = backend_notes(dev)
    notes += [i.message for i in precision_issues(dev, bf16=setup.amp == "bf16")]
    if spec.positions_warning(seq_len, seq_name):
        notes.append(spec.positions_warning(seq_len, seq_name))
    if setup.tf32:
        notes.append("tf32 changes matmul precision only; no memory effect")
    notes.extend(f"not modelled: {u}" for u in setup.unmodelled)
    for use in sorted(setup.techniques):
        t = TECHNIQUES.get(use.name)
        if not t.acts_on(dev.kind):
            notes.append(f"{t.sentence_name} changes nothing on a {dev.kind} target: {t.inert}")
    return notes


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
    om = get_optimizer_profile(setup.optim).estimate(
        master, OptimizerContext(device_kind=dev.kind, optim_args=setup.optim_args))
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
                                  if m.itemsize != p.itemsize))
    facts = spec.facts() if engine.sharded else None
    return rank_states(sh, sizes, facts=facts, device_kind=dev.kind), om


def _state_notes(setup: TrainingSetup, rs: RankStates, om: OptimizerMemory,
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
    sh = setup.sharding
    dtype = setup.trainer_kind.adapter_dtype(
        quantized=spec.quant_bits is not None, zero3=sh.engine == "deepspeed" and sh.stage == 3,
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
class _Step:
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


def _step(spec: ModelSpec, trace_spec: ModelSpec, setup: TrainingSetup, ex: Excess,
          rs: RankStates, stage: str, ref: tuple[int, int] = (0, 0)) -> _Step:
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
                xp[key] += int(made * grad_factor) - made
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
    return _Step({k: v + held + (gather if "forward" in k else 0) for k, v in phases.items()},
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


def _eval_logits_note(spec: ModelSpec, setup: TrainingSetup, seq_len: int,
                      target_len: int | None) -> list[str]:
    vocab = getattr(spec.config.get_text_config(), "vocab_size", None)
    if setup.prediction_loss_only or not vocab or not TASKS.get(spec.task).vocab_logits:
        return []
    per_step = setup.eval_batch * (target_len or seq_len) * vocab * 4
    every = setup.eval_accumulation_steps
    return [f"the evaluation loop keeps each batch's logits ({format_bytes(per_step)} per "
            "eval step) on the device " + (f"for {every} steps before moving them to the CPU"
                                           if every else "until the evaluation ends") +
            "; set prediction_loss_only=True or eval_accumulation_steps to bound it"]


def _breakdown(step: _Step, phase: str) -> dict[str, int]:
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


def _reference_note(ref: tuple[int, int]) -> list[str]:
    if not (ref[0] or ref[1]):
        return []
    return [f"the reference model: a frozen copy, {format_bytes(ref[0])} held on this rank" +
            (f" and {format_bytes(ref[1])} gathered for its forward" if ref[1] else "") +
            " (precompute_ref_log_probs=True or a PEFT policy frees it)"]


def emulation_acts(spec: ModelSpec, setup: TrainingSetup, ex: Excess) -> bool:
    """Whether the CUDA emulation (``_cuda.emulation``) changes the traced step: autocast, an
    SDPA kernel, CUDA's fused dropout, a bitsandbytes base (CUDA's dequantisation), a TRL
    trainer's CUDA head, or a technique that acts only on CUDA. Where none does, the band's
    traced term carries the CPU-measured error and CUDA kernels' private buffers only."""
    if setup.amp or ex.sdpa_kernels or ex.cuda_dropout or spec.quant_bits:
        return True
    if setup.trainer_kind.step(setup.trainer_options) is not None:
        return True
    return any(not TECHNIQUES.get(u.name).acts_on("cpu") for u in setup.techniques)


def cuda_target(dev: DeviceInfo, runtime: CudaRuntime | None) -> tuple[CudaTarget | None, str]:
    """The CUDA target of ``dev`` and why cuDNN attention is (not) tried first: the runtime
    cuDNN where ``dev`` is this machine's GPU under this torch's CUDA, else the one assumed from
    the CUDA version (``_cuda.target``)."""
    if runtime is None:
        return None, ""
    cudnn = this_torch_cudnn(runtime.version) if dev.source != "catalog" else None
    return CudaTarget.resolve(dev.compute_capability, runtime.version, cudnn)


def _kernel_note(ex: Excess, target: CudaTarget | None, cudnn: str) -> list[str]:
    if target is None or not ex.sdpa_kernels:
        return []
    kinds = sorted(set(ex.sdpa_kernels))
    cc = ".".join(map(str, target.compute_capability))
    return [f"attention: CUDA's {'/'.join(kinds)} SDPA kernel (sm {cc}; {cudnn}; "
            "aten/src/ATen/native/transformers/cuda/sdp_utils.cpp)"]


def _shares(terms: Any) -> dict[str, int]:
    """Each term's share of the margin: the margin split in proportion to the terms' variances
    (they combine as independent errors), so the shares sum to the margin."""
    total = sum(v * v for v in terms.sigmas.values())
    if not total:
        return {}
    return {k: int(terms.margin * v * v / total) for k, v in terms.sigmas.items() if v}


def estimate_for(spec: ModelSpec, setup: TrainingSetup, dev: DeviceInfo, *, seq_len: int,
                 stage: str = "train", target_len: int | None = None, padded: bool = False,
                 cache: TraceCache | None = None,
                 probe: bool = False, cuda_version: str | None = None,
                 fit_budget: int | None = None, seq_name: str = "seq_len") -> MemoryEstimate:
    """``estimate_memory`` for an already resolved model and setup (the planner's entry).
    ``probe=True`` with a cache bounds a train step from its forward alone
    (``MemoryEstimate.lower_bound``). ``fit_budget``:
    the budget the planner judges by, so the smallest-capacity search runs only where the
    verdict depends on it (``device.device_terms``). ``seq_name``: the argument ``seq_len`` came
    from (``max_length``), named by its errors."""
    runtime = cuda_runtime(cuda_version) if dev.kind == "cuda" else None
    target, cudnn = cuda_target(dev, runtime)
    notes = check_setup(spec, setup, dev, seq_len, seq_name)
    cast = trained_spec(spec, setup)
    if cast is not spec:
        notes.append(setup.trainer_kind.adapter_note(cast.lora.adapter_dtype))
        spec = cast
    view = rank_view(spec, setup, seq_len, dev.kind, padded)  # TP / CP / SP: one rank's share
    spec, notes = view.spec, notes + view.notes
    rs, om = states_for(spec, setup, dev)
    if stage == "forward_backward":
        rs = dataclasses.replace(rs, optimizer=0, optimizer_transient=0)
        om = dataclasses.replace(om, state=0, transient=0, paged=0, paged_resident=0)
    notes += _state_notes(setup, rs, om, dev)
    ref = reference_share(spec, setup)
    notes += _reference_note(ref)
    trace_spec, trace_setup = trace_variant(spec, setup)
    kw = dict(seq_len=view.seq_len, stage=stage, target_len=target_len, padded=padded,
              target=target)
    if cache is None:
        ex = trace_excess(trace_spec, trace_setup, **kw)
    elif probe:
        ex = cache.probe(trace_spec, trace_setup, **kw)
    else:
        ex = cache.excess(trace_spec, trace_setup, **kw)
    # QLoRA's dequantisation temporaries are traced (_trace.SimLinear4bit); an 8-bit base is
    # traced as frozen linears of the load dtype.
    step = _step(spec, trace_spec, setup, ex, rs, stage, ref)
    view.add_to(step.phases)  # tensor parallelism's collectives, the CP mask (``parallel``)
    if stage == "eval":
        notes += _eval_logits_note(spec, setup, seq_len, target_len)
    rollout = rollout_phases(trace_spec, trace_setup, rs, seq_len=seq_len, held=ref[0],
                             target=target, cache=cache) if stage == "train" else {}
    notes += rollout_notes(setup, rollout)
    step.phases.update({k: v.total for k, v in rollout.items()})
    phase = max(step.phases, key=lambda k: step.phases[k])
    parts = rollout[phase].parts if phase in rollout else _breakdown(step, phase)
    phase_ex, phase_stage = (rollout[phase].excess, "eval") if phase in rollout else (ex, stage)
    terms = device_terms(dev, step.phases[phase], parts, om, runtime,
                         setup.parallel.total, ex=phase_ex, spec=trace_spec,
                         stage=phase_stage,
                         micro_steps=min(setup.grad_accum, 2) if phase_stage == "train" else 1,
                         model_states=rs.model_states, weights=rs.weights,
                         fit_budget=fit_budget, emulated=emulation_acts(spec, setup, ex))
    allocated, reserved, used, rel = terms.allocated, terms.reserved, terms.used, terms.rel_sigma
    notes += terms.notes + _kernel_note(ex, target, cudnn)
    vm, grown, phase, more = colocated_tenant(spec, setup, dev, seq_len=seq_len, held=ref[0],
                                              parts=parts, rs=rs, used=used, phase=phase) \
        if stage == "train" else (None, used, phase, [])
    terms.required += grown - used   # a colocated vLLM: not in torch's allocator, on the device
    used, notes = grown, notes + more
    if ex.host:
        notes.append(setup.trainer_kind.host_note(ex.host))
    if om.paged:  # in managed memory; only the step's pages count in device_used
        parts["optimizer_paged"] = om.paged
        parts["optimizer_paged_resident"] = om.paged_resident
    return MemoryEstimate(
        peak_allocated=int(allocated), peak_reserved=int(reserved), device_used=int(used),
        breakdown={k: int(v) for k, v in parts.items()}, peak_phase=phase, stage=stage,
        device=dev, setup=setup, seq_len=seq_len, uncertainty=rel, notes=notes,
        trace_seconds=ex.seconds, traced_layers=ex.layers, model_states=int(rs.model_states),
        host_offloaded=int(rs.host) + ex.host + technique_host_bytes(
            spec, setup, view.seq_len, device_kind=dev.kind, stage=stage),
        lower_bound=ex.lower_bound, cuda_version=runtime.version if runtime else None,
        margin=terms.margin, required=int(terms.required),
        required_at_least=terms.required_at_least, margin_terms=_shares(terms),
        phase_peaks={k: int(v) for k, v in step.phases.items()},
        refusals=list(vm.refusals) if vm is not None else [])
