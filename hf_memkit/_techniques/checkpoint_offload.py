"""Checkpoint offload: every checkpointed layer's saved input moves to pinned host memory.

Switched on by ``activation_checkpointing_kwargs={"offload": True}`` (transformers 5.23), or for
FSDP2 by accelerate's ``activation_checkpointing_offload`` (``_engines.fsdp.checkpoint_offload``:
transformers maps no ``fsdp_config`` key onto it, the Trainer's plugin reads it from the
environment that ``accelerate launch --fsdp_activation_checkpointing_offload true`` sets).

What runs:
  * transformers ``modeling_utils.PreTrainedModel._activation_checkpointing_enable(offload=True)``
    sets every module's ``_gradient_checkpointing_func`` to ``checkpoint_func``:
    ``with save_on_cpu(pin_memory=True, device_type=<the accelerator>): return checkpoint(...)``;
    ``modeling_layers.GradientCheckpointingLayer`` calls it as
    ``_gradient_checkpointing_func(partial(forward, self, **kwargs), *args)``, so only the
    layer's *positional* tensors (``hidden_states`` in transformers 5 decoders) are saved.
  * accelerate ``utils/fsdp_utils.py::fsdp2_apply_ac`` wraps each layer as
    ``offload_wrapper(checkpoint_wrapper(layer))``; torch
    ``distributed/algorithms/_checkpoint/checkpoint_wrapper.py::OffloadWrapper.forward`` runs it
    under ``save_on_cpu(pin_memory=True)``: the same saved inputs.
  * torch ``utils/checkpoint.py`` (non-reentrant): ``_CheckpointFrame.save_inputs`` saves the
    positional tensors with ``_make_saved_tensor`` *before* entering its own ``_checkpoint_hook``,
    so ``save_on_cpu``'s hooks (``autograd/graph.py::save_on_cpu``) pack exactly those; the ops
    inside the layer are saved by the checkpoint's hook (nothing) and their recompute in backward
    runs outside ``save_on_cpu``. ``pack_to_cpu``: ``torch.empty(..., pin_memory=True)`` +
    ``copy_(non_blocking=True)`` on the compute stream, no device buffer, and the graph no longer
    holds the device tensor, which is freed as soon as the next layer has consumed it.
    ``unpack_from_cpu``: ``tensor.to(device, non_blocking=True)``, a fresh device tensor made
    lazily when backward reaches that layer's recompute (no prefetch).

So on the device the forward keeps no layer input beyond the one being computed (the embedding
output while the base model's forward holds it), and the backward holds only the input of the
layer being recomputed, instead of every checkpointed layer's input. The trace does exactly this
(``trace_hook``): it wraps the fake model's ``_gradient_checkpointing_func`` in saved-tensor
hooks that keep no device tensor when packing and allocate the device copy when unpacking.

Host side: pinned blocks come from torch's ``CachingHostAllocator`` (ATen
``core/CachingHostAllocator.h::allocate``), which rounds every request up to a power of two
(defaults: no ``pinned_max_round_threshold``) and caches freed blocks for the next micro-step.
``host_bytes``: checkpointed layers x PowerOf2Ceil(micro-batch x seq x hidden x dtype bytes).
Layers that take further positional tensors (BERT's mask, T5's position bias and encoder states)
offload those too; only hidden states are counted, and encoder-decoder blocks all at ``seq_len``.

On a CPU target nothing leaves a device (``INERT``): the trace is unchanged and no host bytes are
counted.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch

from .._compat import checkpointing_field
from .._cuda.host import host_link_bandwidth, pinned_block
from .._errors import HfMemkitError
from .._model.facts import layer_count
from .base import Technique, register
from .checkpointing import resolve_checkpointing

NAME = "checkpoint_offload"
INERT = ("it moves checkpointed layer inputs from an accelerator to pinned host memory, and on a "
         "CPU they already live in host memory. On a machine without CUDA (or another "
         "accelerator) transformers' offload raises at the first forward (torch's "
         "save_on_cpu(pin_memory=True): 'pin_memory=True requires a CUDA or other accelerator "
         "backend'); drop activation_checkpointing_kwargs['offload'] for CPU training")


def _to_host(t: torch.Tensor) -> tuple:
    """``save_on_cpu.pack_to_cpu`` on a CUDA device: the copy goes to pinned host memory; the
    graph keeps no device tensor (only what ``_to_device`` needs to make one)."""
    return t.device, t.size(), t.dtype, t.layout


def _to_device(packed: tuple) -> torch.Tensor:
    """``unpack_from_cpu``: ``tensor.to(device, non_blocking=True)``, a new contiguous tensor."""
    device, size, dtype, layout = packed
    return torch.empty(size, dtype=dtype, layout=layout, device=device)


def _offloading(checkpoint_func: Callable[..., Any]) -> Callable[..., Any]:
    """transformers' ``checkpoint_func`` with ``save_on_cpu`` as CUDA runs it."""
    def offloaded(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        with torch.autograd.graph.saved_tensors_hooks(_to_host, _to_device):
            return checkpoint_func(function, *args, **kwargs)

    offloaded.mk_offloading = True  # type: ignore[attr-defined]
    return offloaded


def checkpointed_layers(model: torch.nn.Module, every_n_layers: int = 1) -> int:
    """How many layers ``_set_gradient_checkpointing`` checkpoints: every ``every_n_layers``-th
    ``GradientCheckpointingLayer`` (layer_index % n == 0)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    n = sum(isinstance(m, GradientCheckpointingLayer) for m in model.modules())
    if not n:
        n = layer_count(model.config)
    return math.ceil(n / max(1, every_n_layers))


class CheckpointOffload(Technique):
    name = NAME
    fields = ("activation_checkpointing_kwargs", "gradient_checkpointing_kwargs")
    what = "checkpointed layer inputs move to pinned host memory"
    label = title = "activation offloading"
    devices = ("cuda",)
    inert = INERT
    searched = True
    requires = ("activation_checkpointing",)
    missing = "transformers >= 5.17 (activation_checkpointing_kwargs={'offload': True})"
    ladder = 40
    # the forward moves each checkpointed layer's saved input to the host (one hidden state per
    # layer) and holds no new device tensor
    forward_like = True

    def read(self, explicit: Mapping[str, Any],
             get: Callable[[str], Any]) -> dict[str, Any] | None:
        on, kwargs = resolve_checkpointing(explicit)
        if on and kwargs.get("offload"):
            return {"offload": True}
        from .._engines.fsdp import AC_OFFLOAD_ENV, checkpoint_offload

        return {"offload": True, "via": AC_OFFLOAD_ENV} if checkpoint_offload(get) else None

    def trace_hook(self, model: Any, options: Mapping[str, Any], *, stage: str, adapters: bool,
                   target: Any = None) -> None:
        """After checkpointing's hook (hooks run in the order of their names, and offload is
        only read with checkpointing on): wrap every checkpoint function it set."""
        if stage != "train" or target is None:  # eval saves nothing; a CPU target: see INERT
            return
        wrapped: dict[int, Callable[..., Any]] = {}
        for module in model.modules():
            fn = getattr(module, "_gradient_checkpointing_func", None)
            if fn is None or getattr(fn, "mk_offloading", False):
                continue
            module._gradient_checkpointing_func = wrapped.setdefault(id(fn), _offloading(fn))
        if not wrapped:
            raise HfMemkitError(f"{type(model).__name__}: activation offloading found no "
                                "checkpointed layer to offload (checkpointing was not applied)")

    def host_bytes(self, spec: Any, setup: Any, seq_len: int, options: Mapping[str, Any],
                   compute_dtype: torch.dtype) -> int:
        text = spec.config.get_text_config()
        hidden = int(getattr(text, "hidden_size", 0) or getattr(text, "d_model", 0) or 0)
        base = spec.meta.get_base_model() if hasattr(spec.meta, "get_base_model") else spec.meta
        layers = checkpointed_layers(base, setup.checkpoint_every_n_layers)
        return layers * pinned_block(setup.micro_batch * seq_len * hidden * compute_dtype.itemsize)

    def extra_seconds(self, *, shape: Any, dev: Any, itemsize: int) -> float:
        """Each checkpointed layer's input goes to the host in the forward and back in the
        backward, copied on the compute stream (``pack_to_cpu``'s ``copy_(non_blocking=True)``
        is ordered with the kernels around it; ``unpack_from_cpu`` is awaited by the
        recompute), so the copies add to the step instead of hiding under it: 2 x layers x seq x
        hidden x bytes per sample over the host link."""
        nbytes = 2 * shape.layers * shape.seq_len * shape.hidden * itemsize
        return nbytes / host_link_bandwidth(dev)

    def emit(self, on: bool, pins: Mapping[str, Any]) -> dict[str, Any]:
        """Merged into checkpointing's kwargs (``Technique.emit``: dict values merge)."""
        return {checkpointing_field() + "_kwargs": {"offload": True}} if on else {}

    def pinned(self, pins: Mapping[str, Any]) -> bool | None:
        """Pinned checkpointing kwargs say whether to offload (when checkpointing is on)."""
        kwargs = resolve_checkpointing({k: v for k, v in pins.items()
                                        if k.endswith("_kwargs")})[1]
        given = any(f in pins for f in self.fields)
        return bool(kwargs.get("offload")) if given else None

    def available(self) -> bool:
        """The installed transformers takes ``offload`` (``_activation_checkpointing_enable``)."""
        import inspect

        from transformers import PreTrainedModel

        enable = getattr(PreTrainedModel, "_activation_checkpointing_enable", None)
        return enable is not None and "offload" in inspect.signature(enable).parameters

    def supported(self, model_cls: type) -> bool:
        return bool(getattr(model_cls, "supports_gradient_checkpointing", False))


register(CheckpointOffload())
