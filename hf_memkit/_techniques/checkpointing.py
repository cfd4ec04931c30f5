"""Activation (gradient) checkpointing: keep only each layer's input, recompute in backward.

Switched on by ``activation_checkpointing`` (transformers 5) or the older
``gradient_checkpointing``; the new name wins when set, as ``TrainingArguments.__post_init__``
does (docs/stack-facts.md#checkpointing-field-names). Traced by wrapping the fake model's
layers exactly as the Trainer does; recomputing the forward costs 2N FLOPs per token plus a
third of the attention's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from .._compat import checkpointing_field
from .base import Technique, register

NAME = "activation_checkpointing"


def resolve_checkpointing(d: Mapping[str, Any]) -> tuple[bool, dict[str, Any]]:
    """(on, kwargs) from explicitly given fields: the new name wins when set."""
    new, old = d.get("activation_checkpointing"), d.get("gradient_checkpointing")
    on = bool(new) if new is not None else bool(old)
    kw_new, kw_old = d.get("activation_checkpointing_kwargs"), d.get("gradient_checkpointing_kwargs")
    kwargs = kw_new if kw_new is not None else kw_old
    return on, dict(kwargs or {})


def _options(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    return {"use_reentrant": bool(kwargs.get("use_reentrant", False)),
            "every_n_layers": int(kwargs.get("every_n_layers", 1) or 1),
            "offload": bool(kwargs.get("offload", False))}


class Checkpointing(Technique):
    name = NAME
    fields = ("activation_checkpointing", "gradient_checkpointing",
              "activation_checkpointing_kwargs", "gradient_checkpointing_kwargs")
    what = "recomputes each layer's forward in backward; keeps only layer inputs"
    label = "checkpointing"
    title = "gradient checkpointing"
    searched = True
    ladder = 30

    def read(self, explicit: Mapping[str, Any],
             get: Callable[[str], Any]) -> dict[str, Any] | None:
        on, kwargs = resolve_checkpointing(explicit)
        return _options(kwargs) if on else None

    def trace_hook(self, model: Any, options: Mapping[str, Any], *, stage: str, adapters: bool,
                   target: Any = None) -> None:
        if stage != "train":
            return
        from .._trace.step import enable_checkpointing

        reentrant = bool(options.get("use_reentrant", False))
        enable_checkpointing(model, {"use_reentrant": reentrant})
        if reentrant or adapters:
            model.enable_input_require_grads()  # as the Trainer does for PEFT / reentrant

    def extra_flops(self, n_params: int, attn_flops: float) -> float:
        return 2 * n_params + attn_flops / 3

    def pinned(self, pins: Mapping[str, Any]) -> bool | None:
        """Pinned kwargs alone (``{"offload": True}``) configure checkpointing, not switch it."""
        if "activation_checkpointing" in pins or "gradient_checkpointing" in pins:
            return resolve_checkpointing(pins)[0]
        return None

    def emit(self, on: bool, pins: Mapping[str, Any]) -> dict[str, Any]:
        """Non-reentrant (safe with PEFT) unless the user pinned checkpointing kwargs."""
        f = checkpointing_field()
        out: dict[str, Any] = {f: on}
        if on:
            out[f + "_kwargs"] = {"use_reentrant": False, **resolve_checkpointing(pins)[1]}
        return out

    def prepare(self, model: Any) -> Any:
        from .._trace.step import enable_checkpointing

        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        enable_checkpointing(base, {"use_reentrant": False})
        return model

    def supported(self, model_cls: type) -> bool:
        return bool(getattr(model_cls, "supports_gradient_checkpointing", False))


register(Checkpointing())
