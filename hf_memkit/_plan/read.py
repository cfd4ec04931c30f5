"""Reading a plan back (``Plan.from_dict`` / ``Plan.from_json``): every field checked as
``plan_training`` would have made it, before anything is built from it.

A plan file travels (``plan.to_json()`` on a laptop, ``Plan.from_json`` on the GPU machine), so
what it holds is input: known fields only; positive integers where ``plan_training`` takes them
(seq_len, target_batch_size, num_gpus, num_nodes, budget, each candidate's micro-batch and
accumulation); the method and the batch rule through ``PlanRequest``; ``training_args_kwargs``
through the trainer config's field types and ranges and ``normalize_args`` (a micro-batch of -1
never reaches ``TrainingArguments``) and equal to the chosen setup's micro-batch and
accumulation (the plan's memory is for those); ``model_kwargs`` from allow-lists (the dtypes a
plan loads in, the attention kernels transformers names: never ``getattr(torch, ...)`` on what
the file says, never a ``trust_remote_code``). Every problem is gathered into one
``ConfigError`` naming the field, the value, what is allowed, and how to get a good plan.
Where the run's results go (``output_dir``, ``report_to``, ``push_to_hub``, ``hub_*``) is never
read from a file: those fields are refused, and the caller passes them to ``to_training_args``.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

from .._device.probe import DeviceInfo
from .._errors import ConfigError, HfMemkitError, did_you_mean, quoted
from .._estimate import MemoryEstimate
from .._methods import METHODS
from .._model.profile import ATTN_IMPLEMENTATIONS
from .._setup.fields import OUTBOUND_FIELDS
from .._trainers import TRAINER_KEY
from .._units import is_positive_int
from . import serialize as ser
from .request import PlanRequest
from .space import EXPANDABLE, Candidate

REMAKE = "make it again with plan.to_json() or hf-memkit plan --json"
SOURCE = f"the plan JSON ({REMAKE})"
# written for readers (to_dict; `hf-memkit plan --json` adds the trainer's name), not read back
DERIVED = ("chosen", "candidates_not_estimated", TRAINER_KEY)
MODEL_KWARGS = ("attn_implementation", "dtype", "quantization_config")
POSITIVE = ("seq_len", "target_batch_size", "num_gpus", "num_nodes", "budget")
MAPPINGS = ("training_args_kwargs", "model_kwargs", "accelerator_kwargs", "parallel")
LISTS = ("candidates", "notes", "ladder")


def _built(problems: list[str], key: str, make: Callable[[], Any]) -> Any:
    """``make()``; what it raises (a missing or mistyped nested field) becomes a problem."""
    try:
        return make()
    except KeyError as exc:
        problems.append(f"{key}: missing field {exc}")
    except (TypeError, ValueError, AttributeError) as exc:
        first = (str(exc).strip().splitlines() or [""])[0][:160]
        problems.append(f"{key}: cannot be read back ({type(exc).__name__}: {first})")
    return None


def plan_kwargs(d: Any, cls: type) -> dict[str, Any]:
    """The keyword arguments of ``cls`` (``Plan``) read from ``d``, or one ``ConfigError``."""
    if not isinstance(d, dict):
        raise ConfigError([f"expected a JSON object (a plan's to_dict()), got "
                           f"{type(d).__name__}"], source=SOURCE)
    # by the names to_dict writes (``Plan._ladder`` is written as ``ladder``)
    fields = {f.name.lstrip("_"): f for f in dataclasses.fields(cls)}
    problems = _shape_problems(d, fields)
    if problems:
        raise ConfigError(problems, source=SOURCE)
    kw: dict[str, Any] = {k: d[k] for k in fields if k in d}
    kw["candidates"] = _candidates(d["candidates"], problems)
    trainer = _trainer(kw["candidates"], problems)
    kw["training_args_kwargs"] = _training_args(d, trainer, kw["candidates"], problems)
    kw["model_kwargs"] = _model_kwargs(d["model_kwargs"], problems)
    kw["device"] = _built(problems, "device", lambda: DeviceInfo.from_dict(d["device"]))
    kw["model_name"] = _built(problems, "model_name",
                              lambda: ser.model_ref_from_json(d["model_name"]))
    kw["peft_config"] = _built(problems, "peft_config",
                               lambda: ser.peft_from_dict(d["peft_config"]))
    if problems:
        raise ConfigError(problems, source=SOURCE)
    for k in MAPPINGS[2:]:
        kw[k] = dict(kw.get(k, {}))
    for k in LISTS[1:]:
        kw[k] = list(kw.get(k, []))
    kw["_ladder"] = kw.pop("ladder")
    return kw


def _shape_problems(d: dict[str, Any], fields: dict[str, Any]) -> list[str]:
    """Unknown and missing fields, and the types of the top-level ones."""
    out = []
    for k in d:
        if k not in fields and k not in DERIVED:
            out.append(f"{k}: unknown field{did_you_mean(str(k), fields)}; a plan has "
                       f"{', '.join(fields)}")
    required = [n for n, f in fields.items() if f.default is dataclasses.MISSING
                and f.default_factory is dataclasses.MISSING]
    missing = [n for n in required if n not in d]
    if missing:
        out.append(f"missing field(s): {', '.join(missing)}")
    for k in POSITIVE:
        if k in d and not is_positive_int(d[k]):
            out.append(f"{k}: expected a positive integer, got {quoted(d[k])}")
    for keys, kind, what in ((MAPPINGS, dict, "an object"), (LISTS, list, "a list")):
        for k in keys:
            if k in d and not isinstance(d[k], kind):
                out.append(f"{k}: expected {what}, got {quoted(d[k])}")
    if not isinstance(d.get("method", ""), str):
        out.append(f"method: expected a string, got {quoted(d['method'])}")
    if d.get("peft_config") is not None and not isinstance(d["peft_config"], dict):
        out.append(f"peft_config: expected an object or null, got {quoted(d['peft_config'])}")
    return out


# -- the candidates -----------------------------------------------------------------------------

def _candidates(items: list[Any], problems: list[str]) -> list[Candidate]:
    names = {f.name for f in dataclasses.fields(Candidate)}
    methods = [m.name for m in METHODS]
    out = []
    for i, c in enumerate(items):
        key = f"candidates[{i}]"
        if not isinstance(c, dict):
            problems.append(f"{key}: expected an object, got {quoted(c)}")
            continue
        c, before = dict(c), len(problems)
        bad = [k for k in c if k not in names]
        for k in bad:
            problems.append(f"{key}.{k}: unknown field{did_you_mean(str(k), names)}")
        for k in ("micro_batch", "grad_accum"):
            if not is_positive_int(c.get(k)):
                problems.append(f"{key}.{k}: expected a positive integer, got "
                                f"{quoted(c.get(k))}")
        if c.get("method") not in methods:
            problems.append(f"{key}.method: expected one of {', '.join(methods)}, got "
                            f"{quoted(c.get('method'))}")
        if c.get("allocator", "") not in ("", EXPANDABLE):  # it reaches the launch lines
            problems.append(f"{key}.allocator: expected \"\" or {EXPANDABLE!r}, got "
                            f"{quoted(c.get('allocator'))}")
        if not isinstance(c.get("chosen", False), bool):
            problems.append(f"{key}.chosen: expected true or false, got {quoted(c['chosen'])}")
        if len(problems) > before:
            continue
        est = c.pop("estimate", None)
        c["techniques"] = tuple(c.get("techniques", ()))
        cand = _built(problems, key, lambda c=c: Candidate(**c))
        if cand is not None and est is not None:
            cand.estimate = _built(problems, f"{key}.estimate",
                                   lambda est=est: MemoryEstimate.from_dict(est))
        if cand is not None:
            out.append(cand)
    chosen = sum(1 for c in out if c.chosen)
    if len(out) == len(items) and chosen != 1:
        problems.append(f"candidates: {chosen} are marked chosen; a plan has exactly one")
    return out


def _trainer(cands: list[Candidate], problems: list[str]) -> str | None:
    """The registered trainer the chosen setup was estimated for (None: ``Trainer``)."""
    chosen = next((c for c in cands if c.chosen), None)
    if chosen is None or chosen.estimate is None:
        return None
    try:
        return chosen.estimate.setup.trainer_kind.name
    except HfMemkitError as exc:
        problems.append(f"candidates: the chosen setup's trainer: {exc}")
        return None


# -- what builds the run ------------------------------------------------------------------------

def _training_args(d: dict[str, Any], trainer: str | None, cands: list[Candidate],
                   problems: list[str]) -> dict[str, Any]:
    """The trainer config's fields, typed and in range, read as ``plan_training`` reads its own
    (``normalize_args``, ``PlanRequest``), and the chosen setup's batch."""
    from .._setup.fields import check_config_field, config_class
    from .._setup.setup import normalize_args

    cls = config_class(trainer)
    out: dict[str, Any] = {}
    for k, v in d["training_args_kwargs"].items():
        if k in OUTBOUND_FIELDS:
            shown = "set" if k == "hub_token" else quoted(v)  # a token is never shown
            problems.append(f"training_args_kwargs.{k}: {shown}: a plan file does not say where "
                            "the run's results go (output directory, Hub push, reporting "
                            "services): drop the field and pass it yourself, "
                            f"plan.to_training_args({k}=...)")
            continue
        try:
            out[k] = check_config_field(cls, str(k), v)
        except HfMemkitError as exc:
            problems.append(f"training_args_kwargs.{k}: {exc}")
    if len(out) < len(ser.shareable_args(d["training_args_kwargs"])):
        return out
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            normalize_args(out, trainer=trainer, num_gpus=d["num_gpus"])
        except ConfigError as exc:
            problems += [f"training_args_kwargs: {p}" for p in exc.problems]
    req = PlanRequest(seq_len=d["seq_len"], target_batch_size=d["target_batch_size"],
                      num_gpus=d["num_gpus"], num_nodes=d.get("num_nodes", 1),
                      method=d["method"], constraints=out, partial=True, trainer=trainer)
    problems += [f"{p.field if p.field in d else 'training_args_kwargs.' + p.field}: "
                 f"{p.under_key}" for p in req.problems()]
    chosen = next((c for c in cands if c.chosen), None)
    for k, attr in (("per_device_train_batch_size", "micro_batch"),
                    ("gradient_accumulation_steps", "grad_accum")):
        if chosen is not None and k in out and out[k] != getattr(chosen, attr):
            problems.append(f"training_args_kwargs.{k}: {out[k]!r} is not the chosen setup's "
                            f"{getattr(chosen, attr)} (the plan's memory is for that); to "
                            f"train with {out[k]!r}, plan with it pinned (plan_training(..., "
                            f"{k}={out[k]!r}))")
    return out


