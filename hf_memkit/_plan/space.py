"""The search space: every candidate setup (method x data-parallel rung x precision x optimizer x
searched techniques x micro-batch), the model spec of each, and their attention kernel."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import PretrainedConfig

from .._compat import is_flash_attn_available
from .._device.probe import DeviceInfo
from .._engines import ENGINES, ParallelDims, Rung, all_rungs, engine_problems
from .._engines.single import SINGLE as SINGLE_ENGINE
from .._errors import HfMemkitError
from .._estimate import MemoryEstimate
from .._methods import Method
from .._model.spec import ModelSpec, resolve_model
from .._optimizers import get_optimizer_profile, planner_optimizers
from .._setup.fields import training_args_fields
from .._techniques import TECHNIQUES, Technique, searched
from .._techniques.checkpointing import NAME as CHECKPOINTING
from .lengths import padding_free_choices
from .request import PlanRequest

SINGLE = Rung("single", "1 GPU", SINGLE_ENGINE.name)
PINNED = Rung("pinned", "pinned engine", SINGLE_ENGINE.name)  # the user's own engine pins


def rung_of(name: str) -> Rung:
    """The rung a candidate names (``Candidate.parallel``), its sequence split included
    (``Rung.split``: ``fsdp-full+cp8``)."""
    base, _, tag = name.partition("+")
    rung = {SINGLE.name: SINGLE, PINNED.name: PINNED}.get(base) or all_rungs()[base]
    return rung.split(ParallelDims.from_split_tag(tag)) if tag else rung


# The allocator option of the planner's expandable-segments rung (``Search._expandable``): freed
# pages are mapped into one growing segment per stream, so the step's fragmentation mostly goes.
EXPANDABLE = "expandable_segments:True"


@dataclass
class Candidate:
    """One setup the planner considered."""

    method: str                      # full | lora | lora-8bit | qlora (_methods)
    precision: str                   # bf16 | fp16 | fp32 (AMP) | pure-bf16
    optim: str
    checkpointing: bool
    micro_batch: int
    grad_accum: int
    attn: str
    rel_time: float | None           # predicted time per sample, relative to the chosen one
                                     # (None: a method the search never reached, not priced)
    device_used: int | None = None   # None: not estimated (see reason)
    peak_allocated: int | None = None
    fits: bool = False
    chosen: bool = False
    reason: str = ""
    estimate: MemoryEstimate | None = field(default=None, repr=False)
    parallel: str = "single"         # a Rung name: single | pinned | ddp | fsdp-* | zero*
    techniques: tuple[str, ...] = ()  # searched techniques that are on (_techniques)
    padding_free: bool = False        # SFT rows flattened into one (_plan.lengths)
    allocator: str = ""               # PYTORCH_CUDA_ALLOC_CONF options the setup is planned
                                      # with (the expandable-segments rung: EXPANDABLE)

    def __post_init__(self) -> None:
        if self.checkpointing and CHECKPOINTING not in self.techniques:
            self.techniques = tuple(sorted((*self.techniques, CHECKPOINTING)))
        self.techniques = tuple(self.techniques)

    def label(self) -> str:
        parts = [self.method, self.precision, self.optim]
        if self.parallel != "single":
            parts.insert(0, rung_of(self.parallel).label)
        parts += [TECHNIQUES.get(t).display for t in self.techniques]
        parts += ["padding-free"] if self.padding_free else []
        parts += ["expandable segments"] if self.allocator else []
        parts.append(f"micro-batch {self.micro_batch} x {self.grad_accum}")
        return ", ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "estimate"}
        d["techniques"] = list(self.techniques)
        d["estimate"] = self.estimate.to_dict() if self.estimate else None
        return d


def precisions(dev: DeviceInfo, pins: dict[str, Any]) -> list[str]:
    if "bf16" in pins or "fp16" in pins:
        return ["bf16" if pins.get("bf16") else "fp16" if pins.get("fp16") else "fp32"]
    if dev.kind == "cuda":
        if dev.supports_bf16:
            return ["bf16", "pure-bf16"]
        if dev.supports_fp16_tensor_cores:
            return ["fp16"]
        return ["fp32"]
    return ["fp32"]  # CPU/MPS: AMP rarely speeds up and bf16 is emulated on most CPUs


def attention(spec: ModelSpec, dev: DeviceInfo, precision: str, cp: int = 1) -> tuple[str, str]:
    """The attention kernel of a setup, and why (``cp`` > 1: torch's context parallelism,
    which replaces SDPA only)."""
    cls = spec.model_cls
    if cp > 1 and getattr(cls, "_supports_sdpa", False):
        return "sdpa", f"context parallelism x{cp} runs torch ring attention in place of SDPA"
    if (getattr(cls, "_supports_flash_attn", False) and is_flash_attn_available()
            and dev.kind == "cuda" and dev.compute_capability and dev.compute_capability >= (8, 0)
            and precision in ("bf16", "fp16", "pure-bf16")):
        return "flash_attention_2", "flash-attn is installed and this GPU supports it"
    if getattr(cls, "_supports_sdpa", False):
        why = "torch SDPA (flash/memory-efficient kernels)"
        if dev.kind == "cuda" and not is_flash_attn_available():
            why += "; flash_attention_2 not installed"
        return "sdpa", why
    try:
        import optimum.bettertransformer  # noqa: F401  (optimum < 2 only)

        return "eager", "model has no native SDPA; optimum's BetterTransformer is installed but " \
                        "not applied automatically"
    except ImportError:
        return "eager", "model has no native SDPA kernel; optimum 2.x has no BetterTransformer"
    except Exception as exc:  # optimum 1.2x raises RuntimeError on import under transformers>=4.49
        return "eager", ("model has no native SDPA kernel, and the installed optimum's "
                         f"BetterTransformer cannot be used ({type(exc).__name__}: "
                         f"{str(exc).splitlines()[0][:160] if str(exc) else 'import failed'}); "
                         "BetterTransformer is deprecated: uninstall optimum or upgrade it")


class SpecBook:
    """The model spec (and its LoRA / quantization configs) of each (method, precision)."""

    def __init__(self, req: PlanRequest, methods: dict[str, Method]):
        self.req, self.methods = req, methods
        self._meta: dict = {}
        self.base = resolve_model(req.model, task=req.task, meta_cache=self._meta)
        # a name or a directory is read once: specs of one config object share meta models
        self._ref = req.model if isinstance(req.model, (torch.nn.Module, PretrainedConfig)) \
            else self.base.config
        self._specs: dict[tuple[str, str], tuple[ModelSpec, Any, Any]] = {}

    def get(self, method: str, precision: str) -> tuple[ModelSpec, Any, Any]:
        key = (method, precision)
        if key not in self._specs:
            m, dev = self.methods[method], self.req.dev
            own = getattr(self.req.model, "peft_config", None)  # a peft model: its adapters
            peft_cfg = None if not m.adapters else next(iter(own.values())) \
                if isinstance(own, dict) and own else m.peft_config(self.base.task)
            quant = m.quantization_config(dev)
            spec = resolve_model(self._ref, task=self.req.task,
                                 dtype=m.load_dtype(precision, dev),
                                 attn_implementation=attention(self.base, dev, precision,
                                                               self.req.split.cp)[0],
                                 peft_config=peft_cfg, quantization_config=quant,
                                 meta_cache=self._meta)
            self._specs[key] = (spec, peft_cfg, quant)
        return self._specs[key]


def technique_choices(req: PlanRequest, model_cls: type,
                      notes: list[str]) -> list[tuple[Technique, list[bool]]]:
    """Each searched technique with the values to try: the pin, or off and on where the model,
    the target device and this machine's libraries allow it."""
    out = []
    for t in searched():
        why_not = _why_not(t, req, model_cls)
        if why_not and t.acts_on(req.dev.kind):
            notes.append(why_not)
        on = t.pinned(req.pins)
        if on is not None:
            if on and why_not:
                raise HfMemkitError(f"{why_not}; drop the {t.fields[0]} pin")
            out.append((t, [on]))
        else:
            out.append((t, [False] if why_not else [False, True]))
    return out


