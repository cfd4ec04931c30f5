"""What the Trainer will actually do with a set of arguments: ``TrainingArguments`` or a dict of
its field names -> ``TrainingSetup``, the estimator's normalised input.

Defaults and field names are read from the installed transformers, never hard-coded: a plan for
another machine can then be a plain dict (``TrainingArguments`` validates bf16/tf32 against
*this* machine, docs/stack-facts.md). Memory techniques are read by their registry entries
(``_techniques``), the data-parallel engine by its (``_engines``).
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from dataclasses import dataclass, field
from typing import Any

from transformers import TrainingArguments

from .._cuda.collectives import RING, ULYSSES, SequenceSplit
from .._engines import ENGINES, Engine, ParallelDims, Sharding, sharding_from_args
from .._errors import ConfigError, HfMemkitError, did_you_mean
from .._optimizers import TARGET_MODULES_ARG, get_optimizer_profile
from .._techniques import TechniqueUse, read_techniques, unmodelled
from .._techniques.base import frozen
from .._techniques.checkpointing import NAME as CHECKPOINTING
from .._trainers import TRAINER, TRAINERS, TrainerKind, trainer_of_args
from .coverage import unmodelled_settings
from .fields import check_field, config_fields, training_args_fields

# Fields that never change what a traced forward/backward allocates: the trace cache key is every
# other field of the setup, so a new field (or technique) is part of the key by construction.
TRACE_INDEPENDENT = frozenset({
    "micro_batch", "eval_batch", "grad_accum", "optim", "optim_args", "max_grad_norm", "tf32",
    "eval_accumulation_steps", "prediction_loss_only", "sharding", "parallel", "unmodelled",
    "notes"})
PLAIN = TechniqueUse(TRAINER.name)


@dataclass(frozen=True)
class TrainingSetup:
    """Everything about one training run that changes its memory."""

    micro_batch: int = field(metadata={"help": "per_device_train_batch_size"})
    grad_accum: int = field(metadata={"help": "gradient_accumulation_steps"})
    eval_batch: int = field(metadata={"help": "per_device_eval_batch_size"})
    amp: str | None = field(metadata={"help": "'bf16' / 'fp16' autocast, or None"})
    tf32: bool = field(metadata={"help": "TF32 matmuls (no memory effect; noted)"})
    optim: str = field(metadata={"help": "TrainingArguments.optim value"})
    optim_args: dict[str, str] = field(metadata={"help": "parsed optim_args"})
    max_grad_norm: float = field(metadata={"help": "gradient clipping norm (0 = off)"})
    eval_accumulation_steps: int | None = field(metadata={"help": "move eval preds to CPU every n"})
    prediction_loss_only: bool = field(default=False, metadata={"help": "eval keeps no logits"})
    techniques: frozenset[TechniqueUse] = field(
        default=frozenset(), metadata={"help": "memory techniques that are on (_techniques)"})
    sharding: Sharding = field(default_factory=Sharding, metadata={"help": "per-rank split"})
    parallel: ParallelDims = field(default_factory=ParallelDims, metadata={
        "help": "the run's parallel dimensions (parallelism_config; _engines.dims)"})
    trainer: TechniqueUse = field(default=PLAIN, metadata={
        "help": "the trainer (_trainers) and the options its config sets"})
    unmodelled: tuple[str, ...] = field(default=(), metadata={"help": "warned settings"})
    notes: tuple[str, ...] = field(default=(), metadata={"help": "what reading the args assumed"})

    def replace(self, **changes: Any) -> TrainingSetup:
        return dataclasses.replace(self, **changes)

    def uses(self, name: str) -> TechniqueUse | None:
        return next((u for u in self.techniques if u.name == name), None)

    @property
    def engine(self) -> Engine:
        """The registered engine of ``sharding`` (``_engines``)."""
        return ENGINES.get(self.sharding.engine)

    @property
    def trainer_kind(self) -> TrainerKind:
        """The registered trainer (``_trainers``); its options are ``trainer_options``."""
        return TRAINERS.get(self.trainer.name)

    @property
    def trainer_options(self) -> dict[str, Any]:
        return dict(self.trainer.options)

    @property
    def checkpointing(self) -> bool:
        return self.uses(CHECKPOINTING) is not None

    @property
    def checkpoint_every_n_layers(self) -> int:
        use = self.uses(CHECKPOINTING)
        return int(use.option("every_n_layers", 1)) if use else 1

    def trace_key(self) -> tuple:
        """Every field a trace can depend on (all but ``TRACE_INDEPENDENT``), hashable; of the
        parallel dimensions, the sequence split (the trace runs one rank's model and tokens)."""
        key = tuple((f.name, frozen(getattr(self, f.name)))
                    for f in dataclasses.fields(self) if f.name not in TRACE_INDEPENDENT)
        split = self.sequence_split()
        return key + (("split", split.key()),) if split is not None else key

    def sequence_split(self) -> SequenceSplit | None:
        """How each attention call shares its sequence with other ranks (CP: torch ring
        attention; SP: DeepSpeed Ulysses), or None."""
        p = self.parallel
        if p.cp > 1:
            return SequenceSplit(RING, p.cp, p.cp_comm)
        return SequenceSplit(ULYSSES, p.sp) if p.sp > 1 else None

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["techniques"] = {u.name: dict(u.options) for u in sorted(self.techniques)}
        d["sharding"] = self.sharding.to_dict()
        d["parallel"] = self.parallel.to_dict()
        d["trainer"] = {"name": self.trainer.name, "options": dict(self.trainer.options)}
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainingSetup:
        d = dict(d)
        d["sharding"] = Sharding(**d.get("sharding", {}))
        d["parallel"] = ParallelDims(**d.get("parallel", {}))
        d["techniques"] = frozenset(TechniqueUse.of(n, o)
                                    for n, o in (d.get("techniques") or {}).items())
        d["unmodelled"] = tuple(d.get("unmodelled", ()))
        d["notes"] = tuple(d.get("notes", ()))
        t = d.get("trainer") or {"name": TRAINER.name}
        d["trainer"] = TechniqueUse.of(t["name"], t.get("options"))
        return cls(**d)


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


def _optim_args(r: _Reader) -> dict[str, str]:
    """The parsed ``optim_args``, plus ``optim_target_modules`` (GaLore / APOLLO) under
    ``TARGET_MODULES_ARG`` for the optimizer entries (_optimizers/base.py)."""
    parsed = parse_optim_args(r.get("optim_args"))
    targets = r.get("optim_target_modules")
    if targets is not None:
        parsed[TARGET_MODULES_ARG] = json.dumps(
            targets if isinstance(targets, str) else list(targets))
    return parsed


class _Reader:
    """Reads fields (with the installed defaults) and gathers every problem."""

    def __init__(self, d: dict[str, Any], is_ta: bool, cls: type = TrainingArguments):
        self.d, self.is_ta = d, is_ta
        self.fields = config_fields(cls)
        self.problems: list[str] = []
        if not is_ta:
            for k in d:
                if k not in self.fields:
                    self.problems.append(f"`{k}` is not a {cls.__name__} field"
                                         f"{did_you_mean(k, self.fields)}")
                    continue
                try:  # by the field's type, as Python values: bf16="False" is refused
                    d[k] = check_field(k, d[k], cls=cls, text=False)
                except HfMemkitError as exc:
                    self.problems.append(str(exc))

    def get(self, name: str) -> Any:
        v = self.d.get(name, self.fields.get(name))
        return getattr(v, "value", v)  # enums (OptimizerNames) -> str

    def positive_int(self, name: str) -> int:
        v = self.get(name)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            if not any(p.startswith(f"`{name}` ") for p in self.problems):  # said once
                self.problems.append(f"`{name}` must be a positive integer, got {v!r}")
            return 1
        return v

    def explicit(self) -> dict[str, Any]:
        """The fields a user set. ``TrainingArguments`` keeps both checkpointing names in sync;
        its new name is the truth (docs/stack-facts.md)."""
        if not self.is_ta:  # a TRL config's own defaults that differ from TrainingArguments'
            plain = training_args_fields()
            ckpt = ("activation_checkpointing", "gradient_checkpointing")
            given = any(k.startswith(ckpt) for k in self.d)  # either name, as __post_init__
            own = {k: v for k, v in self.fields.items() if k in plain and v != plain[k]
                   and not k.startswith("gradient_checkpointing")
                   and not (given and k.startswith(ckpt))}
            return {**own, **self.d}
        return {k: v for k, v in self.d.items() if not k.startswith("gradient_checkpointing")}


def _trainer_getter(r: _Reader, kind: Any) -> Any:
    """``r.get`` for the trainer entry, except that a field its config's ``__post_init__``
    derives from others (``TrainerKind.derived``: GRPO's ``generation_batch_size`` and
    ``steps_per_generation``) reads None unless given: a dict's defaults come from a default
    instance, derived from its batch size rather than the user's."""
    return lambda name: (r.d.get(name) if name in kind.derived and not r.is_ta else r.get(name))


def _check_num_gpus(num_gpus: Any, problems: list[str]) -> int | None:
    if num_gpus is not None and (not isinstance(num_gpus, int) or isinstance(num_gpus, bool)
                                 or num_gpus < 1):
        problems.append(f"num_gpus must be a positive integer, got {num_gpus!r}")
        return 1
    return num_gpus


def normalize_args(args: TrainingArguments | dict[str, Any] | None, *,
                   source: str = "args", num_gpus: int | None = None,
                   trainer: str | None = None, ref_model: bool | None = None) -> TrainingSetup:
    """Read what changes memory; gather every problem and raise them together. ``trainer``:
    a registered trainer name (default: from the config's class, ``_trainers``);
    ``ref_model``: DPO / KTO only, the user passes their own reference model."""
    kind = TRAINERS.get(trainer_of_args(args, trainer))
    if ref_model is not None and not kind.takes_ref_model:
        takers = " / ".join(k.title for k in TRAINERS if k.takes_ref_model)
        raise ConfigError([f"ref_model is a {takers} setting, but the trainer is "
                           f"{kind.title}; leave ref_model out"], source=source)
    r = _Reader(*_as_dict(args), cls=kind.config_type())
    micro, accum, eval_b = (r.positive_int("per_device_train_batch_size"),
                            r.positive_int("gradient_accumulation_steps"),
                            r.positive_int("per_device_eval_batch_size"))
    bf16, fp16 = bool(r.get("bf16")), bool(r.get("fp16"))
    if bf16 and fp16:
        r.problems.append("`bf16` and `fp16` are both set; choose one mixed precision")
    optim = str(r.get("optim"))
    try:
        get_optimizer_profile(optim)
    except ValueError as exc:
        r.problems.append(str(exc))
    uses = set(kind.adjust(read_techniques(r.explicit(), r.get)))
    num_gpus = _check_num_gpus(num_gpus, r.problems)
    sharding, dims, sharding_notes = Sharding(), ParallelDims(), []
    try:
        sharding, dims, sharding_notes = sharding_from_args(r.get, num_gpus)
    except ConfigError as exc:
        r.problems.extend(exc.problems)
    except HfMemkitError as exc:
        r.problems.append(str(exc))
    if sharding.activation_checkpointing and not any(u.name == CHECKPOINTING for u in uses):
        # fsdp_config's own checkpointing: the same memory as the Trainer's
        uses.add(TechniqueUse.of(CHECKPOINTING, {"use_reentrant": False, "every_n_layers": 1,
                                                 "offload": False}))
    if r.problems:
        raise ConfigError(r.problems, source=source)
    options = dict(kind.read(_trainer_getter(r, kind)))
    if kind.config_problems(options):
        raise ConfigError(kind.config_problems(options), source=source)
    if ref_model is not None:
        options["ref_model"] = bool(ref_model)
    warned = unmodelled(uses) + kind.unmodelled(options) + unmodelled_settings(
        r.d, r.fields, kind.name, r.get)
    for msg in warned:
        warnings.warn(f"hf_memkit does not model {msg}; the estimate ignores it", stacklevel=3)
    eval_acc = r.get("eval_accumulation_steps")
    return TrainingSetup(
        micro_batch=micro, grad_accum=accum, eval_batch=eval_b,
        amp="bf16" if bf16 else "fp16" if fp16 else None, tf32=bool(r.get("tf32")),
        optim=optim, optim_args=_optim_args(r),
        max_grad_norm=float(r.get("max_grad_norm") or 0.0),
        eval_accumulation_steps=int(eval_acc) if eval_acc else None,
        prediction_loss_only=bool(r.get("prediction_loss_only")),
        techniques=frozenset(uses), sharding=sharding, parallel=dims, unmodelled=tuple(warned),
        notes=tuple(sharding_notes) + tuple(kind.notes(options)),
        trainer=TechniqueUse.of(kind.name, options),
    )