def _model_kwargs(mk: dict[str, Any], problems: list[str]) -> dict[str, Any]:
    """``from_pretrained`` kwargs from allow-lists: no other key, a known dtype and kernel."""
    for k in mk:
        if k not in MODEL_KWARGS:
            problems.append(f"model_kwargs.{k}: not a key a plan writes; allowed: "
                            f"{', '.join(MODEL_KWARGS)}")
    dtype = mk.get("dtype")
    if dtype is not None and dtype not in ser.LOAD_DTYPES:
        problems.append(f"model_kwargs.dtype: expected one of {', '.join(ser.LOAD_DTYPES)}, "
                        f"got {quoted(dtype)}")
    attn = mk.get("attn_implementation")
    if attn is not None and attn not in ATTN_IMPLEMENTATIONS:
        problems.append(f"model_kwargs.attn_implementation: expected one of "
                        f"{', '.join(ATTN_IMPLEMENTATIONS)}, got {quoted(attn)}")
    quant = mk.get("quantization_config")
    if quant is not None and not isinstance(quant, dict):
        problems.append(f"model_kwargs.quantization_config: expected an object (a "
                        f"BitsAndBytesConfig's to_dict()), got {quoted(quant)}")
    if problems:
        return {}
    return _built(problems, "model_kwargs", lambda: ser.model_kwargs_from_json(mk)) or {}
