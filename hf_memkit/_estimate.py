"""Predict a training (or eval) step's peak memory: ``estimate_memory`` -> ``MemoryEstimate``.

Model states (weights, gradients, optimizer state) are computed analytically from the parameter
list, so optimizers whose kernels cannot run on fake tensors (bitsandbytes) are still exact.
Activations and temporaries come from tracing the real model code on fake tensors (``_trace``);
models with more than ``FULL_TRACE_MAX_LAYERS`` blocks are traced at 2 and 3 blocks and
extrapolated linearly in the block count, so a 70B plan takes about a second. CUDA adds allocator
rounding and segments, the context and cuBLAS workspaces (``_cuda``).

The peak of a Trainer optimizer step (steady state, step >= 2):

    forward / backward, micro-step 1:  W + inputs + O + X          (X: activations, temporaries
    forward / backward, micro-step 2+: W + inputs + O + G + X'      and gradients being created)
    optimizer.step():                  W + inputs + G + O + T_opt
    (W weights, G gradients, O optimizer state, T_opt the optimizer's transient buffers)

Data-parallel engines (``_sharding``): W, G and O become one rank's shards, and the forward and
backward add the layers gathered at that moment (FSDP, ZeRO-3), one layer's unsharded gradients,
and persistent communication buckets (DDP, DeepSpeed). Activations are replicated: each rank
traces its own micro-batch, with the 16-bit weights the engine computes with.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import PretrainedConfig

from ._cuda import CALIBRATION, cublas_workspace
from ._device import DeviceInfo, resolve_device
from ._errors import HfMemkitError
from ._optimizers import OptimizerContext, ParamInfo, get_optimizer_profile
from ._profile import build_model, logical_numel, normalize_task, task_of_class, unwrap_model
from ._setup import Sharding, TrainingSetup, normalize_args
from ._sharding import model_facts, rank_states
from ._trace import LoraSpec, layer_count, quantizable_linears, trace_step, with_layers
from ._units import format_bytes

FULL_TRACE_MAX_LAYERS = 4
EXTRAPOLATE_AT = (2, 3)
BREAKDOWN_SUM_KEYS = ("weights", "gradients", "optimizer", "activations", "temporaries")
# CPU estimates: relative 1-sigma of the residuals of bench/estimator_cpu.py (26 real Trainer runs:
# std 0.22%, worst 0.97%), rounded up to 0.5% for architectures the bench does not cover.
CPU_REL_SIGMA = 0.005
# bitsandbytes NF4 (bitsandbytes/functional.py quantize_4bit): 2 weights per byte, one fp32
# absmax per 64-weight block; double quantization stores absmax as uint8 plus one fp32 per 256.
NF4_BLOCK = 64


@dataclass
class MemoryEstimate:
    """Predicted memory of one step. Bytes throughout; ``explain()`` renders it."""

    peak_allocated: int = field(metadata={"help": "Max live tensor bytes (max_memory_allocated)."})
    peak_reserved: int = field(metadata={"help": "Caching-allocator reserved at peak (CPU: = allocated)."})
    device_used: int = field(metadata={"help": "What NVML shows: reserved + context + workspaces."})
    breakdown: dict[str, int] = field(metadata={
        "help": "weights, gradients, optimizer, activations, temporaries (sum to peak_allocated); "
                "fragmentation, context; optimizer_paged when a paged optimizer keeps state in "
                "CUDA managed memory"})
    peak_phase: str = field(metadata={"help": "'forward', 'backward', 'forward (accumulating)', "
                                              "'backward (accumulating)', 'optimizer step' or "
                                              "'eval forward'."})
    stage: str = field(metadata={"help": "'train' or 'eval'."})
    device: DeviceInfo = field(repr=False, metadata={"help": "Device estimated for."})
    setup: TrainingSetup = field(repr=False, metadata={"help": "Normalised training arguments."})
    seq_len: int = field(default=0, metadata={"help": "Sequence length (the longest in a batch)."})
    uncertainty: float = field(default=0.0, metadata={"help": "Relative 1-sigma of device_used."})
    notes: list[str] = field(default_factory=list, metadata={"help": "What was assumed or noted."})
    model_states: int = field(default=0, metadata={
        "help": "Resident weights + gradients + optimizer state on this rank (sharded where the "
                "engine shards; DeepSpeed ZeRO-3 with its gathered largest module)."})
    host_offloaded: int = field(default=0, metadata={
        "help": "Bytes an offloading engine keeps in host memory for this rank."})
    trace_seconds: float = field(default=0.0, repr=False)
    traced_layers: tuple[int, ...] = field(default=(), repr=False)
    lower_bound: bool = field(default=False, repr=False, metadata={
        "help": "True when the planner only bounded this setup from below (it did not fit)."})

    @property
    def band(self) -> tuple[int, int]:
        """device_used +- 2 sigma (about a 95% band from the calibration residuals)."""
        d = 2 * self.uncertainty * self.device_used
        return int(self.device_used - d), int(self.device_used + d)

    def to_dict(self) -> dict[str, Any]:
        return {
            "peak_allocated": self.peak_allocated, "peak_reserved": self.peak_reserved,
            "device_used": self.device_used, "breakdown": dict(self.breakdown),
            "peak_phase": self.peak_phase, "stage": self.stage, "seq_len": self.seq_len,
            "uncertainty": self.uncertainty, "notes": list(self.notes),
            "model_states": self.model_states, "host_offloaded": self.host_offloaded,
            "device": self.device.to_dict(), "setup": dataclasses.asdict(self.setup),
        }

    def explain(self) -> str:
        from ._render import estimate_table, render_to_text

        return render_to_text(estimate_table(self))

    def __str__(self) -> str:
        return (f"MemoryEstimate({self.stage} on {self.device.name}: device_used "
                f"{format_bytes(self.device_used)}, peak_allocated {format_bytes(self.peak_allocated)}"
                f", peak in {self.peak_phase})")


# ----------------------------------------------------------------------------------------------
# the model as the estimator needs it
# ----------------------------------------------------------------------------------------------


@dataclass
class _ModelSpec:
    config: PretrainedConfig
    model_cls: type
    task: str
    dtype: torch.dtype                       # floating dtype of the (non-quantized) weights
    attn_implementation: str | None
    lora: LoraSpec | None
    quant_bits: int | None                   # 4 / 8 for a bitsandbytes base, else None
    double_quant: bool
    meta: torch.nn.Module                    # full model (with adapters) on the meta device
    supports_checkpointing: bool


def _quant_from(qc: Any) -> tuple[int | None, bool, torch.dtype | None]:
    if qc is None:
        return None, False, None
    get = qc.get if isinstance(qc, dict) else (lambda k, d=None: getattr(qc, k, d))
    if get("load_in_4bit", False):
        cd = get("bnb_4bit_compute_dtype", None)
        if isinstance(cd, str):
            cd = getattr(torch, cd.replace("torch.", ""))
        return 4, bool(get("bnb_4bit_use_double_quant", False)), cd
    if get("load_in_8bit", False):
        return 8, False, None
    raise HfMemkitError(
        "quantization_config must be a bitsandbytes config with load_in_4bit or load_in_8bit; "
        f"got {qc!r}")


def _resolve_model(model: Any, *, task: str | None, dtype: torch.dtype | str | None,
                   attn_implementation: str | None, peft_config: Any,
                   quantization_config: Any, meta_cache: dict | None = None) -> _ModelSpec:
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype.replace("torch.", ""), None) if dtype != "auto" else None
    quant_bits, double_quant, compute_dtype = _quant_from(quantization_config)
    lora_cfg = peft_config
    if isinstance(model, torch.nn.Module):
        base, is_peft = unwrap_model(model)
        config = base.config
        task = normalize_task(task, config) if task else task_of_class(type(base), config)
        floats = [p.dtype for p in base.parameters() if p.is_floating_point()
                  and type(p).__name__ not in ("Params4bit", "Int8Params")]
        dtype = dtype or (max(set(floats), key=floats.count) if floats else torch.float32)
        attn_implementation = attn_implementation or getattr(config, "_attn_implementation", None)
        if is_peft and lora_cfg is None:
            lora_cfg = next(iter(model.peft_config.values()))
        if quant_bits is None:
            kinds = {type(p).__name__ for p in base.parameters()}
            quant_bits = 4 if "Params4bit" in kinds else 8 if "Int8Params" in kinds else None
            qc = getattr(config, "quantization_config", None)
            if quant_bits and qc is not None:
                double_quant = bool(_quant_from(qc)[1]) if quant_bits == 4 else False
        model_cls = type(base)
    elif isinstance(model, (PretrainedConfig, str)) or hasattr(model, "__fspath__"):
        from ._profile import _to_config

        config = _to_config(model)
        task = normalize_task(task, config)
        model_cls = type(build_model(config, task))
        # A quantized base goes through peft's prepare_model_for_kbit_training (the standard
        # QLoRA recipe, and what Plan.prepare does): every non-quantized bf16/fp16 parameter
        # (embeddings, head, norms) is upcast to fp32, and adapters are fp32.
        dtype = dtype or torch.float32
    else:
        raise HfMemkitError(
            "estimate_memory takes a transformers model (any device, meta included), a "
            f"PretrainedConfig, a catalog name or a local directory; got {type(model).__name__}")
    if quant_bits and lora_cfg is None:
        raise HfMemkitError(
            f"a {quant_bits}-bit base cannot be trained directly; give `peft_config` "
            "(a peft.LoraConfig) for QLoRA, or drop quantization_config")
    key = (model_cls, id(config), dtype, attn_implementation, repr(lora_cfg))
    if meta_cache is not None and key in meta_cache:
        meta = meta_cache[key]  # the planner's LoRA rungs share one meta model
    else:
        meta = _meta_model(model_cls, config, dtype, attn_implementation, lora_cfg)
        if meta_cache is not None:
            meta_cache[key] = meta
    lora = LoraSpec(lora_cfg, quantized_4bit=quant_bits == 4,
                    compute_dtype=compute_dtype or torch.bfloat16) if lora_cfg is not None else None
    return _ModelSpec(config, model_cls, task, dtype, attn_implementation, lora, quant_bits,
                      double_quant, meta, bool(getattr(model_cls, "supports_gradient_checkpointing",
                                                       False)))


def _meta_model(model_cls: type, config: PretrainedConfig, dtype: torch.dtype,
                attn: str | None, lora_cfg: Any) -> torch.nn.Module:
    kwargs: dict[str, Any] = {"dtype": dtype}
    if attn:
        kwargs["attn_implementation"] = attn
    with torch.device("meta"):
        m = model_cls._from_config(copy.deepcopy(config), **kwargs)
        if lora_cfg is not None:
            import peft

            m = peft.get_peft_model(m, copy.deepcopy(lora_cfg))
    return m


def _learned_positions(model: torch.nn.Module) -> int | None:
    """Longest sequence a model with a learned absolute position table can take (None: rotary,
    relative or other schemes without a hard limit). OPT/RoBERTa tables carry an offset of 2."""
    limit = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Embedding) and ("pos" in name.split(".")[-1] or
                                                  name.endswith("wpe")):
            return int(limit) if limit else m.num_embeddings
    return None


def _model_states(spec: _ModelSpec) -> tuple[int, list[ParamInfo]]:
    """(weight bytes incl. buffers and quantization constants, trainable params); memoised on
    the spec (a plan asks for it once per candidate)."""
    cached = getattr(spec, "_states", None)
    if cached is None:
        cached = spec._states = _compute_model_states(spec)
    return cached


def _compute_model_states(spec: _ModelSpec) -> tuple[int, list[ParamInfo]]:
    weights = 0
    quantized: set[int] = set()
    if spec.quant_bits:
        base = spec.meta.get_base_model() if hasattr(spec.meta, "get_base_model") else spec.meta
        for _name, mod in quantizable_linears(base):
            quantized.add(id(mod.weight))
            n = mod.weight.numel()
            if spec.quant_bits == 4:
                blocks = -(-n // NF4_BLOCK)
                absmax = (blocks + 4 * -(-blocks // 256)) if spec.double_quant else 4 * blocks
                weights += -(-n // 2) + absmax
            else:  # LLM.int8: int8 weight + fp32 row scale
                weights += n + 4 * mod.weight.shape[0]
    embeddings = {id(m.weight) for m in spec.meta.modules() if isinstance(m, torch.nn.Embedding)}
    trainable: list[ParamInfo] = []
    for p in spec.meta.parameters():
        if id(p) in quantized:
            continue
        weights += logical_numel(p) * p.element_size()
        if p.requires_grad:
            trainable.append(ParamInfo(p.numel(), tuple(p.shape), p.element_size(),
                                       embedding=id(p) in embeddings))
    weights += sum(b.numel() * b.element_size() for b in spec.meta.buffers())
    return weights, trainable


# ----------------------------------------------------------------------------------------------
# activations: trace, extrapolate
# ----------------------------------------------------------------------------------------------


@dataclass
class _Excess:
    """What each phase of a step adds on top of weights + inputs (+ gradients when
    accumulating), from the trace, extrapolated to full depth."""

    phases: dict[str, int]                 # forward, backward, [forward_accum, backward_accum]
    categories: dict[str, dict[str, int]]  # per phase: Activation, Temp, Gradient at its peak
    inputs: int
    seconds: float
    layers: tuple[int, ...]
    lower_bound: bool = False              # extrapolated in the micro-batch (TraceCache)


def _trace_excess(spec: _ModelSpec, setup: TrainingSetup, *, seq_len: int, stage: str,
                  target_len: int | None, padded: bool) -> _Excess:
    full = layer_count(spec.config)
    batch = setup.micro_batch if stage == "train" else setup.eval_batch
    kw = dict(task=spec.task, micro_batch=batch, seq_len=seq_len, grad_accum=setup.grad_accum,
              amp=setup.amp, dtype=spec.dtype, attn_implementation=spec.attn_implementation,
              checkpointing=setup.checkpointing and stage == "train",
              checkpoint_reentrant=setup.checkpoint_reentrant, lora=spec.lora, stage=stage,
              target_len=target_len, padded=padded)

    def excess(n: int):
        cfg = spec.config if n == full else with_layers(spec.config, n)
        r = trace_step(spec.model_cls, cfg, **kw)
        out = {}
        for name, total in r.phases.items():
            held = r.weights + r.inputs + (r.grads if name.endswith("_accum") else 0)
            out[name] = total - held
        cats = {name: {k: c.get(k, 0) for k in ("Activation", "Temp", "Gradient")}
                for name, c in r.categories.items()}
        return out, cats, r.inputs, r.seconds

    if full <= FULL_TRACE_MAX_LAYERS or setup.checkpoint_every_n_layers > 1:
        ph, cats, inp, secs = excess(full)
        return _Excess(ph, cats, inp, secs, (full,))
    k1, k2 = EXTRAPOLATE_AT
    ph1, c1, inp, s1 = excess(k1)
    ph2, c2, _, s2 = excess(k2)
    scale = (full - k1) / (k2 - k1)

    def lin(x1: float, x2: float) -> int:
        return int(round(x1 + (x2 - x1) * scale))

    phases = {k: lin(ph1[k], ph2[k]) for k in ph1}
    cats = {k: {c: max(0, lin(c1[k][c], c2[k][c])) for c in c1[k]} for k in c1}
    return _Excess(phases, cats, inp, s1 + s2, (k1, k2))


# ----------------------------------------------------------------------------------------------
# estimate_memory
# ----------------------------------------------------------------------------------------------


def estimate_memory(model: Any, args: Any = None, *, seq_len: int, device: Any = None,
                    stage: str = "train", task: str | None = None, target_len: int | None = None,
                    dtype: torch.dtype | str | None = None, attn_implementation: str | None = None,
                    peft_config: Any = None, quantization_config: Any = None,
                    padded: bool = False, num_gpus: int | None = None,
                    sharding: Sharding | None = None) -> MemoryEstimate:
    """Predict the peak memory of one training (``stage="train"``) or eval step.

    ``model``: a model on any device (meta included; a peft model is LoRA), a
    ``PretrainedConfig``, a catalog name or a local directory. ``args``: ``TrainingArguments`` or a
    dict of its fields. ``seq_len``: the longest sequence of a batch (a padded batch peaks there).
    ``task`` picks the head for a config; ``target_len`` is the label length of seq2seq (default
    ``seq_len``). ``dtype``: the dtype weights are loaded in (``torch.bfloat16`` = "pure" bf16
    training; default: the model's, fp32 for a config). ``peft_config`` / ``quantization_config``:
    LoRA / QLoRA as ``Plan.model_kwargs`` would load it. ``padded``: batches carry a real attention
    mask (dynamic padding). ``device``: DeviceInfo, catalog name, ``"cpu"``, or None (this machine).
    ``num_gpus``: data-parallel ranks; with ``fsdp``/``fsdp_config`` or ``deepspeed`` in ``args``
    the estimate is one rank's (FSDP2 / ZeRO shards, gathered layers, buckets), otherwise DDP.
    """
    problems = []
    if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len <= 0:
        problems.append(f"seq_len must be a positive integer, got {seq_len!r}")
    if stage not in ("train", "eval"):
        problems.append(f"stage must be 'train' or 'eval', got {stage!r}")
    if target_len is not None and (not isinstance(target_len, int) or target_len <= 0):
        problems.append(f"target_len must be a positive integer, got {target_len!r}")
    if problems:
        from ._errors import ConfigError

        raise ConfigError(problems, source="estimate_memory")
    setup = normalize_args(args, source="args", num_gpus=num_gpus)
    if sharding is not None:
        setup = setup.replace(sharding=sharding)
    dev = resolve_device(device)
    spec = _resolve_model(model, task=task, dtype=dtype, attn_implementation=attn_implementation,
                          peft_config=peft_config, quantization_config=quantization_config)
    return estimate_for(spec, setup, dev, seq_len=seq_len, stage=stage, target_len=target_len,
                        padded=padded)


class TraceCache:
    """Memoised traces for many estimates of one model (the planner's search).

    A phase's peak is the max over the moments of the step of memory that is linear in the
    micro-batch (activations are batch-major; weight-sized temporaries are constant), so it is
    convex and piecewise linear in the batch: e.g. the start of the backward grows with the batch
    while its end is dominated by gradients. A line through the traces at micro-batch 1 and 2,
    extended to a larger batch, is therefore a *lower bound* (convexity): the planner uses it to
    reject setups cheaply, and traces the exact batch (``exact=True``) before accepting one.
    One trace per (model, precision, checkpointing, sequence, batch); optimizers, engines and
    accumulation share it.
    """

    def __init__(self) -> None:
        self._store: dict[tuple, _Excess] = {}

    def excess(self, spec: _ModelSpec, setup: TrainingSetup, *, seq_len: int, stage: str,
               target_len: int | None, padded: bool, exact: bool = True) -> _Excess:
        # traced with two micro-steps: one trace serves accumulating and non-accumulating setups
        # (the accumulating phases are dropped when grad_accum == 1)
        accumulating = stage == "train" and setup.grad_accum > 1
        batch = setup.micro_batch if stage == "train" else setup.eval_batch
        key = (_trace_identity(spec), stage, setup.amp, setup.checkpointing,
               setup.checkpoint_reentrant, setup.checkpoint_every_n_layers, seq_len, target_len,
               padded)

        def at(b: int) -> _Excess:
            k = key + (b,)
            if k not in self._store:
                s = setup.replace(micro_batch=b, eval_batch=b,
                                  grad_accum=2 if stage == "train" else 1)
                self._store[k] = _trace_excess(spec, s, seq_len=seq_len, stage=stage,
                                               target_len=target_len, padded=padded)
            return self._store[k]

        if exact or batch <= 2 or key + (batch,) in self._store:
            e = at(batch)
        else:  # lower bound (see the class docstring)
            e1, e2 = at(1), at(2)
            m = batch - 1

            def lin(x1: int, x2: int) -> int:
                return int(x1 + (x2 - x1) * m)

            e = _Excess({k: lin(e1.phases[k], e2.phases[k]) for k in e1.phases},
                        {p: {c: max(0, lin(e1.categories[p][c], e2.categories[p][c]))
                             for c in e1.categories[p]} for p in e1.categories},
                        lin(e1.inputs, e2.inputs), 0.0, e1.layers, lower_bound=True)
        if stage == "train":  # the Trainer prefetches all micro-batches of a step
            phases = e.phases if accumulating else {
                p: v for p, v in e.phases.items() if not p.endswith("_accum")}
            e = _Excess(phases, e.categories, e.inputs // 2 * setup.grad_accum, e.seconds,
                        e.layers, e.lower_bound)
        return e


def estimate_for(spec: _ModelSpec, setup: TrainingSetup, dev: DeviceInfo, *, seq_len: int,
                 stage: str = "train", target_len: int | None = None, padded: bool = False,
                 cache: TraceCache | None = None, exact: bool = True) -> MemoryEstimate:
    """``estimate_memory`` for an already resolved model and setup (the planner's entry).
    ``exact=False`` with a cache may return a lower bound (``MemoryEstimate.lower_bound``)."""
    notes: list[str] = []
    if setup.checkpointing and not spec.supports_checkpointing:
        raise HfMemkitError(
            f"{spec.model_cls.__name__} does not support gradient checkpointing; set "
            "activation_checkpointing=False (and use a smaller micro-batch or another memory "
            "saver instead)")
    learned = _learned_positions(spec.meta)
    if learned and seq_len > learned:
        raise HfMemkitError(f"seq_len {seq_len} exceeds this model's learned position "
                            f"embeddings ({learned}); use seq_len <= {learned}")
    if setup.amp == "bf16" and dev.kind == "cuda" and not dev.supports_bf16:
        notes.append(f"{dev.name} has no bf16 tensor cores (compute capability "
                     f"{dev.compute_capability}); bf16 runs emulated and slow")
    if setup.tf32:
        notes.append("tf32 changes matmul precision only; no memory effect")
    notes.extend(f"not modelled: {u}" for u in setup.unmodelled)

    weights, trainable = _model_states(spec)
    sh = setup.sharding
    opt_profile = get_optimizer_profile(setup.optim)
    om = opt_profile.estimate(trainable, OptimizerContext(device_kind=dev.kind,
                                                          optim_args=setup.optim_args))
    rs = rank_states(sh, weight_bytes=weights, grad_bytes=sum(p.nbytes for p in trainable),
                     n_trainable=sum(p.numel for p in trainable), optimizer_state=om.state,
                     optimizer_transient=om.transient,
                     facts=_facts(spec) if sh.engine in ("fsdp", "deepspeed") else None,
                     device_kind=dev.kind, load_itemsize=spec.dtype.itemsize)
    W, G, O, T_opt, B = (rs.weights, rs.gradients, rs.optimizer,  # noqa: E741
                         rs.optimizer_transient, rs.buckets)
    notes.extend(setup.notes)
    if sh.engine != "none":
        notes.append(f"per rank of {sh.label()}")
        notes.extend(rs.notes)
    if sh.engine == "fsdp" and dev.kind != "cuda":
        notes.append("FSDP through the Trainer needs CUDA: on a CPU, accelerate drops the FSDP "
                     "plugin and the Trainer silently trains DDP replicas; this estimate is for "
                     "FSDP2 applied directly (fully_shard / accelerate's fsdp2_prepare_model)")
    if rs.host:
        notes.append(f"{format_bytes(rs.host)} per rank offloaded to host (CPU) memory")
    if om.paged:
        notes.append(f"{format_bytes(om.paged)} of paged optimizer state lives in CUDA managed "
                     "memory (outside max_memory_allocated; NVML counts it while resident)")

    trace_spec, trace_setup = _trace_variant(spec, setup)
    if cache is not None:
        ex = cache.excess(trace_spec, trace_setup, seq_len=seq_len, stage=stage,
                          target_len=target_len, padded=padded, exact=exact)
    else:
        ex = _trace_excess(trace_spec, trace_setup, seq_len=seq_len, stage=stage,
                           target_len=target_len, padded=padded)
    # QLoRA's dequantisation temporaries are traced (_trace.SimLinear4bit); an 8-bit base is
    # traced as frozen linears of the load dtype.
    inputs = ex.inputs
    xp = dict(ex.phases)
    grads_sharded = sh.engine == "fsdp" or (sh.engine == "deepspeed" and sh.stage >= 2)
    # gradients made during the backward are reduce-scattered layer by layer: one rank keeps
    # its shard, in the dtype of its sharded parameters (G per full set, offloaded: none)
    traced_total = sum(p.numel for p in trainable) * trace_spec.dtype.itemsize \
        if trace_spec is not spec else sum(p.nbytes for p in trainable)
    grad_factor = G / traced_total if grads_sharded and traced_total else 1.0
    if grads_sharded:
        for key in ("backward", "backward_accum"):
            if key in xp:
                traced = ex.categories.get(key, {}).get("Gradient", 0)
                xp[key] += int(traced * grad_factor) - traced
    gf, gb, gbuf = rs.gathered_forward, rs.gathered_backward, rs.grad_buffers
    G_acc = G if rs.accum_gradients is None else rs.accum_gradients
    # one value per phase of the step: what is alive at that phase's peak
    if stage == "train":
        phases = {"forward": W + inputs + O + B + gf + xp["forward"],
                  "backward": W + inputs + O + B + gb + gbuf + xp["backward"],
                  "optimizer step": W + inputs + G + O + B + T_opt}
        if "forward_accum" in xp:
            phases["forward (accumulating)"] = W + inputs + O + B + G_acc + gf + xp["forward_accum"]
            phases["backward (accumulating)"] = (W + inputs + O + B + G_acc + gb + gbuf
                                                 + xp["backward_accum"])
    else:
        phases = {"eval forward": W + inputs + O + B + gf + xp["eval"]}
        vocab = getattr(spec.config.get_text_config(), "vocab_size", None)
        if not setup.prediction_loss_only and vocab and spec.task in ("causal-lm", "seq2seq-lm",
                                                                      "masked-lm"):
            per_step = setup.eval_batch * (target_len or seq_len) * vocab * 4
            every = setup.eval_accumulation_steps
            notes.append(
                f"the evaluation loop keeps each batch's logits ({format_bytes(per_step)} per "
                "eval step) on the device " + (f"for {every} steps before moving them to the CPU"
                                               if every else "until the evaluation ends") +
                "; set prediction_loss_only=True or eval_accumulation_steps to bound it")
    phase = max(phases, key=lambda k: phases[k])
    peak = phases[phase]

    trace_key = {"forward": "forward", "backward": "backward", "eval forward": "eval",
                 "forward (accumulating)": "forward_accum",
                 "backward (accumulating)": "backward_accum"}.get(phase)
    cats = ex.categories.get(trace_key, {}) if trace_key else {}
    grads_now = {"optimizer step": G, "forward (accumulating)": G_acc,
                 "backward (accumulating)": G_acc}.get(phase, 0)
    if phase.startswith("backward"):
        grads_now += gbuf
    if phase in ("forward", "backward", "eval forward"):
        traced = cats.get("Gradient", 0)
        grads_now += int(traced * grad_factor) if phase == "backward" else traced
    gathered = gb if phase.startswith("backward") else 0 if phase == "optimizer step" else gf
    parts = {"weights": W + gathered, "gradients": grads_now + B, "optimizer": O,
             "activations": cats.get("Activation", 0)}
    parts["temporaries"] = peak - sum(parts.values())
    if parts["temporaries"] < 0:  # extrapolated categories can overshoot by a few bytes
        parts["activations"] += parts["temporaries"]
        parts["temporaries"] = 0

    if dev.kind == "cuda":
        cal = CALIBRATION
        workspace = cublas_workspace(dev.compute_capability) + cal.alloc_const
        peak_allocated = peak + workspace
        parts["temporaries"] += workspace
        frag = int(cal.frag_ratio * peak_allocated + cal.frag_const)
        peak_reserved = peak_allocated + frag
        context = cal.context
        device_used = peak_reserved + context + om.paged
        rel = cal.rel_sigma
        notes.append("CUDA: cuBLAS workspaces, allocator fragmentation and context from the "
                     "anchor calibration (bench/estimator_gpu_anchors.py)")
    else:
        peak_allocated = peak_reserved = device_used = peak
        frag = context = 0
        rel = CPU_REL_SIGMA
    breakdown = dict(parts)
    breakdown["fragmentation"] = frag
    breakdown["context"] = context
    if om.paged:
        breakdown["optimizer_paged"] = om.paged
    return MemoryEstimate(
        peak_allocated=int(peak_allocated), peak_reserved=int(peak_reserved),
        device_used=int(device_used), breakdown={k: int(v) for k, v in breakdown.items()},
        peak_phase=phase, stage=stage, device=dev, setup=setup, seq_len=seq_len,
        uncertainty=rel, notes=notes, trace_seconds=ex.seconds, traced_layers=ex.layers,
        model_states=int(rs.model_states), host_offloaded=int(rs.host),
        lower_bound=ex.lower_bound,
    )


def _trace_identity(spec: _ModelSpec) -> tuple:
    """What a trace depends on (memoised): specs built separately for the same model, dtype,
    attention and adapters share traces (e.g. pure bf16 and FSDP's 16-bit gathers)."""
    ident = spec.__dict__.get("_trace_identity")
    if ident is None:
        ident = spec._trace_identity = (
            spec.model_cls, spec.config.to_json_string(use_diff=False), spec.task, spec.dtype,
            spec.attn_implementation, repr(spec.lora), spec.quant_bits)
    return ident


def _facts(spec: _ModelSpec):
    """Layer structure for sharding (memoised on the spec)."""
    cached = getattr(spec, "_facts", None)
    if cached is None:
        cached = spec._facts = model_facts(spec.meta)
    return cached


def _trace_variant(spec: _ModelSpec, setup: TrainingSetup) -> tuple[_ModelSpec, TrainingSetup]:
    """What each rank computes with. FSDP2 with mixed precision gathers 16-bit parameters
    (accelerate's MixedPrecisionPolicy) and the Trainer adds no autocast on that path
    (``Accelerator.prepare`` skips ``prepare_model`` for FSDP2); DeepSpeed in 16-bit keeps the
    model itself in 16-bit, without autocast. Either way: a 16-bit model, no autocast copies."""
    sh = setup.sharding
    if (sh.engine not in ("fsdp", "deepspeed") or not setup.amp
            or spec.dtype != torch.float32 or spec.quant_bits):
        return spec, setup
    half = torch.bfloat16 if setup.amp == "bf16" else torch.float16
    variants = spec.__dict__.setdefault("_half", {})
    if half not in variants:
        variants[half] = dataclasses.replace(spec, dtype=half)
    return variants[half], setup.replace(amp=None)
