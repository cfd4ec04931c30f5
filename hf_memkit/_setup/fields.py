"""The fields of the config classes a trainer takes (``TrainingArguments``; TRL's ``SFTConfig`` and
``DPOConfig``): their defaults, types, coercion and value ranges, one set of rules for any
installed config class. Recipe pins, the command line's ``FIELD=VALUE`` settings and the dicts
``normalize_args`` reads all go through ``check_config_field`` / ``check_field``.

Defaults and types are read from the installed classes, never hard-coded (a plan for another
machine is a plain dict, docs/stack-facts.md). A field typed as one scalar is coerced by its type: a
bool / int / float field parses text (true/false, 1/0, yes/no in any case; ``none`` where the
field allows None) and rejects a value of another type; a ``str`` field takes a string (an enum
field: one of its values; ``optim`` is checked against the optimizer registry instead). Text is
parsed only where the value was text (the command line, a recipe): in Python code (an API dict, a
``plan_training`` pin) a string in a bool / int / float field is refused, since
``TrainingArguments(bf16="False")`` reads it as true (``text=False``). Fields of
other types (lists, dicts, ``int | str``) pass as given: the config class checks them when it
is built. ``TrainingArguments``' own ``str | None`` fields pass as given too: the Trainer takes
other values there (``fsdp=True``, a dict of ``optim_args``).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from functools import cache
from typing import Any, NamedTuple

from transformers import TrainingArguments

from .._errors import HfMemkitError, did_you_mean, quoted
from .._trainers.packing import MAX_BATCH, MAX_TOKENS

# -- defaults and names -------------------------------------------------------------------------

# the config fields that configure a push to the Hub (transformers' "Hub Integration" block)
HUB_FIELDS = ("push_to_hub", "hub_model_id", "hub_strategy", "hub_token", "hub_private_repo",
              "hub_always_push", "hub_revision")
# the fields that say where a run's results go: only the person who launches it sets them, never
# a file shared with them (a recipe's pins, a plan JSON)
OUTBOUND_FIELDS = ("output_dir", "report_to", *HUB_FIELDS)


def training_args_fields() -> dict[str, Any]:
    """Field name -> default of the installed ``TrainingArguments``."""
    return config_fields(TrainingArguments)


@cache
def config_fields(cls: type) -> dict[str, Any]:
    """Field name -> default of a config class. A TRL config's defaults are read from an
    instance, since its ``__post_init__`` sets some (``SFTConfig``: bf16 and checkpointing
    on), built with ``use_cpu=True`` so that this machine's hardware does not refuse them."""
    if cls is not TrainingArguments:
        import tempfile

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            inst = cls(output_dir=tempfile.gettempdir(), use_cpu=True, report_to=[])
        plain = config_fields(TrainingArguments)
        return {f.name: plain["use_cpu"] if f.name == "use_cpu" else getattr(inst, f.name)
                for f in dataclasses.fields(cls)}
    out = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            out[f.name] = f.default_factory()  # type: ignore[misc]
        else:
            out[f.name] = None
    return out


@cache
def config_field_names(cls: type) -> frozenset[str]:
    return frozenset(f.name for f in dataclasses.fields(cls) if f.init)


def config_class(trainer: str | None) -> type:
    """The installed config class of a registered trainer (``None``: ``TrainingArguments``);
    ``HfMemkitError`` for a name that is not registered (TRL's GRPO etc. refused by name) or
    a TRL that is not installed (with the ``pip install`` that fixes it)."""
    from .._trainers import TRAINER, TRAINERS, trainer_of_args

    return TRAINERS.get(trainer_of_args(None, trainer or TRAINER.name)).config_type()


# -- types --------------------------------------------------------------------------------------


class FieldType(NamedTuple):
    """A field typed as one scalar: ``kind`` (bool | int | float | str), whether None is allowed,
    and the allowed strings of an enum field."""

    kind: type
    optional: bool = False
    choices: tuple[str, ...] = ()


