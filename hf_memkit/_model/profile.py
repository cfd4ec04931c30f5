"""What the model is: ``profile_model`` -> ``ModelProfile`` (parameter counts and architecture).

Works on a loaded model (any device, meta included), a ``PretrainedConfig``, a catalog name or a
local directory. A config is instantiated on the meta device, so no weights are ever allocated.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
import transformers
from transformers import PretrainedConfig, PreTrainedModel

from .._errors import HfMemkitError, excerpt, quoted
from .catalog import resolve_config
from .facts import DECODER_DEPTH_KEYS, DEPTH_KEYS
from .tasks import TASKS, normalize_task, task_of_class

_ATTN_FLAGS = {  # class attribute -> attn_implementation value (transformers 5 names)
    "_supports_sdpa": "sdpa",
    "_supports_flash_attn": "flash_attention_2",
    "_supports_flex_attn": "flex_attention",
}
# every kernel a plan may name (``Plan.model_kwargs['attn_implementation']``)
ATTN_IMPLEMENTATIONS = ("eager", *_ATTN_FLAGS.values())


@dataclass
class ModelProfile:
    """Parameter counts and architecture facts of one model, gathered without allocating weights."""

    name: str = field(metadata={"help": "name_or_path of the config, or the class name."})
    architecture: str = field(metadata={"help": "Model class, e.g. 'LlamaForCausalLM'."})
    model_type: str = field(metadata={"help": "config.model_type, e.g. 'llama'."})
    task: str = field(metadata={"help": "Head the profile was built with (see _model.tasks)."})
    total_params: int = field(metadata={"help": "All parameters (logical count, tied counted once)."})
    trainable_params: int = field(metadata={"help": "Parameters with requires_grad."})
    frozen_params: int = field(metadata={"help": "total_params - trainable_params."})
    param_bytes: int = field(metadata={"help": "Bytes the parameters occupy as stored."})
    params_by_dtype: dict[str, int] = field(metadata={"help": "Parameter count per storage dtype."})
    buffer_bytes: int = field(metadata={"help": "Bytes of persistent and non-persistent buffers."})
    num_layers: int | None = field(metadata={"help": "Transformer blocks (encoder+decoder for seq2seq)."})
    hidden_size: int | None = field(metadata={"help": "Model width."})
    num_attention_heads: int | None = field(metadata={"help": "Query heads."})
    num_key_value_heads: int | None = field(metadata={"help": "KV heads (< heads means GQA/MQA)."})
    head_dim: int | None = field(metadata={"help": "Per-head width."})
    intermediate_size: int | None = field(metadata={"help": "MLP width."})
    vocab_size: int | None = field(metadata={"help": "Vocabulary size."})
    max_position_embeddings: int | None = field(metadata={"help": "Longest context the config allows."})
    tie_word_embeddings: bool = field(metadata={"help": "Input and output embeddings share weights."})
    is_encoder_decoder: bool = field(metadata={"help": "Seq2seq architecture."})
    supports_gradient_checkpointing: bool = field(metadata={"help": "Trainer can checkpoint it."})
    attn_implementations: tuple[str, ...] = field(
        metadata={"help": "Attention kernels the model class supports ('eager' always)."}
    )
    attn_implementation: str | None = field(metadata={"help": "The one the model/config uses now."})
    layer_classes: tuple[str, ...] = field(
        metadata={"help": "Block classes (_no_split_modules): what FSDP wraps, what we trace."}
    )
    quantization: str | None = field(
        default=None, metadata={"help": "'bnb-4bit' / 'bnb-8bit' for a quantized model, else None."}
    )
    is_peft: bool = field(default=False, metadata={"help": "A peft model (LoRA etc.)."})
    config: PretrainedConfig | None = field(
        default=None, repr=False, compare=False, metadata={"help": "The config profiled."}
    )

    @property
    def is_gqa(self) -> bool:
        return bool(self.num_key_value_heads and self.num_attention_heads
                    and self.num_key_value_heads < self.num_attention_heads)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "config"}


# The most layers a config may stack (each counted config: a model's own, its text model's, an
# encoder's or a decoder's): above the deepest trained transformers (DeepNet, 1,000 layers), low
# enough that building the model on the meta device stays a few seconds.
MAX_LAYERS = 2**10
LAYER_FIELDS = ("num_hidden_layers", "encoder_layers", "decoder_layers", "num_decoder_layers")


def depth_problem(config: PretrainedConfig) -> str | None:
    """Why ``config`` has too many layers (or a layer count that is not a count) to plan, or
    None."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for cfg in (config,) if text is config else (config, text):
        for name in LAYER_FIELDS:
            n = getattr(cfg, name, None)
            if n is None:
                continue
            if not isinstance(n, int) or isinstance(n, bool) or n < 0:
                return (f"{name}={quoted(n)} is not a number of layers; set it to a "
                        "non-negative integer")
            if n > MAX_LAYERS:
                return (f"{name}={n} is more layers than hf_memkit plans (at most {MAX_LAYERS}, "
                        "above the deepest transformers trained: 1,000 layers); set it to the "
                        "model's real depth")
    return None


