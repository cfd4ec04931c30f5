"""``use_liger_kernel`` (+ ``liger_kernel_config``): Liger's Triton kernels, patched into the model
by the Trainer (transformers ``integrations/liger.py::apply_liger_kernel`` ->
``_apply_liger_kernel_to_instance(model, **liger_kernel_config)``).

Traced for CUDA targets by patching the fake model as Liger does, with autograd Functions that
allocate and save what Liger's kernels' wrappers do (``kernels``): fused linear
cross-entropy in chunks (no [tokens x vocab] logits), RMSNorm, SwiGLU/GEGLU, RoPE, and the
optional cross-entropy kernel, each as ``liger_kernel_config`` switches it. Liger needs a GPU
(Triton), so a CPU (or MPS) target is refused.

No extra FLOPs: with the Trainer's "mean"/"sum" reduction the fused loss computes the logits'
gradient in the forward (``fused_linear_cross_entropy_forward``) instead of in the backward, the
same three [tokens x H x V] matmuls; nothing is recomputed (only reduction="none" defers, and
recomputes, the gradient: the Trainer never asks for it).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ..._errors import HfMemkitError
from ..base import Technique, TechniqueUse, register

NAME = "use_liger_kernel"


def refusal(device: str = "a CPU") -> str:
    return (f"use_liger_kernel=True cannot run on {device}: Liger's kernels are Triton GPU "
            "kernels. Drop use_liger_kernel (and liger_kernel_config) for this device, or "
            "estimate for the GPU it will run on with device= (e.g. device=\"A100-80GB\")")


def layers_only(config: Mapping[str, Any] | None) -> dict[str, bool]:
    """``liger_kernel_config`` as TRL's ``SFTTrainer``/``DPOTrainer`` pass it on: their fused
    log-prob head replaces the model's forward, so they refuse Liger's fused linear
    cross-entropy and keep only its layer kernels (``trl/trainer/sft_trainer.py``: "Liger's
    fused linear cross-entropy replaces ``model.forward`` ... only its layer kernels are
    applied")."""
    config = dict(config or {})
    if config.get("fused_linear_cross_entropy"):
        raise HfMemkitError("liger_kernel_config={'fused_linear_cross_entropy': True} is not "
                            "supported by TRL's trainers (their fused log-prob head patches "
                            "the model's forward, and TRL raises); drop that key, the other "
                            "Liger kernels still apply")
    return {**config, "fused_linear_cross_entropy": False}


def liger_layers_only(uses: frozenset[TechniqueUse]) -> frozenset[TechniqueUse]:
    """The techniques as TRL's trainers pass them on: Liger's layer kernels only
    (``layers_only``), the rest unchanged."""
    out = set()
    for u in uses:
        if u.name == NAME:
            opts = dict(u.options)
            config = layers_only(dict(opts.get("config") or ()))
            u = TechniqueUse.of(NAME, {**opts, "config": config})
        out.add(u)
    return frozenset(out)



class Liger(Technique):
    name = NAME
    fields = ("use_liger_kernel", "liger_kernel_config")
    what = ("Liger kernels: fused linear cross-entropy in chunks (no [tokens x vocab] logits), "
            "RMSNorm, SwiGLU and RoPE that save fewer activations")
    label = "Liger kernels"
    devices = ("cuda",)
    searched = True
    missing = "liger-kernel (pip install liger-kernel)"
    ladder = 10

    def read(self, explicit: Mapping[str, Any],
             get: Callable[[str], Any]) -> dict[str, Any] | None:
        if not get("use_liger_kernel"):
            return None
        config = get("liger_kernel_config") or {}
        if not isinstance(config, Mapping):
            raise HfMemkitError(f"liger_kernel_config must be a dict of kernel switches (e.g. "
                                f"{{'fused_linear_cross_entropy': False}}), got {config!r}")
        # the Trainer's eval with prediction_loss_only passes skip_logits=True (trainer.py)
        return {"value": True, "config": {str(k): bool(v) for k, v in config.items()},
                "prediction_loss_only": bool(get("prediction_loss_only"))}

    def trace_hook(self, model: Any, options: Mapping[str, Any], *, stage: str, adapters: bool,
                   target: Any = None) -> None:
        if target is None:
            raise HfMemkitError(refusal())
        from .kernels import apply_liger

        skip = True if stage == "eval" and options.get("prediction_loss_only") else None
        try:
            apply_liger(model, dict(options.get("config") or ()),
                        compute_capability=target.compute_capability, skip_logits=skip)
        except ValueError as exc:  # Liger's own assert, before any training step
            raise HfMemkitError(f"liger_kernel_config: {exc} Set one of them to False (the "
                                "default is fused_linear_cross_entropy=True, "
                                "cross_entropy=False)") from exc

    def supported(self, model_cls: type) -> bool:
        from .kernels import MODEL_TYPES

        config_class = getattr(model_cls, "config_class", None)
        return str(getattr(config_class, "model_type", "")) in MODEL_TYPES

    def available(self) -> bool:
        import importlib.util

        return importlib.util.find_spec("liger_kernel") is not None

    def emit(self, on: bool, pins: Mapping[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {"use_liger_kernel": on}
        if on and "liger_kernel_config" in pins:
            out["liger_kernel_config"] = dict(pins["liger_kernel_config"] or {})
        return out

    def pinned(self, pins: Mapping[str, Any]) -> bool | None:
        return bool(pins["use_liger_kernel"]) if "use_liger_kernel" in pins else None


register(Liger())