def _field_type(hint: Any, *, declared_by_trainer_args: bool) -> FieldType | None:
    import enum
    import types
    import typing

    union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    members = typing.get_args(hint) if union else (hint,)
    kinds = [a for a in members if a is not type(None)]
    optional = len(kinds) < len(members)
    enums = [k for k in kinds if isinstance(k, type) and issubclass(k, enum.Enum)]
    if len(kinds) == 1 and kinds[0] in (bool, int, float):
        return FieldType(kinds[0], optional)
    if kinds == [str] and not (optional and declared_by_trainer_args):
        return FieldType(str, optional)
    if enums and not optional and set(kinds) == {str, *enums}:
        return FieldType(str, False, tuple(str(m.value) for m in enums[0]))
    return None


@cache
def field_types(cls: type = TrainingArguments) -> dict[str, FieldType]:
    """Field name -> ``FieldType`` for the fields of ``cls`` typed as one scalar (the others are
    not listed and pass as given)."""
    import typing

    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # an annotation this Python cannot evaluate: check nothing by type
        return {}
    plain = config_field_names(TrainingArguments)
    out = {}
    for name in config_field_names(cls):
        ftype = _field_type(hints.get(name), declared_by_trainer_args=name in plain)
        if ftype is not None:
            out[name] = ftype
    return out


# -- coercion -----------------------------------------------------------------------------------

_TRUE, _FALSE = ("true", "1", "yes"), ("false", "0", "no")
_EXPECTED = {bool: "a boolean (true/false, 1/0, yes/no)", int: "an integer",
             float: "a number (e.g. 2e-4)", str: "a string"}
_PY_EXPECTED = {bool: "True or False", int: "an int", float: "a number (an int or a float)"}
_NO_VALUE = object()


def _described(v: Any) -> str:
    return quoted(v) if isinstance(v, str) else f"{quoted(v)} ({type(v).__name__})"


def _parse_text(text: str, kind: type) -> Any:
    """A bool / int / float read from text, or ``_NO_VALUE``."""
    if kind is bool:
        return text in _TRUE if text in _TRUE + _FALSE else _NO_VALUE
    for read in ((int,) if kind is int else (int, float)):  # logging_steps=10 stays an int
        try:
            v = read(text)
        except ValueError:
            continue
        return v if math.isfinite(v) else _NO_VALUE
    return _NO_VALUE


def _typed(value: Any, kind: type) -> Any:
    """``value`` when it already has type ``kind`` (0/1 for a bool), or ``_NO_VALUE``."""
    if isinstance(value, bool):
        return value if kind is bool else _NO_VALUE
    if kind is bool:
        return bool(value) if type(value) is int and value in (0, 1) else _NO_VALUE
    if kind is int:
        return value if isinstance(value, int) else _NO_VALUE
    ok = isinstance(value, (int, float)) and math.isfinite(value)
    return value if ok else _NO_VALUE


def _string(name: str, value: Any, ftype: FieldType, raw: str | None) -> Any:
    """A ``str`` / ``Enum | str`` field: the command line's text as given, a string (one of the
    choices for an enum; ``optim`` is checked against hf_memkit's optimizer registry instead),
    or an enum member."""
    import enum

    if isinstance(value, enum.Enum):
        return value
    if raw is not None and not ftype.choices:  # `dataset_text_field=123` is "123"
        return raw
    allowed = f"one of {', '.join(map(repr, ftype.choices))}" if ftype.choices else "a string"
    if not isinstance(value, str):
        hint = (f"; in YAML quote it ('{'yes' if value else 'no'}'): unquoted yes/no/true/false "
                "are booleans") if isinstance(value, bool) else ""
        none = " or none" if ftype.optional else ""
        raise HfMemkitError(f"`{name}` expects {allowed}{none}, got {_described(value)}{hint}")
    if ftype.choices and name != "optim" and value not in ftype.choices:
        raise HfMemkitError(f"`{name}` expects {allowed}, got {quoted(value)}"
                            f"{did_you_mean(value, ftype.choices)}")
    return value


