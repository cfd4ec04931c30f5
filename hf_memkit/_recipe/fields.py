"""Fields of the config class a trainer takes (``TrainingArguments``; TRL's ``SFTConfig`` and
``DPOConfig``), typed and checked: what recipe pins and the command line's ``FIELD=VALUE``
settings go through.

``TrainingArguments`` fields go through ``_setup.check_field`` (type and range). A TRL config's
own fields (``max_length``, ``packing``, ``beta``, ...) are typed by the config class's
annotations the same way: a bool / int / float field parses text (true/false, 1/0, yes/no;
``none`` where the field allows None) and rejects a value of another type; a ``str`` field takes
a string. Fields of other types (lists, dicts, ``int | str``) pass as given: the config class
checks them when it is built.
"""

from __future__ import annotations

import dataclasses
import math
from functools import cache
from typing import Any

from .._errors import HfMemkitError, did_you_mean

_TRUE, _FALSE = ("true", "1", "yes"), ("false", "0", "no")
_EXPECTED = {bool: "a boolean (true/false, 1/0, yes/no)", int: "an integer",
             float: "a number (e.g. 0.1)", str: "a string"}

# Value ranges of TRL config fields (TRL checks some only when the trainer runs)
_RANGES: dict[str, tuple[Any, str]] = {
    "max_length": (lambda v: v >= 1, "a positive number of tokens, or none (no truncation)"),
    "dataset_num_proc": (lambda v: v >= 1, "a positive number of processes, or none"),
    "precompute_ref_batch_size": (lambda v: v >= 1, "a positive batch size, or none"),
    "ref_model_sync_steps": (lambda v: v >= 1, "a positive number of steps"),
    "beta": (lambda v: v >= 0, "a temperature >= 0, e.g. 0.1"),
}


def config_class(trainer: str | None) -> type:
    """The installed config class of a registered trainer (``None``: ``TrainingArguments``);
    ``HfMemkitError`` for a name that is not registered (TRL's GRPO etc. refused by name) or
    a TRL that is not installed (with the ``pip install`` that fixes it)."""
    from .._trainers import TRAINERS, trainer_of_args

    return TRAINERS.get(trainer_of_args(None, trainer or "trainer")).config_type()


@cache
def config_field_names(cls: type) -> frozenset[str]:
    return frozenset(f.name for f in dataclasses.fields(cls) if f.init)


@cache
def _own_types(cls: type) -> dict[str, tuple[type, bool]]:
    """Field -> (bool | int | float | str, whether None is allowed) for the fields ``cls`` adds
    to ``TrainingArguments`` that are typed as one scalar."""
    import types
    import typing

    from transformers import TrainingArguments

    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # an annotation this Python cannot evaluate: check nothing by type
        return {}
    plain = config_field_names(TrainingArguments)
    out = {}
    for name in config_field_names(cls) - plain:
        hint = hints.get(name)
        union = typing.get_origin(hint) in (typing.Union, types.UnionType)
        members = typing.get_args(hint) if union else (hint,)
        kinds = [a for a in members if a is not type(None)]
        if len(kinds) == 1 and kinds[0] in (bool, int, float, str):
            out[name] = (kinds[0], len(kinds) < len(members))
    return out


def _described(v: Any) -> str:
    return repr(v) if isinstance(v, str) else f"{v!r} ({type(v).__name__})"


def _from_text(text: str, kind: type) -> Any:
    t = text.strip().lower()
    if kind is bool:
        return (t in _TRUE) if t in _TRUE + _FALSE else None
    try:
        v = int(t) if kind is int else float(t)
    except ValueError:
        return None
    return v if math.isfinite(v) else None


def _typed(value: Any, kind: type) -> Any:
    if isinstance(value, bool):
        return value if kind is bool else None
    if kind is bool:
        return bool(value) if type(value) is int and value in (0, 1) else None
    if kind is int:
        return value if isinstance(value, int) else None
    ok = isinstance(value, (int, float)) and math.isfinite(value)
    return float(value) if ok else None


def _coerce(name: str, value: Any, kind: type, optional: bool, raw: str | None) -> Any:
    if optional and (value is None or (isinstance(value, str)
                                       and value.strip().lower() in ("none", "null"))):
        return None
    if kind is str:
        if raw is not None:     # the command line's text: `dataset_text_field=123` is "123"
            return raw
        if isinstance(value, str):
            return value
        got = None
    else:
        got = _from_text(value, kind) if isinstance(value, str) else _typed(value, kind)
    if got is None:
        raise HfMemkitError(f"`{name}` expects {_EXPECTED[kind]}{' or none' if optional else ''}"
                            f", got {_described(value)}")
    rule = _RANGES.get(name)
    if rule is not None and kind is not bool and not rule[0](got):
        raise HfMemkitError(f"`{name}` must be {rule[1]}, got {got!r}")
    return got


def check_config_field(cls: type, name: str, value: Any, *, raw: str | None = None) -> Any:
    """``value`` of field ``name`` of config class ``cls``, typed and checked; ``raw``: the text
    it was read from on the command line, if any. ``HfMemkitError`` names the field, the value
    and what is allowed (an unknown field: the closest name)."""
    from transformers import TrainingArguments

    from .._setup import check_field

    fields = config_field_names(cls)
    if name not in fields:
        raise HfMemkitError(f"`{name}` is not a {cls.__name__} field"
                            f"{did_you_mean(name, fields)}")
    if name in config_field_names(TrainingArguments):
        return check_field(name, value)
    spec = _own_types(cls).get(name)
    return value if spec is None else _coerce(name, value, *spec, raw)
