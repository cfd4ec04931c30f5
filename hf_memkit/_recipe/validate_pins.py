"""``pins``: fields of the trainer's config (``TrainingArguments``, or ``SFTConfig`` / ``DPOConfig``
for a recipe's ``trainer: sft`` / ``dpo``) that a recipe (or the command line) sets;
``check_pins`` keeps the known ones and reports the rest to a ``Checker``."""

from __future__ import annotations

import warnings
from typing import Any

from .._device.precision import precision_issues
from .._errors import ConfigError, HfMemkitError, did_you_mean
from .checker import Checker
from .schema import FIELDS, leaf_key

# Keys a recipe owns itself; pinning them is a mistake with a better spelling.
_OWNED_PINS = {"output_dir": "output_dir"}


def check_pins(pins: dict[str, Any], c: Checker, *, dev: Any,
               trainer: str | None = None) -> dict[str, Any]:
    """The known pins of ``pins``: fields of ``trainer``'s config class (None: the plain
    ``TrainingArguments``). Every problem goes to ``c``: unknown fields, values the config
    rejects and precision the device lacks. (A micro-batch or accumulation that does not fit
    the target batch: ``PlanRequest``.)"""
    from .._setup.fields import check_config_field, config_class, config_field_names
    from .._setup.setup import normalize_args

    cls = config_class(trainer)
    fields = config_field_names(cls)
    known = {}
    for k, v in pins.items():
        k = str(k)
        if k in _OWNED_PINS:
            c.add(f"pins.{k}", f"set it as the top-level `{_OWNED_PINS[k]}` key instead")
        elif k not in fields:
            hint = did_you_mean(k, fields)
            if not hint and k in {key.split(".")[-1] for key in FIELDS}:
                hint = f" (did you mean the recipe key `{leaf_key(k)}`?)"
            c.add(f"pins.{k}", f"not a {cls.__name__} field{hint}")
        else:
            try:  # by the field's type and range: learning_rate: abc, max_steps: 0
                known[k] = check_config_field(cls, k, v)
            except HfMemkitError as exc:
                c.add(f"pins.{k}", str(exc))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            normalize_args(known, source="pins", trainer=trainer)
        except ConfigError as exc:
            for p in exc.problems:
                c.add("pins", p)
    if dev is not None:
        _check_pinned_precision(known, c, dev)
    return known


def _check_pinned_precision(known: dict[str, Any], c: Checker, dev: Any) -> None:
    """The rule estimates and plans share (``_device.precision``): a refused precision is a
    problem of the recipe, the others a warning."""
    for issue in precision_issues(dev, bf16=known.get("bf16") is True,
                                  fp16=known.get("fp16") is True, tf32=known.get("tf32") is True):
        if issue.refused:
            c.add(f"pins.{issue.field}", issue.message)
        else:
            warnings.warn(f"{c.where}: pins.{issue.field}: {issue.message}", UserWarning,
                          stacklevel=2)