def _python_text(name: str, value: str, ftype: FieldType) -> HfMemkitError:
    """A string given in Python code for a bool / int / float field: refused, with the value
    to pass instead where the text reads as one (``bf16="False"``: pass ``bf16=False``)."""
    got = _parse_text(value.strip().lower(), ftype.kind)
    none = " or None" if ftype.optional else ""
    why = ", which Python reads as true" if ftype.kind is bool else ""
    fix = f"{name}={got!r}" if got is not _NO_VALUE else f"{_PY_EXPECTED[ftype.kind]}{none}"
    return HfMemkitError(f"`{name}` expects {_PY_EXPECTED[ftype.kind]}{none}, got {quoted(value)} "
                         f"(a string{why}): pass {fix}; text is parsed as a value only on the "
                         "command line and in recipes")


def coerce(name: str, value: Any, ftype: FieldType, *, raw: str | None = None,
           text: bool = True) -> Any:
    """``value`` of field ``name`` with the field's type (``FieldType``); ``raw``: the text it
    was read from on the command line, if any; ``text=False``: the value comes from Python code,
    where a string in a bool / int / float field is refused rather than parsed. A value of
    another type raises ``HfMemkitError`` naming the field, the value and the type expected."""
    if ftype.optional and (value is None or (text and isinstance(value, str)
                                             and value.strip().lower() in ("none", "null"))):
        return None
    if ftype.kind is str:
        return _string(name, value, ftype, raw)
    if isinstance(value, str) and not text:
        raise _python_text(name, value, ftype)
    got = _parse_text(value.strip().lower(), ftype.kind) if isinstance(value, str) else \
        _typed(value, ftype.kind)
    if got is _NO_VALUE:
        raise HfMemkitError(f"`{name}` expects {_EXPECTED[ftype.kind]}"
                            f"{' or none' if ftype.optional else ''}, got {_described(value)}")
    return got


# -- ranges -------------------------------------------------------------------------------------

# Value ranges of numeric config fields: (rule, what is allowed). TrainingArguments rejects some
# only when it is built on the target machine (warmup_steps < 0, logging_steps 0), others never
# (max_steps 0 trains nothing, a negative learning rate), and TRL checks some only when the
# trainer runs; a plan is a dict, so the rules are checked here, at load and validate time.
def _steps(v: float) -> bool:
    return v > 0 and (v <= 1 or float(v).is_integer())


