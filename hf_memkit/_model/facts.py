"""The model's depth (``layer_count``, ``with_layers``: the trace's depth keys) and the layer
structure the sharding arithmetic needs, read from a meta instance of the model."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .._errors import HfMemkitError
from .adapters import quantizable_linears

# Config keys that give a model's depth, under the names different families use (one list for
# profile_model and the trace's depth).
DEPTH_KEYS = ("num_hidden_layers", "num_layers", "n_layer")
DECODER_DEPTH_KEYS = ("num_decoder_layers", "decoder_layers")
ENCODER_DEPTH_KEYS = ("encoder_layers",)
_LAYER_KEYS = DEPTH_KEYS + DECODER_DEPTH_KEYS + ENCODER_DEPTH_KEYS


@dataclass
class ModelFacts:
    """What the sharding arithmetic needs from the model (from its meta instance)."""

    total_params: int
    layer_params: int          # largest transformer layer (FSDP unit)
    tail_params: int           # output head (+ tied embedding): accelerate's FSDP tail unit
    module_params: int         # largest single module's own parameters (DeepSpeed ZeRO-3 gather)
    layer_class: str | None    # the class FSDP auto-wraps
    tied: bool = False
    layer_trainable: int = 0   # trainable parameters of that layer (all of it, or its adapters)
    tail_trainable: int = 0    # ... of the tail unit
    layer_quantizable: int = 0  # weights of that layer's linears a 4-bit base quantizes
    root_params: int = 0       # parameters in no layer (embedding, final norm, head): FSDP1's root


def model_facts(meta: torch.nn.Module) -> ModelFacts:
    base = meta.get_base_model() if hasattr(meta, "get_base_model") else meta
    names = set(getattr(base, "_no_split_modules", None) or ())
    layers = [m for m in base.modules() if type(m).__name__ in names]
    layer_cls = None
    if layers:
        layer_cls = max({type(m).__name__ for m in layers},
                        key=lambda n: sum(1 for m in layers if type(m).__name__ == n))
    largest = max(layers, key=lambda m: sum(p.numel() for p in m.parameters()), default=None)
    layer_params = sum(p.numel() for p in largest.parameters()) if largest is not None else 0
    inp = base.get_input_embeddings() if hasattr(base, "get_input_embeddings") else None
    out = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    tied = inp is not None and out is not None and out.weight is inp.weight
    # accelerate's tail unit [final norm, lm_head] (+ the input embedding when tied) is not
    # resharded after forward: gathered from the end of the forward to the start of backward
    tail = sum(p.numel() for p in out.parameters()) if out is not None else 0
    seen = {id(p): p.numel() for p in base.parameters()}
    module_params = max((sum(p.numel() for p in m.parameters(recurse=False))
                         for m in base.modules()), default=0)

    def trainable(m: Any) -> int:
        return sum(p.numel() for p in m.parameters() if p.requires_grad) if m is not None else 0

    quantizable = sum(lin.weight.numel() for _, lin in quantizable_linears(largest)) \
        if largest is not None else 0
    in_layers = {id(p) for m in layers for p in m.parameters()}
    root = sum(n for i, n in seen.items() if i not in in_layers)
    return ModelFacts(sum(seen.values()), layer_params, tail, module_params, layer_cls, tied,
                      trainable(largest), trainable(out), quantizable, root)


def layer_count(config: Any) -> int:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for key in DEPTH_KEYS:
        v = getattr(text, key, None)
        if isinstance(v, int):
            return v
    raise HfMemkitError(f"cannot find the layer count of `{type(config).__name__}`")


def with_layers(config: Any, n: int) -> Any:
    """A copy of ``config`` with ``n`` blocks (encoder and decoder alike); per-layer lists cut."""
    cfg = copy.deepcopy(config)
    full = layer_count(config)
    targets = [cfg]
    if hasattr(cfg, "get_text_config") and cfg.get_text_config() is not cfg:
        targets.append(cfg.get_text_config())
    for c in targets:
        for key in _LAYER_KEYS:
            v = getattr(c, key, None)
            if isinstance(v, int) and v == full:
                setattr(c, key, n)
        for key, v in list(vars(c).items()):
            if isinstance(v, list) and len(v) == full:  # layer_types, per-layer windows, ...
                setattr(c, key, v[:n])
    return cfg


def block_stacks(models: Sequence[Any], n: int) -> list[list[torch.nn.Module]]:
    """The stacks of ``n`` transformer blocks in ``models`` (``ModuleList``s of ``n`` modules of
    one class: a decoder's layers; an encoder-decoder has two; a reference copy its own)."""
    stacks, seen = [], set()
    for m in (m for m in models if m is not None):
        for sub in m.modules():
            if (isinstance(sub, torch.nn.ModuleList) and len(sub) == n and id(sub) not in seen
                    and len({type(b) for b in sub}) == 1):
                seen.add(id(sub))
                stacks.append(list(sub))
    return stacks
