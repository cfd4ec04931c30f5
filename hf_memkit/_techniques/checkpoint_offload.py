"""Checkpoint offload (``activation_checkpointing_kwargs={"offload": True}``): every checkpointed
layer input moves to pinned host memory. Not modelled yet: warned."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from .base import Technique, register
from .checkpointing import resolve_checkpointing


def _read(explicit: Mapping[str, Any], get: Callable[[str], Any]) -> dict[str, Any] | None:
    on, kwargs = resolve_checkpointing(explicit)
    return {"offload": True} if on and kwargs.get("offload") else None


register(Technique("checkpoint_offload", fields=("activation_checkpointing_kwargs",),
                   read=_read, what="saved activations move to host memory", modelled=False,
                   label="activation offloading"))