def _why_not(t: Technique, req: PlanRequest, model_cls: type) -> str:
    """Why the plan never enables ``t`` ("" when it may)."""
    if not t.supported(model_cls):
        return f"{model_cls.__name__} does not support {t.sentence_name}; the plan never " \
               "enables it"
    if not t.acts_on(req.dev.kind):
        return f"{t.sentence_name} only acts on {'/'.join(t.devices)} targets"
    if not t.available():
        return f"{t.sentence_name} needs {t.missing}, which this machine lacks; the plan " \
               "never enables it"
    return ""


def technique_combos(choices: list[tuple[Technique, list[bool]]]) -> list[tuple[str, ...]]:
    """Every combination of the choices in which each technique's ``requires`` are on."""
    out = []
    for combo in itertools.product(*(vals for _, vals in choices)):
        on = {t.name for (t, _), v in zip(choices, combo, strict=True) if v}
        if all(set(TECHNIQUES.get(n).requires) <= on for n in on):
            out.append(tuple(sorted(on)))
    return out


def strategies(req: PlanRequest, method: Method) -> list[Rung]:
    """The data-parallel rungs ``method`` may use: replicas (DDP), then the sharding rungs of
    the engine asked for (``engine="auto"``: the default sharding engine, FSDP2)."""
    if any(e.selected(req.pins.get) for e in ENGINES):
        return [PINNED]
    if req.ranks == 1:
        return [SINGLE]
    engine = req.sharding_engine
    if not req.split.plain:  # each sequence split over ranks, on the engine that splits it
        return [r.split(req.split) for r in engine.split_rungs() if method.allows_rung(r)]
    rungs = [] if req.engine_stage else [r for e in ENGINES if e.replicates for r in e.rungs()]
    if not engine.replicates:  # a stage asked for by name ("zero3"): that stage's rungs alone
        rungs += [r for r in engine.rungs() if r.name in (req.engine_stage or (r.name,))]
    rungs = [r for r in rungs if method.allows_rung(r)]
    dims = req.pinned_dims
    return rungs if dims is None else pinned_dims_rungs(req, method, dims, rungs) or rungs


