"""One estimate put together, as ``estimate_memory`` and the planner make it (``estimate_for``).

It reads as its steps: the rank (``_rank``: checks, the adapters in the trainer's dtype, the
rank's model and tokens under tensor / context / sequence parallelism, its model states and a
reference model), the trace of its micro-steps (``activations``), the step's phases
(``phases``) with those of the trainer's own besides them (``TrainerKind.rollout``: online RL's
generation and scoring), the peak judged as CUDA would hold it (``device``), and another engine
on the device beside the trainer (``TrainerKind.tenant``: a colocated vLLM). Nothing here names
a trainer or an engine: what differs is read through their registry entries.

Two sequence lengths meet here: ``seq_len`` is a whole sequence (what a rollout generates
after, what the checks and the eval logits are about); ``rank.seq_len`` is one rank's share of
it under context or sequence parallelism (what the trace runs).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from .._cuda.allocator import AllocatorConfig
from .._cuda.runtime import CudaRuntime, cuda_runtime
from .._cuda.target import CudaTarget, this_torch_cudnn
from .._device.precision import precision_issues
from .._device.probe import DeviceInfo
from .._engines import RankStates
from .._errors import HfMemkitError
from .._model.spec import ModelSpec
from .._model.tasks import TASKS
from .._optimizers import OptimizerMemory
from .._setup.setup import TrainingSetup
from .._techniques import TECHNIQUES
from .._trainers import RolloutPhase
from .._units import format_bytes
from .activations import Excess, TraceCache, trace_excess
from .budget import backend_notes
from .device import DeviceTerms, device_terms
from .parallel import RankView, rank_view
from .phases import (
    Step,
    breakdown,
    reference_note,
    reference_share,
    state_notes,
    states_for,
    step_phases,
    technique_host_bytes,
    trace_variant,
    trained_spec,
)
from .result import MemoryEstimate


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


@dataclass
class _Rank:
    """One rank of the estimate before anything is traced: its model (adapters in the
    trainer's dtype, narrowed by tensor parallelism), its tokens per sequence (``seq_len``),
    model states, a reference model's share and the notes so far."""

    spec: ModelSpec
    view: RankView
    rs: RankStates
    om: OptimizerMemory
    ref: tuple[int, int]     # (held through the step, gathered for its forward)
    notes: list[str]

    @property
    def seq_len(self) -> int:
        return self.view.seq_len


def _rank(spec: ModelSpec, setup: TrainingSetup, dev: DeviceInfo, *, seq_len: int, stage: str,
          padded: bool, seq_name: str) -> _Rank:
    notes = check_setup(spec, setup, dev, seq_len, seq_name)
    cast = trained_spec(spec, setup)
    if cast is not spec:
        notes.append(setup.trainer_kind.adapter_note(cast.lora.adapter_dtype))
        spec = cast
    view = rank_view(spec, setup, seq_len, dev.kind, padded)  # TP / CP / SP: one rank's share
    notes += view.notes
    rs, om = states_for(view.spec, setup, dev)
    if stage == "forward_backward":  # a custom loop: no optimizer, so no optimizer state
        rs = dataclasses.replace(rs, optimizer=0, optimizer_transient=0)
        om = dataclasses.replace(om, state=0, transient=0, paged=0, paged_resident=0)
    notes += state_notes(setup, rs, om, dev)
    ref = reference_share(view.spec, setup)
    return _Rank(view.spec, view, rs, om, ref, notes + reference_note(ref))


def _traced(spec: ModelSpec, setup: TrainingSetup, seq_len: int, *, stage: str,
            target_len: int | None, padded: bool, target: CudaTarget | None,
            cache: TraceCache | None, probe: bool) -> Excess:
    """The traced excess of one rank's micro-steps (a forward-only probe with ``probe``)."""
    kw = dict(seq_len=seq_len, stage=stage, target_len=target_len, padded=padded, target=target)
    if cache is None:
        return trace_excess(spec, setup, **kw)
    return cache.probe(spec, setup, **kw) if probe else cache.excess(spec, setup, **kw)


def _rollout(spec: ModelSpec, setup: TrainingSetup, rank: _Rank, *, seq_len: int,
             target: CudaTarget | None, cache: TraceCache | None) -> dict[str, RolloutPhase]:
    """The trainer's phases besides its train micro-steps (``TrainerKind.rollout``), each an
    eval trace at the whole ``seq_len`` (the longest prompt)."""
    def trace(phase_setup: TrainingSetup) -> Excess:
        return _traced(spec, phase_setup, seq_len, stage="eval", target_len=None, padded=False,
                       target=target, cache=cache, probe=False)

    return setup.trainer_kind.rollout(spec, setup, rank.rs, held=rank.ref[0], trace=trace)


@dataclass
class _Peak:
    """The step's peak phase, its breakdown and how CUDA holds it."""

    phase: str
    parts: dict[str, int]
    terms: DeviceTerms
    phases: dict[str, int]   # every phase's total (the rollout's included)


def _peak(step: Step, rollout: dict[str, RolloutPhase], rank: _Rank, dev: DeviceInfo,
          runtime: CudaRuntime | None, *, spec: ModelSpec, setup: TrainingSetup, stage: str,
          fit_budget: int | None, emulated: bool,
          allocator: AllocatorConfig | None = None) -> _Peak:
    """The largest phase (a rollout phase included), its breakdown, and the device terms of
    its allocation stream (``device.device_terms``)."""
    step.phases.update({k: v.total for k, v in rollout.items()})
    phase = max(step.phases, key=lambda k: step.phases[k])
    parts = rollout[phase].parts if phase in rollout else breakdown(step, phase)
    ex, ex_stage = (rollout[phase].excess, "eval") if phase in rollout else (step.excess, stage)
    terms = device_terms(dev, step.phases[phase], parts, rank.om, runtime,
                         setup.parallel.total, ex=ex, spec=spec, stage=ex_stage,
                         micro_steps=min(setup.grad_accum, 2) if ex_stage == "train" else 1,
                         model_states=rank.rs.model_states, weights=rank.rs.weights,
                         fit_budget=fit_budget, emulated=emulated, allocator=allocator)
    return _Peak(phase, parts, terms, step.phases)


def estimate_for(spec: ModelSpec, setup: TrainingSetup, dev: DeviceInfo, *, seq_len: int,
                 stage: str = "train", target_len: int | None = None, padded: bool = False,
                 cache: TraceCache | None = None,
                 probe: bool = False, cuda_version: str | None = None,
                 fit_budget: int | None = None, seq_name: str = "seq_len",
                 allocator: AllocatorConfig | None = None) -> MemoryEstimate:
    """``estimate_memory`` for an already resolved model and setup (the planner's entry).

    Args:
        spec, setup, dev: the model, the training setup and the target device, resolved.
        seq_len: the longest whole sequence of a batch (a rank of context or sequence
            parallelism traces its share of it).
        stage, target_len, padded, cuda_version: as ``estimate_memory`` takes them.
        cache: the traces kept for the planner; ``probe=True`` with a cache bounds a train
            step from its forward alone (``MemoryEstimate.lower_bound``).
        fit_budget: the budget the planner judges by, so the smallest-capacity search runs
            only where the verdict depends on it (``device.device_terms``).
        seq_name: the argument ``seq_len`` came from (``max_length``), named by its errors.
        allocator: the caching allocator's options to replay with (default: the
            environment's ``PYTORCH_CUDA_ALLOC_CONF``).

    Returns:
        The ``MemoryEstimate`` of one rank's step.
    """
    runtime = cuda_runtime(cuda_version) if dev.kind == "cuda" else None
    target, cudnn = cuda_target(dev, runtime)
    rank = _rank(spec, setup, dev, seq_len=seq_len, stage=stage, padded=padded,
                 seq_name=seq_name)
    notes = rank.notes
    trace_spec, trace_setup = trace_variant(rank.spec, setup)
    # QLoRA's dequantisation temporaries are traced (_trace.SimLinear4bit); an 8-bit base is
    # traced as frozen linears of the load dtype.
    ex = _traced(trace_spec, trace_setup, rank.seq_len, stage=stage, target_len=target_len,
                 padded=padded, target=target, cache=cache, probe=probe)
    step = step_phases(rank.spec, trace_spec, setup, ex, rank.rs, stage, rank.ref)
    rank.view.add_to(step.phases)  # tensor parallelism's collectives, the CP mask (``parallel``)
    if stage == "eval":
        notes += _eval_logits_note(rank.spec, setup, seq_len, target_len)
    rollout = _rollout(trace_spec, trace_setup, rank, seq_len=seq_len, target=target,
                       cache=cache) if stage == "train" else {}
    notes += setup.trainer_kind.rollout_notes(setup, rollout)
    peak = _peak(step, rollout, rank, dev, runtime, spec=trace_spec, setup=setup, stage=stage,
                 fit_budget=fit_budget, emulated=emulation_acts(rank.spec, setup, ex),
                 allocator=allocator)
    notes += peak.terms.notes + _kernel_note(ex, target, cudnn)
    return _result(rank, setup, dev, peak, ex, runtime, notes, seq_len=seq_len, stage=stage)


def _result(rank: _Rank, setup: TrainingSetup, dev: DeviceInfo, peak: _Peak, ex: Excess,
            runtime: CudaRuntime | None, notes: list[str], *, seq_len: int,
            stage: str) -> MemoryEstimate:
    """The estimate of ``peak``, with another engine on the device beside the trainer
    (``TrainerKind.tenant``, a train step's) and the bytes kept on the host."""
    terms, parts, phase, used = peak.terms, peak.parts, peak.phase, peak.terms.used
    tenant = setup.trainer_kind.tenant(
        rank.spec, setup, dev, seq_len=seq_len, held=rank.ref[0], parts=parts, rs=rank.rs,
        used=used, phase=phase) if stage == "train" else None
    if tenant is not None:   # not in torch's allocator, but on the device
        parts[tenant.key] = tenant.nbytes
        terms.required += tenant.used - used
        used, phase = tenant.used, tenant.phase
        notes += tenant.notes
    if ex.host:
        notes.append(setup.trainer_kind.host_note(ex.host))
    om = rank.om
    if om.paged:  # in managed memory; only the step's pages count in device_used
        parts["optimizer_paged"] = om.paged
        parts["optimizer_paged_resident"] = om.paged_resident
    host = int(rank.rs.host) + ex.host + technique_host_bytes(
        rank.spec, setup, rank.seq_len, device_kind=dev.kind, stage=stage)
    return MemoryEstimate(
        peak_allocated=int(terms.allocated), peak_reserved=int(terms.reserved),
        device_used=int(used), breakdown={k: int(v) for k, v in parts.items()},
        peak_phase=phase, stage=stage, device=dev, setup=setup, seq_len=seq_len,
        uncertainty=terms.rel_sigma, notes=notes, trace_seconds=ex.seconds,
        traced_layers=ex.layers, model_states=int(rank.rs.model_states), host_offloaded=host,
        lower_bound=ex.lower_bound, cuda_version=runtime.version if runtime else None,
        margin=terms.margin, required=int(terms.required),
        required_at_least=terms.required_at_least, margin_terms=_shares(terms),
        phase_peaks={k: int(v) for k, v in peak.phases.items()},
        refusals=tenant.refusals if tenant is not None else [],
        trained_dtype=_trained_dtype(rank.spec))


def _trained_dtype(spec: ModelSpec) -> str:
    """The dtype of the trained weights (and so of their gradients and the optimizer's copy):
    the first trainable parameter's; '' with none."""
    p = next((p for p in spec.meta.parameters() if p.requires_grad), None)
    return "" if p is None else str(p.dtype).removeprefix("torch.")
