"""What the Trainer will actually do with a set of arguments: ``TrainingArguments`` or a dict of
its field names -> ``TrainingSetup``, the estimator's normalised input.

Defaults and field names are read from the installed transformers, never hard-coded: a plan for
another machine can then be a plain dict (``TrainingArguments`` validates bf16/tf32 against
*this* machine, DESIGN.md).
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field
from functools import cache
from typing import Any

from transformers import TrainingArguments

from ._errors import ConfigError, HfMemkitError, did_you_mean
from ._optimizers import get_optimizer_profile
from ._sharding import Sharding, sharding_from_args

# Settings that change memory which the estimator does not model yet: warned, never ignored.
UNMODELLED = {
    "torch_compile": "torch.compile fuses kernels and changes activation memory",
    "use_liger_kernel": "Liger kernels (fused cross-entropy, RMSNorm) change activation memory",
    "neftune_noise_alpha": "NEFTune adds a noise tensor per embedding output",
}


@dataclass(frozen=True)
class TrainingSetup:
    """Everything about one training run that changes its memory."""

    micro_batch: int = field(metadata={"help": "per_device_train_batch_size"})
    grad_accum: int = field(metadata={"help": "gradient_accumulation_steps"})
    eval_batch: int = field(metadata={"help": "per_device_eval_batch_size"})
    amp: str | None = field(metadata={"help": "'bf16' / 'fp16' autocast, or None"})
    tf32: bool = field(metadata={"help": "TF32 matmuls (no memory effect; noted)"})
    checkpointing: bool = field(metadata={"help": "activation (gradient) checkpointing"})
    checkpoint_reentrant: bool = field(metadata={"help": "use_reentrant of the checkpoint function"})
    checkpoint_every_n_layers: int = field(metadata={"help": "checkpoint every n-th block"})
    optim: str = field(metadata={"help": "TrainingArguments.optim value"})
    optim_args: dict[str, str] = field(metadata={"help": "parsed optim_args"})
    max_grad_norm: float = field(metadata={"help": "gradient clipping norm (0 = off)"})
    eval_accumulation_steps: int | None = field(metadata={"help": "move eval preds to CPU every n"})
    prediction_loss_only: bool = field(default=False, metadata={"help": "eval keeps no logits"})
    sharding: Sharding = field(default_factory=Sharding, metadata={"help": "per-rank split"})
    unmodelled: tuple[str, ...] = field(default=(), metadata={"help": "warned settings"})
    notes: tuple[str, ...] = field(default=(), metadata={"help": "what reading the args assumed"})

    def replace(self, **changes: Any) -> TrainingSetup:
        return dataclasses.replace(self, **changes)


@cache
def training_args_fields() -> dict[str, Any]:
    """Field name -> default of the installed ``TrainingArguments``."""
    out = {}
    for f in dataclasses.fields(TrainingArguments):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            out[f.name] = f.default_factory()  # type: ignore[misc]
        else:
            out[f.name] = None
    return out


def _as_dict(args: TrainingArguments | dict[str, Any] | None) -> tuple[dict[str, Any], bool]:
    if args is None:
        return {}, False
    if isinstance(args, TrainingArguments):
        return {f.name: getattr(args, f.name) for f in dataclasses.fields(args)}, True
    if isinstance(args, dict):
        return dict(args), False
    raise ConfigError([f"args must be transformers.TrainingArguments or a dict of its fields, "
                       f"got {type(args).__name__}"])


def parse_optim_args(text: str | dict | None) -> dict[str, str]:
    if not text:
        return {}
    if isinstance(text, dict):
        return {str(k): str(v) for k, v in text.items()}
    return dict(kv.split("=", 1) for kv in str(text).replace(" ", "").split(",") if "=" in kv)


def resolve_checkpointing(d: dict[str, Any]) -> tuple[bool, dict[str, Any]]:
    """The new name wins when set, as TrainingArguments.__post_init__ does (DESIGN.md)."""
    new, old = d.get("activation_checkpointing"), d.get("gradient_checkpointing")
    on = bool(new) if new is not None else bool(old)
    kw_new, kw_old = d.get("activation_checkpointing_kwargs"), d.get("gradient_checkpointing_kwargs")
    kwargs = kw_new if kw_new is not None else kw_old
    return on, dict(kwargs or {})


def normalize_args(args: TrainingArguments | dict[str, Any] | None, *,
                   source: str = "args", num_gpus: int | None = None) -> TrainingSetup:
    """Read what changes memory; gather every problem and raise them together."""
    d, is_ta = _as_dict(args)
    fields = training_args_fields()
    problems: list[str] = []
    if not is_ta:
        for k in d:
            if k not in fields:
                problems.append(f"`{k}` is not a TrainingArguments field{did_you_mean(k, fields)}")

    def get(name: str) -> Any:
        v = d.get(name, fields.get(name))
        return getattr(v, "value", v)  # enums (OptimizerNames) -> str

    def positive_int(name: str) -> int:
        v = get(name)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            problems.append(f"`{name}` must be a positive integer, got {v!r}")
            return 1
        return v

    micro, accum, eval_b = (positive_int("per_device_train_batch_size"),
                            positive_int("gradient_accumulation_steps"),
                            positive_int("per_device_eval_batch_size"))
    bf16, fp16 = bool(get("bf16")), bool(get("fp16"))
    if bf16 and fp16:
        problems.append("`bf16` and `fp16` are both set; choose one mixed precision")
    optim = str(get("optim"))
    try:
        get_optimizer_profile(optim)
    except ValueError as exc:
        problems.append(str(exc))
    ckpt, ckpt_kwargs = resolve_checkpointing(d if not is_ta else {
        "activation_checkpointing": get("activation_checkpointing"),
        "activation_checkpointing_kwargs": get("activation_checkpointing_kwargs")})
    unmodelled = [f"{k}: {why}" for k, why in UNMODELLED.items() if get(k)]
    if ckpt and ckpt_kwargs.get("offload"):
        unmodelled.append("activation offloading: saved activations move to host memory")
    if num_gpus is not None and (not isinstance(num_gpus, int) or isinstance(num_gpus, bool)
                                 or num_gpus < 1):
        problems.append(f"num_gpus must be a positive integer, got {num_gpus!r}")
        num_gpus = 1
    sharding, sharding_notes = Sharding(), []
    try:
        sharding, sharding_notes = sharding_from_args(get, num_gpus)
    except HfMemkitError as exc:
        problems.append(str(exc))
    if sharding.activation_checkpointing:  # fsdp_config's own checkpointing: same memory
        ckpt = True
    if problems:
        raise ConfigError(problems, source=source)
    for msg in unmodelled:
        warnings.warn(f"hf_memkit does not model {msg}; the estimate ignores it", stacklevel=3)
    eval_acc = get("eval_accumulation_steps")
    return TrainingSetup(
        micro_batch=micro, grad_accum=accum, eval_batch=eval_b,
        amp="bf16" if bf16 else "fp16" if fp16 else None,
        tf32=bool(get("tf32")),
        checkpointing=ckpt,
        checkpoint_reentrant=bool(ckpt_kwargs.get("use_reentrant", False)),
        checkpoint_every_n_layers=int(ckpt_kwargs.get("every_n_layers", 1) or 1),
        optim=optim,
        optim_args=parse_optim_args(get("optim_args")),
        max_grad_norm=float(get("max_grad_norm") or 0.0),
        eval_accumulation_steps=int(eval_acc) if eval_acc else None,
        prediction_loss_only=bool(get("prediction_loss_only")),
        sharding=sharding,
        unmodelled=tuple(unmodelled),
        notes=tuple(sharding_notes),
    )