def pinned_dims_rungs(req: PlanRequest, method: Method, dims: ParallelDims,
                      rungs: list[Rung]) -> list[Rung]:
    """The rungs that run a pinned ``parallelism_config``: with a sequence split, the split
    rungs of the engines that run it (context parallelism: FSDP2; sequence parallelism:
    DeepSpeed), as the planner's own splits; otherwise those of ``rungs`` whose engine takes
    the degrees. Empty where none does (the estimate then says why, naming the degrees)."""
    if dims.splits_sequence == 1:
        return [r for r in rungs if not engine_problems(dims, r.engine)]
    return [r.split(dims) for e in ENGINES if req.engine in ("auto", e.name, *e.stages)
            and not engine_problems(dims, e.name) for r in e.split_rungs()
            if method.allows_rung(r)]


def user_optimizer(req: PlanRequest) -> str:
    """The optimizer the user's arguments name: the pin, else ``TrainingArguments``' own default
    (``adamw_torch_fused`` on torch >= 2.8) where the planner can run it on this device."""
    if "optim" in req.pins:
        return req.pins["optim"]
    searched = planner_optimizers(req.dev.kind)
    default = training_args_fields()["optim"]
    default = str(getattr(default, "value", default))
    return default if default in searched else searched[0]


def optimizers(req: PlanRequest) -> list[str]:
    """The optimizers searched: the user's first, then the others by step cost. Another
    optimizer changes the recipe, so the search tries it only where no setup with the user's
    fits (``Search.run``), and the plan warns."""
    mine = user_optimizer(req)
    if "optim" in req.pins:
        return [mine]
    return [mine] + [o for o in planner_optimizers(req.dev.kind) if o != mine]


def _rung_precision_optim(req: PlanRequest, meth: Method) -> Iterator[tuple[Rung, str, str]]:
    opts = optimizers(req)
    for rung in strategies(req, meth):
        for precision in precisions(req.dev, req.pins):
            if not meth.allows_precision(precision) or (
                    rung.precisions and precision not in rung.precisions):
                continue
            for optim in opts:
                if ENGINES.get(rung.engine).sharded and "optim" not in req.pins and \
                        not get_optimizer_profile(optim).shardable:
                    continue  # sharded/offloaded states: torch AdamW (DTensor, DeepSpeed)
                yield rung, precision, optim


def candidates(req: PlanRequest, methods: list[Method], book: SpecBook,
               notes: list[str]) -> list[Candidate]:
    """Every setup of the search, not yet priced or estimated."""
    combos = technique_combos(technique_choices(req, book.base.model_cls, notes))
    out, batching = [], {}
    for meth in methods:
        for rung, precision, optim in _rung_precision_optim(req, meth):
            attn = attention(book.base, req.dev, precision, req.split.cp)[0]
            if attn not in batching:
                batching[attn] = padding_free_choices(req, book.base.model_cls, attn, notes)
            for on in combos:
                out += [Candidate(meth.name, precision, optim, CHECKPOINTING in on, mb,
                                  req.per_rank // mb, attn, None, parallel=rung.name,
                                  techniques=on, padding_free=pf)
                        for pf in batching[attn] for mb in req.micro_batches()]
    return out
