"""The model as the estimator needs it: ``resolve_model`` -> ``ModelSpec``.

A spec holds the config, the class, the load dtype, attention, adapters and quantization, and a
meta instance (adapters included). What is derived from it is memoised on the spec itself:
``states()`` (weights and trainable parameters), ``facts()`` (layer structure for sharding),
``trace_identity()`` (what a trace depends on) and ``in_dtype()`` (a 16-bit variant).
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import PretrainedConfig

from .._errors import HfMemkitError, did_you_mean
from .._optimizers import ParamInfo
from .adapters import (
    LoraSpec,
    adapter_dtype_of,
    cast_adapters,
    lora_identity,
    quantizable_linears,
)
from .facts import ModelFacts, model_facts
from .profile import logical_numel, model_class, to_config, unwrap_model
from .tasks import normalize_task, task_of_class

# bitsandbytes NF4 (bitsandbytes/functional.py quantize_4bit): 2 weights per byte, one fp32
# absmax per 64-weight block; double quantization stores absmax as uint8 plus one fp32 per 256.
NF4_BLOCK = 64


@dataclass(frozen=True)
class WeightParts:
    """Weight bytes a sharding engine may hold apart from the rest (``ModelSpec.weight_parts``)."""

    packed_4bit: int          # NF4 weights, 2 per byte (in their storage dtype's container)
    quant_constants: int      # absmax blocks (+ double quantization's): the quant_state, no parameter
    buffers: int              # registered buffers (FSDP does not shard them)
    storage_floating: bool    # bnb_4bit_quant_storage is a float dtype: FSDP can shard the packed


@dataclass
class ModelSpec:
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
    # bnb_4bit_quant_storage: the dtype the packed 4-bit weights are stored in (None: uint8,
    # bitsandbytes' default). A floating storage lets FSDP shard them (FSDP-QLoRA).
    quant_storage: torch.dtype | None = None
    # tensor parallelism: this is one rank's model of ``tp`` (``_model.tensor_parallel``); the
    # modules of the class's ``_tp_plan`` (the head: ``colwise_gather_output``) hold 1/tp rows
    tp: int = 1
    _states: tuple[int, list[ParamInfo]] | None = field(default=None, init=False, repr=False)
    _parts: WeightParts | None = field(default=None, init=False, repr=False)
    _facts: ModelFacts | None = field(default=None, init=False, repr=False)
    _identity: tuple | None = field(default=None, init=False, repr=False)
    _variants: dict = field(default_factory=dict, init=False, repr=False)

    def states(self) -> tuple[int, list[ParamInfo]]:
        """(weight bytes incl. buffers and quantization constants, trainable params)."""
        if self._states is None:
            self._states = _model_states(self)
        return self._states

    def weight_parts(self) -> WeightParts:
        """The parts of ``states()[0]`` a sharding engine treats apart (4-bit packed weights,
        their quantization constants, buffers)."""
        if self._parts is None:
            packed, constants, _ = _quantized_bytes(self) if self.quant_bits == 4 else (0, 0, ())
            self._parts = WeightParts(packed, constants, sum(
                b.numel() * b.element_size() for b in self.meta.buffers()),
                self.quant_storage is not None and self.quant_storage.is_floating_point)
        return self._parts

    def facts(self) -> ModelFacts:
        """Layer structure for sharding."""
        if self._facts is None:
            self._facts = model_facts(self.meta)
        return self._facts

    def trace_identity(self) -> tuple:
        """What a trace depends on: specs built separately for the same model, dtype, attention
        and adapters share traces (e.g. pure bf16 and FSDP's 16-bit gathers)."""
        if self._identity is None:
            self._identity = (self.model_cls, self.config.to_json_string(use_diff=False),
                              self.task, self.dtype, self.attn_implementation,
                              lora_identity(self.lora),
                              self.quant_bits, self.tp)
        return self._identity

    def in_dtype(self, dtype: torch.dtype) -> ModelSpec:
        """The same model loaded in ``dtype`` (memoised)."""
        if dtype not in self._variants:
            self._variants[dtype] = dataclasses.replace(self, dtype=dtype)
        return self._variants[dtype]

    def with_adapter_dtype(self, dtype: torch.dtype) -> ModelSpec:
        """The same model with its trainable adapters cast to ``dtype``, as a trainer casts them
        (``_trainers.TrainerKind.adapter_dtype``); memoised, with a meta model of its own. The
        spec itself where its adapters already have that dtype."""
        if self.lora is None or adapter_dtype_of(self.meta) == dtype:
            return self
        key = ("adapters", dtype)
        if key not in self._variants:
            meta = copy.deepcopy(self.meta)
            cast_adapters(meta, dtype)
            self._variants[key] = dataclasses.replace(
                self, lora=dataclasses.replace(self.lora, adapter_dtype=dtype), meta=meta)
        return self._variants[key]

    def narrowed(self, config: PretrainedConfig, tp: int) -> ModelSpec:
        """One rank's model under tensor parallelism of degree ``tp``: ``config`` is the model's
        with each rank's heads and MLP width (``_model.tensor_parallel``); memoised, with a meta
        model of its own (adapters as this spec's)."""
        key = ("tp", tp)
        if key not in self._variants:
            meta = _meta_model(self.model_cls, config, self.dtype, self.attn_implementation,
                               self.lora.peft_config if self.lora is not None else None)
            if self.lora is not None:
                cast_adapters(meta, self.lora.adapter_dtype)
            self._variants[key] = dataclasses.replace(self, config=config, meta=meta, tp=tp)
        return self._variants[key]

    def positions_warning(self, seq_len: int, seq_name: str = "seq_len") -> str | None:
        """What a sequence past ``max_position_embeddings`` means for a model with no learned
        position table (rotary and other computed positions): transformers runs it, the model
        was not trained there. (A learned table refuses it: ``learned_positions``.)"""
        limit = getattr(self.meta.config.get_text_config(), "max_position_embeddings", None)
        if not isinstance(limit, int) or seq_len <= limit or self.learned_positions():
            return None
        return (f"{seq_name} {seq_len} is past this model's max_position_embeddings ({limit}): "
                "its positions are computed (rotary), so transformers runs it and memory is as "
                "estimated, but the model was not trained on positions this far; extend its "
                "context with rope scaling (e.g. YaRN in the config's rope_parameters) or "
                f"use {seq_name} <= {limit}")

    def learned_positions(self) -> int | None:
        """Longest sequence a model with a learned absolute position table can take (None:
        rotary, relative or other schemes). OPT/RoBERTa tables carry an offset of 2."""
        limit = getattr(self.meta.config.get_text_config(), "max_position_embeddings", None)
        for name, m in self.meta.named_modules():
            if isinstance(m, torch.nn.Embedding) and ("pos" in name.split(".")[-1] or
                                                      name.endswith("wpe")):
                return int(limit) if limit else m.num_embeddings
        return None


def _dtype(v: Any) -> torch.dtype | None:
    return getattr(torch, v.replace("torch.", "")) if isinstance(v, str) else v


def quant_from(qc: Any) -> tuple[int | None, bool, torch.dtype | None, torch.dtype | None]:
    """(bits, double quantization, compute dtype, 4-bit storage dtype) of a bitsandbytes config
    (or dict)."""
    if qc is None:
        return None, False, None, None
    get = qc.get if isinstance(qc, dict) else (lambda k, d=None: getattr(qc, k, d))
    if get("load_in_4bit", False):
        storage = _dtype(get("bnb_4bit_quant_storage", None))
        return (4, bool(get("bnb_4bit_use_double_quant", False)),
                _dtype(get("bnb_4bit_compute_dtype", None)),
                None if storage == torch.uint8 else storage)
    if get("load_in_8bit", False):
        return 8, False, None, None
    raise HfMemkitError(
        "quantization_config must be a bitsandbytes config with load_in_4bit or load_in_8bit; "
        f"got {qc!r}")


@dataclass
class _Loaded:
    """What a loaded model says about itself."""

    config: PretrainedConfig
    model_cls: type
    task: str
    dtype: torch.dtype
    attn: str | None
    lora_cfg: Any
    quant_bits: int | None
    double_quant: bool
    quant_storage: torch.dtype | None = None
    adapter_dtype: torch.dtype | None = None   # a peft model's own trainable adapters' dtype


def _storage_of(base: torch.nn.Module) -> torch.dtype | None:
    """The floating storage dtype of a loaded model's 4-bit weights (None: integer storage)."""
    for p in base.parameters():
        if type(p).__name__ == "Params4bit":
            return p.dtype if p.is_floating_point() else None
    return None


def loaded_weights(base: torch.nn.Module) -> tuple[torch.dtype, int | None]:
    """The dtype most of a loaded model's floating weights have, and the bits of its
    bitsandbytes-quantized weights (None: not quantized)."""
    floats = [p.dtype for p in base.parameters() if p.is_floating_point()
              and type(p).__name__ not in ("Params4bit", "Int8Params")]
    kinds = {type(p).__name__ for p in base.parameters()}
    bits = 4 if "Params4bit" in kinds else 8 if "Int8Params" in kinds else None
    return (max(set(floats), key=floats.count) if floats else torch.float32), bits


def _from_module(model: torch.nn.Module, task: str | None, dtype: torch.dtype | None,
                 attn: str | None, lora_cfg: Any, quant: tuple) -> _Loaded:
    base, is_peft = unwrap_model(model)
    config = base.config
    task = normalize_task(task, config) if task else task_of_class(type(base), config)
    own_dtype, own_bits = loaded_weights(base)
    dtype = dtype or own_dtype
    attn = attn or getattr(config, "_attn_implementation", None)
    if is_peft and lora_cfg is None:
        lora_cfg = next(iter(model.peft_config.values()))
    bits, double, storage = quant[0], quant[1], quant[3]
    if bits is None:
        bits = own_bits
        qc = getattr(config, "quantization_config", None)
        if bits and qc is not None:
            double = bool(quant_from(qc)[1]) if bits == 4 else False
        storage = _storage_of(base) if bits == 4 else None
    return _Loaded(config, type(base), task, dtype, attn, lora_cfg, bits, double, storage,
                   adapter_dtype_of(model) if is_peft else None)


def _from_config(ref: Any, task: str | None, dtype: torch.dtype | None, attn: str | None,
                 lora_cfg: Any, quant: tuple) -> _Loaded:
    config = to_config(ref)
    task = normalize_task(task, config)
    model_cls = model_class(config, task)
    # A quantized base goes through peft's prepare_model_for_kbit_training (the standard QLoRA
    # recipe, and what Plan.prepare does): every non-quantized bf16/fp16 parameter (embeddings,
    # head, norms) is upcast to fp32, and adapters are fp32. FSDP-QLoRA loads in its storage
    # dtype instead (``dtype=``), without that upcast.
    return _Loaded(config, model_cls, task, dtype or torch.float32, attn, lora_cfg, quant[0],
                   quant[1], quant[3])


LOAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def load_dtype(dtype: Any) -> torch.dtype | None:
    """``dtype=`` of ``estimate_memory``: a floating torch dtype or its name ("bfloat16",
    "torch.float16", "half"), or None / "auto" (the model's own; fp32 for a config)."""
    if dtype is None or dtype == "auto":
        return None
    names = [str(d).removeprefix("torch.") for d in LOAD_DTYPES]
    found = getattr(torch, dtype.removeprefix("torch."), None) if isinstance(dtype, str) else dtype
    if found not in LOAD_DTYPES:
        raise HfMemkitError(
            f"dtype {dtype!r} is not a dtype weights can be loaded in"
            f"{did_you_mean(str(dtype), names) if isinstance(dtype, str) else ''}; allowed: "
            f"{', '.join(names)} (or torch.float32 / torch.bfloat16 / torch.float16), or 'auto' "
            "/ None for the model's own (float32 for a config)")
    return found


def resolve_model(model: Any, *, task: str | None = None, dtype: torch.dtype | str | None = None,
                  attn_implementation: str | None = None, peft_config: Any = None,
                  quantization_config: Any = None, meta_cache: dict | None = None) -> ModelSpec:
    """A ``ModelSpec`` of a model (any device), a config, a catalog name or a local directory.
    ``meta_cache`` shares meta instances between specs of one model (the planner's LoRA rungs)."""
    dtype = load_dtype(dtype)
    quant = quant_from(quantization_config)
    if isinstance(model, torch.nn.Module):
        ld = _from_module(model, task, dtype, attn_implementation, peft_config, quant)
    elif isinstance(model, (PretrainedConfig, str)) or hasattr(model, "__fspath__"):
        ld = _from_config(model, task, dtype, attn_implementation, peft_config, quant)
    else:
        raise HfMemkitError(
            "estimate_memory takes a transformers model (any device, meta included), a "
            f"PretrainedConfig, a catalog name or a local directory; got {type(model).__name__}")
    if ld.quant_bits and ld.lora_cfg is None:
        raise HfMemkitError(
            f"a {ld.quant_bits}-bit base cannot be trained directly; give `peft_config` "
            "(a peft.LoraConfig) for QLoRA, or drop quantization_config")
    # attention picks a kernel, not parameters: specs that differ only in it share a meta model
    key = (ld.model_cls, id(ld.config), ld.dtype, repr(ld.lora_cfg), ld.adapter_dtype)
    meta = meta_cache.get(key) if meta_cache is not None else None
    if meta is None:
        meta = _meta_model(ld.model_cls, ld.config, ld.dtype, ld.attn, ld.lora_cfg)
        cast_adapters(meta, ld.adapter_dtype)
        if meta_cache is not None:
            meta_cache[key] = meta
    lora = LoraSpec(ld.lora_cfg, quantized_4bit=ld.quant_bits == 4,
                    compute_dtype=quant[2] or torch.bfloat16,
                    adapter_dtype=ld.adapter_dtype) if ld.lora_cfg is not None else None
    return ModelSpec(ld.config, ld.model_cls, ld.task, ld.dtype, ld.attn, lora, ld.quant_bits,
                     ld.double_quant, meta,
                     bool(getattr(ld.model_cls, "supports_gradient_checkpointing", False)),
                     ld.quant_storage if ld.quant_bits == 4 else None)


def _meta_model(model_cls: type, config: PretrainedConfig, dtype: torch.dtype,
                attn: str | None, lora_cfg: Any) -> torch.nn.Module:
    kwargs: dict[str, Any] = {"dtype": dtype}
    if attn:
        kwargs["attn_implementation"] = attn
    with torch.device("meta"):
        m = model_cls._from_config(copy.deepcopy(config), **kwargs)
        if lora_cfg is not None:
            import peft

            from .._compat import quiet_peft

            with quiet_peft():
                m = peft.get_peft_model(m, copy.deepcopy(lora_cfg))
    return m


def _quantized_bytes(spec: ModelSpec) -> tuple[int, int, set[int]]:
    """Bytes of the quantized linears (packed weights, their constants) and their weights' ids."""
    packed, constants, quantized = 0, 0, set()
    base = spec.meta.get_base_model() if hasattr(spec.meta, "get_base_model") else spec.meta
    for _name, mod in quantizable_linears(base):
        quantized.add(id(mod.weight))
        n = mod.weight.numel()
        if spec.quant_bits == 4:
            blocks = -(-n // NF4_BLOCK)
            packed += -(-n // 2)
            constants += (blocks + 4 * -(-blocks // 256)) if spec.double_quant else 4 * blocks
        else:  # LLM.int8: int8 weight + fp32 row scale
            packed += n
            constants += 4 * mod.weight.shape[0]
    return packed, constants, quantized


def _model_states(spec: ModelSpec) -> tuple[int, list[ParamInfo]]:
    packed, constants, quantized = _quantized_bytes(spec) if spec.quant_bits else (0, 0, set())
    weights = packed + constants
    embeddings = {id(m.weight) for m in spec.meta.modules() if isinstance(m, torch.nn.Embedding)}
    # GaLore / APOLLO match `optim_target_modules` against the module of each nn.Linear weight,
    # by the weight's name in named_parameters() (transformers _setup_low_rank_optimizer)
    linears = {f"{n}.weight": n for n, m in spec.meta.named_modules()
               if isinstance(m, torch.nn.Linear)}
    split = _vocab_split(spec)
    trainable: list[ParamInfo] = []
    for name, p in spec.meta.named_parameters():
        if id(p) in quantized:
            continue
        shape, div = tuple(p.shape), spec.tp if id(p) in split else 1
        if div > 1:   # one rank's rows of a head the tp plan splits by vocabulary
            shape = (-(-shape[0] // div), *shape[1:])
        numel = logical_numel(p) if div == 1 else math.prod(shape)
        weights += numel * p.element_size()
        if p.requires_grad:
            trainable.append(ParamInfo(math.prod(shape), shape, p.element_size(),
                                       embedding=id(p) in embeddings, linear=linears.get(name)))
    weights += sum(b.numel() * b.element_size() for b in spec.meta.buffers())
    return weights, trainable


def _vocab_split(spec: ModelSpec) -> set[int]:
    """Ids of the weights tensor parallelism splits by vocabulary rows outside the layers: the
    modules of the class's ``_tp_plan`` (transformers: ``{"lm_head": "colwise_gather_output"}``)
    and the input embedding, which transformers adds to every plan as ``embedding_rowwise``
    (``distributed/mixin.py::init_parallel_plans``); a tied pair is one weight, split once."""
    if spec.tp <= 1:
        return set()
    heads = (*(getattr(spec.model_cls, "_tp_plan", None) or {}), "embed_tokens")
    return {id(p) for n, p in spec.meta.named_parameters()
            if any(n == f"{h}.weight" or n.endswith(f".{h}.weight") for h in heads)}