def token_id_problem(config: PretrainedConfig) -> str | None:
    """Why the model of ``config`` cannot be built for its token ids, or None: a
    ``pad_token_id`` outside the vocabulary (the embedding's padding index; torch asserts deep
    inside the model's ``__init__``). The config and its sub-configs (a text config) are read."""
    subs = [getattr(config, k, None) for k in getattr(config, "sub_configs", {}) or {}]
    for c in [config, *(s for s in subs if isinstance(s, PretrainedConfig))]:
        vocab, pad = getattr(c, "vocab_size", None), getattr(c, "pad_token_id", None)
        if not isinstance(vocab, int) or not isinstance(pad, int) or isinstance(pad, bool) \
                or -vocab <= pad < vocab:
            continue
        eos = getattr(c, "eos_token_id", None)
        eos = f", e.g. the eos_token_id {eos}" if isinstance(eos, int) and 0 <= eos < vocab else ""
        return (f"pad_token_id={pad} is outside the vocabulary (vocab_size={vocab}): the "
                f"embedding cannot pad with it; set pad_token_id to a token id in [0, {vocab})"
                f"{eos}, or None, or raise vocab_size to cover it")
    return None


def model_from_config(config: PretrainedConfig, task: str | None = None, *,
                device: str | torch.device = "meta", **kwargs: Any) -> PreTrainedModel:
    """Instantiate ``config`` with the head for ``task`` on ``device`` (meta: no memory)."""
    task = normalize_task(task, config)
    problem = depth_problem(config) or token_id_problem(config)
    if problem:
        raise HfMemkitError(problem)
    auto_cls = getattr(transformers, TASKS.get(task).auto_class)
    kwargs.setdefault("trust_remote_code", False)  # never run a model's own code (auto_map)
    try:
        with torch.device(device):
            return auto_cls.from_config(config, **kwargs)
    except ValueError as exc:
        if "trust_remote_code" in str(exc):
            from .catalog import remote_code_error

            raise remote_code_error(getattr(config, "name_or_path", "") or config.model_type,
                                    config.model_type) from None
        raise HfMemkitError(
            f"transformers cannot build a `{config.model_type}` model for task `{task}` "
            f"({exc}); choose another task from: {', '.join(TASKS.names())}"
        ) from exc
    except (RuntimeError, ArithmeticError, TypeError, IndexError) as exc:  # a size it cannot take
        raise HfMemkitError(
            f"transformers cannot build a `{config.model_type}` model from this config "
            f"({type(exc).__name__}: {excerpt(exc, 200)}); fix the config's sizes (hidden_size, "
            "num_attention_heads, intermediate_size, ...) to the model's real ones") from exc


