"""The layer structure the sharding arithmetic needs, read from a meta instance of the model."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Config keys that give a model's depth, under the names different families use (one list for
# profile_model and the trace's depth).
DEPTH_KEYS = ("num_hidden_layers", "num_layers", "n_layer")
DECODER_DEPTH_KEYS = ("num_decoder_layers", "decoder_layers")
ENCODER_DEPTH_KEYS = ("encoder_layers",)


@dataclass
class ModelFacts:
    """What the sharding arithmetic needs from the model (from its meta instance)."""

    total_params: int
    layer_params: int          # largest transformer layer (FSDP unit)
    tail_params: int           # output head (+ tied embedding): accelerate's FSDP tail unit
    module_params: int         # largest single module's own parameters (DeepSpeed ZeRO-3 gather)
    layer_class: str | None    # the class FSDP auto-wraps
    tied: bool = False


def model_facts(meta: torch.nn.Module) -> ModelFacts:
    base = meta.get_base_model() if hasattr(meta, "get_base_model") else meta
    names = set(getattr(base, "_no_split_modules", None) or ())
    layers = [m for m in base.modules() if type(m).__name__ in names]
    layer_cls = None
    if layers:
        layer_cls = max({type(m).__name__ for m in layers},
                        key=lambda n: sum(1 for m in layers if type(m).__name__ == n))
    layer_params = max((sum(p.numel() for p in m.parameters()) for m in layers), default=0)
    inp = base.get_input_embeddings() if hasattr(base, "get_input_embeddings") else None
    out = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    tied = inp is not None and out is not None and out.weight is inp.weight
    # accelerate's tail unit [final norm, lm_head] (+ the input embedding when tied) is not
    # resharded after forward: gathered from the end of the forward to the start of backward
    tail = sum(p.numel() for p in out.parameters()) if out is not None else 0
    seen = {id(p): p.numel() for p in base.parameters()}
    module_params = max((sum(p.numel() for p in m.parameters(recurse=False))
                         for m in base.modules()), default=0)
    return ModelFacts(sum(seen.values()), layer_params, tail, module_params, layer_cls, tied)