_STEPS = "a positive number of steps (an integer), or a ratio of the run in (0, 1]"
_BATCH = f"a positive integer (at most {MAX_BATCH} = 2**20)"
FIELD_RANGES: dict[str, tuple[Any, str]] = {
    # transformers.TrainingArguments
    "max_steps": (lambda v: v == -1 or 0 < v <= 2**31, "a positive number of optimizer steps "
                  "(at most 2**31), or -1 (the default: train for num_train_epochs)"),
    "num_train_epochs": (lambda v: v > 0, "a positive number of epochs"),
    "learning_rate": (lambda v: v >= 0, "a learning rate >= 0, e.g. 2e-4"),
    "warmup_steps": (lambda v: v >= 0, "steps >= 0 (or a ratio of the run in [0, 1))"),
    "weight_decay": (lambda v: v >= 0, "a weight decay >= 0"),
    "max_grad_norm": (lambda v: v >= 0, "a clipping norm >= 0 (0 = no clipping)"),
    "adam_beta1": (lambda v: 0 <= v < 1, "a decay rate in [0, 1), e.g. 0.9"),
    "adam_beta2": (lambda v: 0 <= v < 1, "a decay rate in [0, 1), e.g. 0.999"),
    "adam_epsilon": (lambda v: v >= 0, "an epsilon >= 0, e.g. 1e-8"),
    "label_smoothing_factor": (lambda v: 0 <= v < 1, "a factor in [0, 1)"),
    "logging_steps": (_steps, _STEPS),
    "eval_steps": (_steps, _STEPS),
    "save_steps": (_steps, _STEPS),
    "per_device_train_batch_size": (lambda v: 1 <= v <= MAX_BATCH, _BATCH),
    "per_device_eval_batch_size": (lambda v: 1 <= v <= MAX_BATCH, _BATCH),
    "gradient_accumulation_steps": (lambda v: 1 <= v <= MAX_BATCH, _BATCH),
    "eval_accumulation_steps": (lambda v: 1 <= v <= MAX_BATCH, _BATCH),
    "torch_empty_cache_steps": (lambda v: v >= 1, "a positive integer"),
    "dataloader_num_workers": (lambda v: v >= 0, "an integer >= 0 (0: load in the main "
                                                 "process)"),
    "dataloader_prefetch_factor": (lambda v: v >= 1, "a positive integer"),
    "seed": (lambda v: 0 <= v < 2**32, "an integer in [0, 2**32)"),
    "data_seed": (lambda v: 0 <= v < 2**32, "an integer in [0, 2**32)"),
    "neftune_noise_alpha": (lambda v: v >= 0, "a noise scale >= 0"),
    "ddp_timeout": (lambda v: v > 0, "a positive number of seconds"),
    # TRL's SFTConfig / DPOConfig
    "max_length": (lambda v: 1 <= v <= MAX_TOKENS, f"a positive number of tokens (at most "
                                                    f"{MAX_TOKENS}), or none (no truncation)"),
    "dataset_num_proc": (lambda v: v >= 1, "a positive number of processes, or none"),
    "precompute_ref_batch_size": (lambda v: v >= 1, "a positive batch size, or none"),
    "ref_model_sync_steps": (lambda v: v >= 1, "a positive number of steps"),
    "beta": (lambda v: v >= 0, "a temperature >= 0, e.g. 0.1"),
}


def field_problem(name: str, value: Any) -> str | None:
    """Why ``value`` (already of the field's type) is out of ``name``'s range, or None."""
    rule = FIELD_RANGES.get(name)
    if rule is None or value is None or isinstance(value, bool) or \
            not isinstance(value, (int, float)):
        return None
    ok, allowed = rule
    return None if ok(value) else f"`{name}` must be {allowed}, got {quoted(value)}"


# -- checks -------------------------------------------------------------------------------------


def check_config_field(cls: type, name: str, value: Any, *, raw: str | None = None) -> Any:
    """``value`` of field ``name`` of config class ``cls``, typed (``coerce``) and in range
    (``field_problem``); ``raw``: the text it was read from on the command line, if any.
    ``HfMemkitError`` names the field, the value and what is allowed (an unknown field: the
    closest name)."""
    fields = config_field_names(cls)
    if name not in fields:
        raise HfMemkitError(f"`{name}` is not a {cls.__name__} field"
                            f"{did_you_mean(name, fields)}")
    return _checked(cls, name, value, raw)


def check_field(name: str, value: Any, *, cls: type = TrainingArguments,
                text: bool = True) -> Any:
    """A field's value of config class ``cls``, typed and in range; an unknown name, or a field
    not typed as one scalar, passes as given. ``text=False``: a value from Python code (an API
    dict, a plan pin), where strings are not parsed (``coerce``)."""
    return _checked(cls, name, value, None, text)


def _checked(cls: type, name: str, value: Any, raw: str | None, text: bool = True) -> Any:
    ftype = field_types(cls).get(name)
    if ftype is not None:
        value = coerce(name, value, ftype, raw=raw, text=text)
    problem = field_problem(name, value)
    if problem:
        raise HfMemkitError(problem)
    return value