def load_quantized(auto_cls: Any, config: PretrainedConfig, quantization_config: Any,
                   folder: str, *, load_kwargs: dict[str, Any] | None = None,
                   **kwargs: Any) -> PreTrainedModel:
    """``auto_cls`` (an ``AutoModelFor...`` class) of ``config`` with random weights, quantized
    as users load a checkpoint: ``from_config`` rejects ``quantization_config``
    (docs/stack-facts.md), so the model is built, saved to ``folder`` and loaded back with it.
    ``kwargs`` go to both (``dtype``, ``attn_implementation``); ``load_kwargs`` to the load
    alone (``device_map``)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        model = auto_cls.from_config(config, **kwargs)
    model.save_pretrained(folder)
    del model
    return auto_cls.from_pretrained(folder, quantization_config=quantization_config, **kwargs,
                                    **(load_kwargs or {}))


_CLASSES: dict[tuple, tuple[PretrainedConfig, type]] = {}  # (id, task): (config, class)


def model_class(config: PretrainedConfig, task: str | None = None) -> type:
    """The class ``model_from_config`` builds for ``config`` and ``task``; built once per config
    object (a plan resolves one config for each of its load dtypes and methods). The last few
    configs are held, so that their ids are not reused while they are keys."""
    task = normalize_task(task, config)
    key = (id(config), task)
    held = _CLASSES.get(key)
    if held is None or held[0] is not config:
        held = _CLASSES[key] = (config, type(model_from_config(config, task)))
        while len(_CLASSES) > 8:
            del _CLASSES[next(iter(_CLASSES))]
    return held[1]


def to_config(ref: Any) -> PretrainedConfig:
    if isinstance(ref, PretrainedConfig):
        return ref
    if isinstance(ref, (str, os.PathLike)):
        return resolve_config(ref)
    raise HfMemkitError(
        "profile_model takes a transformers model, a PretrainedConfig, a catalog name or a local "
        f"directory; got {type(ref).__name__}"
    )


def unwrap_model(model: Any) -> tuple[torch.nn.Module, bool]:
    """The underlying transformers model of a peft wrapper, and whether it was one."""
    is_peft = hasattr(model, "peft_config") and hasattr(model, "get_base_model")
    base = model.get_base_model() if is_peft else model
    return base, is_peft


def logical_numel(p: torch.Tensor) -> int:
    """Parameter count of a tensor; a packed bitsandbytes 4-bit weight counts its real shape."""
    qs = getattr(p, "quant_state", None)
    if qs is not None and getattr(qs, "shape", None) is not None:
        return math.prod(qs.shape)
    return p.numel()


def profile_model(model_or_config_or_name: Any, *, task: str | None = None) -> ModelProfile:
    """Parameter counts and architecture facts of a model; never allocates weights.

    Args:
        model_or_config_or_name (`torch.nn.Module`, `PretrainedConfig`, `str` or `os.PathLike`):
            A transformers model (or a peft model around one), a config, a catalog name or a
            local directory.
        task (`str`, *optional*):
            Picks the head when a config or name is given (default: from
            `config.architectures`), e.g. `"sequence-classification"` for bert-large.

    Returns:
        `ModelProfile`: total, trainable and frozen parameters, their bytes, and the
        architecture facts the estimator needs.

    Raises:
        HfMemkitError: For a model without `.config`, an unknown name, type or task.
    """
    if isinstance(model_or_config_or_name, torch.nn.Module):
        model = model_or_config_or_name
        base, is_peft = unwrap_model(model)
        config = getattr(base, "config", None)
        if config is None:
            raise HfMemkitError(
                f"`{type(base).__name__}` has no `.config`; profile_model expects a transformers "
                "PreTrainedModel (or a peft model around one)"
            )
        task = normalize_task(task, config) if task else task_of_class(type(base), config)
    else:
        config = to_config(model_or_config_or_name)
        task = normalize_task(task, config)
        model = base = model_from_config(config, task)
        is_peft = False
    return _profile(model, base, config, task, is_peft)


def _first(config: Any, names: tuple[str, ...], default: Any = None) -> Any:
    for n in names:
        v = getattr(config, n, None)
        if v is not None:
            return v
    return default


def architecture_facts(config: PretrainedConfig) -> dict[str, Any]:
    """Width, depth, heads... read under the names different families use."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden = _first(text, ("hidden_size", "d_model", "n_embd", "dim"))
    heads = _first(text, ("num_attention_heads", "num_heads", "n_head"))
    kv = _first(text, ("num_key_value_heads", "num_kv_heads", "multi_query_group_num"), heads)
    layers = _first(text, DEPTH_KEYS)
    if getattr(text, "is_encoder_decoder", False):
        dec = _first(text, DECODER_DEPTH_KEYS, layers)
        layers = (layers or 0) + (dec or 0)
    head_dim = _first(text, ("head_dim", "d_kv"))
    if head_dim is None and hidden and heads:
        head_dim = hidden // heads
    inter = _first(text, ("intermediate_size", "d_ff", "ffn_dim", "n_inner", "encoder_ffn_dim"))
    if inter is None and hidden and getattr(text, "model_type", "") == "gpt2":
        inter = 4 * hidden  # GPT-2: n_inner=None means 4 * n_embd
    return {
        "num_layers": layers, "hidden_size": hidden, "num_attention_heads": heads,
        "num_key_value_heads": kv, "head_dim": head_dim, "intermediate_size": inter,
        "vocab_size": _first(text, ("vocab_size",)),
        "max_position_embeddings": _first(text, ("max_position_embeddings", "n_positions")),
        "tie_word_embeddings": bool(getattr(text, "tie_word_embeddings", False)),
        "is_encoder_decoder": bool(getattr(text, "is_encoder_decoder", False)),
    }


def _profile(model: torch.nn.Module, base: torch.nn.Module, config: PretrainedConfig, task: str,
             is_peft: bool) -> ModelProfile:
    total = trainable = nbytes = 0
    by_dtype: Counter[str] = Counter()
    quant = None
    for p in model.parameters():  # .parameters() yields tied weights once
        n = logical_numel(p)
        total += n
        if p.requires_grad:
            trainable += n
        nbytes += p.numel() * p.element_size()
        by_dtype[str(p.dtype).replace("torch.", "")] += p.numel()
        cls = type(p).__name__
        if cls == "Params4bit":
            quant = "bnb-4bit"
            qs = getattr(p, "quant_state", None)
            absmax = getattr(qs, "absmax", None) if qs is not None else None
            if isinstance(absmax, torch.Tensor):
                nbytes += absmax.numel() * absmax.element_size()
        elif cls == "Int8Params":
            quant = quant or "bnb-8bit"
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    cls = type(base)
    attn = ["eager"] + [impl for flag, impl in _ATTN_FLAGS.items() if getattr(cls, flag, False)]
    return ModelProfile(
        name=str(getattr(config, "name_or_path", "") or cls.__name__),
        architecture=cls.__name__,
        model_type=str(getattr(config, "model_type", "")),
        task=task,
        total_params=total,
        trainable_params=trainable,
        frozen_params=total - trainable,
        param_bytes=nbytes,
        params_by_dtype=dict(by_dtype),
        buffer_bytes=buffers,
        supports_gradient_checkpointing=bool(getattr(cls, "supports_gradient_checkpointing", False)),
        attn_implementations=tuple(attn),
        attn_implementation=getattr(config, "_attn_implementation", None),
        layer_classes=tuple(getattr(base, "_no_split_modules", None) or ()),
        quantization=quant,
        is_peft=is_peft,
        config=config,
        **architecture_facts(config),
    )
