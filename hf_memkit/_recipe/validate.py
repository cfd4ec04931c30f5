"""Validating a parsed recipe: ``Checker`` collects every problem as ``FILE: KEY: message``, one
function per recipe section fills the ``Recipe`` keyword arguments, and ``validate`` raises one
``ConfigError`` listing them all."""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._errors import ConfigError, HfMemkitError, did_you_mean, excerpt, quoted
from .checker import Checker, describe
from .schema import (
    FIELDS,
    SECTIONS,
    SHORTHAND,
    TOKENIZER_FILES,
    TOP,
    Recipe,
    apply_overrides,
    config_keys,
    has_tokenizer,
)
from .validate_pins import check_pins

CALLBACKS = ("memory", "throughput", "oom_guard")
DATA_SUFFIXES = (".txt", ".jsonl", ".json")
_REQUIRED = {"model.name": " (a catalog name, a model directory or a config.json; see hf-memkit "
                           "plan --help)",
             "training.seq_len": " (tokens per sequence, e.g. 2048)",
             "training.target_batch_size": " (effective batch size, e.g. 32)"}


def _flatten(raw: dict, c: Checker) -> dict[str, Any]:
    """Nested YAML -> {'section.key': value}; unknown keys are reported with a suggestion."""
    leaves = {k.split(".")[-1]: k for k in FIELDS}
    flat: dict[str, Any] = {}
    for top, value in raw.items():
        top = str(top)
        if top not in TOP:
            hint = did_you_mean(top, TOP)
            if not hint and top in leaves:
                hint = f" (did you mean `{leaves[top]}`?)"
            c.add(top, f"unknown key{hint}; allowed: {', '.join(sorted(TOP))}")
        elif top in SECTIONS:
            flat.update(_flatten_section(top, value, c, leaves))
        else:
            flat[top] = value
    return flat


def _flatten_section(top: str, value: Any, c: Checker, leaves: dict[str, str]) -> dict[str, Any]:
    """One section's ``{'section.key': value}``; a shorthand string is its main key."""
    if isinstance(value, str) and top in SHORTHAND:
        value = {SHORTHAND[top]: value}
    if value is None:
        return {}
    if not isinstance(value, dict):
        c.add(top, f"expected a mapping of {', '.join(sorted(SECTIONS[top]))}"
              + (f" (or a string: the {SHORTHAND[top]})" if top in SHORTHAND else "")
              + f", got {describe(value)}")
        return {}
    flat: dict[str, Any] = {}
    for k, v in value.items():
        k = str(k)
        if k not in SECTIONS[top]:
            hint = did_you_mean(k, SECTIONS[top])
            if not hint and k in leaves:
                hint = f" (did you mean `{leaves[k]}`?)"
            c.add(f"{top}.{k}", f"unknown key{hint}; allowed in `{top}`: "
                  f"{', '.join(sorted(SECTIONS[top]))}")
            continue
        flat[f"{top}.{k}"] = v
    return flat


@dataclass
class _State:
    """What the section checks share: the flat keys, the ``Recipe`` keyword arguments built so
    far, and the values a later section depends on."""

    c: Checker
    flat: dict[str, Any]
    base: Path                  # the recipe file's directory
    kw: dict[str, Any]
    config: Any = None          # model.name (+ overrides) as a config: training.seq_len limit
    dev: Any = None             # hardware.device as a Device: num_gpus, pins
    seq_len: int | None = None
    target: int | None = None   # training.target_batch_size: num_gpus, pins
    gpus: int | None = 1        # hardware.num_gpus: target_batch_size, num_nodes, pins

    def local(self, v: str) -> Path | None:
        """A path relative to the recipe file (or absolute / from the cwd) that exists."""
        p = Path(os.path.expanduser(v))
        for cand in ((p,) if p.is_absolute() else (self.base / p, p)):
            try:
                if cand.exists():
                    return cand.resolve()
            except OSError:  # a name too long for the file system is no file
                continue
        return None


def validate(raw: dict, file: Path, where: str) -> Recipe:
    """The ``Recipe`` of a parsed recipe file, or one ``ConfigError`` listing every problem."""
    c = Checker(where)
    if raw and not any(str(k) in TOP for k in raw):  # /etc/passwd: no line of it is echoed
        raise ConfigError([f"{where}: not a recipe: none of its {len(raw)} top-level key(s) is a "
                           f"recipe key ({', '.join(sorted(TOP))}); a recipe is YAML like "
                           "the bundled ones (hf-memkit recipes list)"], source=where)
    st = _State(c, _flatten(raw, c), file.resolve().parent, {"source": where})
    for key, hint in _REQUIRED.items():
        if st.flat.get(key) is None:
            c.add(key, "required" + hint)
    for section in (_model_section, _data_section, _training_section, _hardware_section,
                    _trainer_section, _pins_section, _outputs_section, check_request):
        section(st)
    if c.problems:
        raise ConfigError(c.problems, source=where)
    return Recipe(**st.kw)


# -- model ------------------------------------------------------------------------------------

def _model_section(st: _State) -> None:
    from .._model.profile import token_id_problem

    _model_name(st)
    _model_overrides(st)
    problem = token_id_problem(st.config) if st.config is not None else None
    if problem:  # the model could not be built (pad_token_id outside the vocabulary)
        st.c.add("model.overrides" if st.kw.get("model_overrides") else "model.name", problem)
    task = st.flat.get("model.task")
    if task is not None and st.c.string("model.task", task):
        from .._model.tasks import normalize_task

        try:
            st.kw["task"] = normalize_task(task)
        except HfMemkitError as exc:
            st.c.add("model.task", str(exc))
    _model_tokenizer(st)


def _model_name(st: _State) -> None:
    name = st.flat.get("model.name")
    if name is None or not st.c.string("model.name", name):
        return
    path = st.local(name)
    st.kw["model"] = str(path) if path is not None else name
    if path is None and (name.startswith((".", "/", "~")) or name.endswith(".json")):
        st.c.add("model.name", f"no such directory or file `{excerpt(name)}` (relative paths are "
                               f"relative to the recipe file, {st.base})")
        return
    try:
        from .._model.catalog import resolve_config

        st.config = resolve_config(st.kw["model"])
    except HfMemkitError as exc:
        st.c.add("model.name", str(exc))


def _model_overrides(st: _State) -> None:
    overrides = st.flat.get("model.overrides")
    if overrides is None or st.c.mapping("model.overrides", overrides) is None:
        return
    st.kw["model_overrides"] = dict(overrides)
    config = st.config
    if config is None:
        return
    allowed = config_keys(config)
    bad = [k for k in overrides if k not in allowed]
    for k in bad:
        st.c.add(f"model.overrides.{k}", f"not a field of {type(config).__name__}"
                 f"{did_you_mean(k, allowed)}")
    if bad:
        return
    try:
        st.config = apply_overrides(config, overrides)
    except Exception as exc:  # the config class rejects the combination
        st.c.add("model.overrides", f"{type(config).__name__} rejects these values: {exc}")
        st.config = None


def _model_tokenizer(st: _State) -> None:
    tok = st.flat.get("model.tokenizer")
    if tok is None or not st.c.string("model.tokenizer", tok):
        return
    p = st.local(tok)
    if p is None or not p.is_dir():
        st.c.add("model.tokenizer", f"no such directory `{excerpt(tok)}` (relative paths are relative "
                                    f"to the recipe file, {st.base})")
    elif not has_tokenizer(p):
        st.c.add("model.tokenizer", f"`{tok}` holds no tokenizer files "
                                    f"({', '.join(TOKENIZER_FILES)}); write one with "
                                    "tokenizer.save_pretrained(dir)")
    else:
        st.kw["tokenizer"] = str(p)


# -- data -------------------------------------------------------------------------------------

def _data_section(st: _State) -> None:
    c, flat = st.c, st.flat
    data = flat.get("data.source", "synthetic")
    if c.string("data.source", data):
        if data == "synthetic":
            st.kw["data"] = data
        else:
            _data_file(st, data)
    if flat.get("data.num_samples") is not None:
        st.kw["num_samples"] = c.positive_int("data.num_samples", flat["data.num_samples"])
    for key, attr in (("data.text_field", "text_field"), ("data.label_field", "label_field")):
        if key in flat and c.string(key, flat[key]):
            st.kw[attr] = flat[key]


def _data_file(st: _State, data: str) -> None:
    """``data.source`` naming a local file: it exists, has a known type, and has a tokenizer."""
    p = st.local(data)
    if p is None or not p.is_file():
        st.c.add("data.source", f"no such file `{excerpt(data)}`; give 'synthetic' or a local "
                                f"{'/'.join(DATA_SUFFIXES)} file (relative paths are "
                                f"relative to the recipe file, {st.base})")
    elif p.suffix not in DATA_SUFFIXES:
        st.c.add("data.source", f"`{data}`: unsupported file type `{p.suffix}`; allowed: "
                                f"{', '.join(DATA_SUFFIXES)} (JSON lines), or 'synthetic'")
    else:
        st.kw["data"] = str(p)
        model_dir = Path(st.kw.get("model", ""))
        if "tokenizer" not in st.kw and st.flat.get("model.tokenizer") is None and not (
                model_dir.is_dir() and has_tokenizer(model_dir)):
            st.c.add("model.tokenizer", f"data from a file (`{data}`) needs a tokenizer: "
                     "set model.tokenizer to a local directory holding one (as written by "
                     "tokenizer.save_pretrained); nothing is downloaded")


# -- training ---------------------------------------------------------------------------------

def _training_section(st: _State) -> None:
    c, flat = st.c, st.flat
    if flat.get("training.seq_len") is not None:
        st.seq_len = st.kw["seq_len"] = c.positive_int("training.seq_len",
                                                       flat["training.seq_len"])
    if flat.get("training.target_batch_size") is not None:
        st.target = st.kw["target_batch_size"] = c.positive_int(
            "training.target_batch_size", flat["training.target_batch_size"])
    if flat.get("training.method") is not None:
        st.kw["method"] = flat["training.method"]   # checked with the request (check_request)
    if st.config is not None and st.seq_len:
        limit = getattr(st.config, "max_position_embeddings", None) or getattr(
            st.config, "n_positions", None)
        if isinstance(limit, int) and st.seq_len > limit:
            _positions(st, limit)


def _positions(st: _State, limit: int) -> None:
    """The rule estimates and plans follow (``ModelSpec.positions_warning``): a learned position
    table refuses a longer sequence, computed (rotary) positions run with a warning."""
    from .._model.spec import resolve_model

    warning = resolve_model(st.config).positions_warning(st.seq_len)
    if warning:
        warnings.warn(f"{st.c.where}: training.seq_len: {warning}", UserWarning, stacklevel=2)
    else:
        st.c.add("training.seq_len", f"{st.seq_len} is longer than the model's {limit} "
                                     "learned positions (max_position_embeddings); lower "
                                     "seq_len")


# -- hardware ---------------------------------------------------------------------------------

def _hardware_section(st: _State) -> None:
    c, flat = st.c, st.flat
    _hardware_device(st)
    if flat.get("hardware.num_gpus") is not None:
        gpus = st.gpus = st.kw["num_gpus"] = c.positive_int("hardware.num_gpus",
                                                            flat["hardware.num_gpus"])
        if gpus and gpus > 1 and st.dev is not None and st.dev.kind == "cpu":
            c.add("hardware.num_gpus", f"{gpus} GPUs with device 'cpu'; set a catalog GPU or "
                                       "num_gpus: 1")
    _hardware_size(st, "max_memory", "20GiB")
    _hardware_size(st, "host_memory", "512GiB")
    _hardware_cuda(st)
    nodes = flat.get("hardware.num_nodes")
    if nodes is not None:
        n_nodes = c.positive_int("hardware.num_nodes", nodes)
        if n_nodes:
            st.kw["num_nodes"] = n_nodes
    if flat.get("hardware.engine") is not None:
        st.kw["engine"] = flat["hardware.engine"]   # checked with the request (check_request)
    hr = flat.get("hardware.headroom")
    if hr is not None:
        if isinstance(hr, (int, float)) and not isinstance(hr, bool) and 0 <= hr < 1:
            st.kw["headroom"] = float(hr)
        else:
            c.add("hardware.headroom", f"expected the fraction of device memory kept free, "
                                       f"in [0, 1) (0.1 keeps 10% free), got {describe(hr)}")
        if flat.get("hardware.max_memory") is not None:
            warnings.warn(f"{c.where}: hardware.headroom ({hr}) is ignored: hardware.max_memory "
                          f"({flat['hardware.max_memory']}) is the whole budget; drop one of "
                          "them", UserWarning, stacklevel=2)


def _hardware_device(st: _State) -> None:
    device = st.flat.get("hardware.device")
    if device is None or not st.c.string("hardware.device", device):
        return
    from .._device.probe import get_device, list_devices

    try:
        st.dev = get_device(device)
        st.kw["device"] = "cpu" if st.dev.kind == "cpu" else st.dev.name
    except HfMemkitError:
        st.c.add("hardware.device", f"unknown GPU `{excerpt(device)}`"
                 f"{did_you_mean(device, [*list_devices(), 'cpu'])}; allowed: 'cpu', or a "
                 f"catalog GPU: {', '.join(list_devices())} (hf-memkit devices), or omit the "
                 "key to use this machine")


def _hardware_cuda(st: _State) -> None:
    """``hardware.cuda_version``: 'major.minor'."""
    from .._cuda.runtime import parse_cuda_version

    v = st.flat.get("hardware.cuda_version")
    if v is None:
        return
    try:
        parse_cuda_version(v if isinstance(v, str) else "")
        st.kw["cuda_version"] = v
    except HfMemkitError:
        st.c.add("hardware.cuda_version", f"expected a CUDA version such as '12.8' (quoted, "
                                          f"major.minor), got {describe(v)}")


def _hardware_size(st: _State, key: str, example: str) -> None:
    """``hardware.max_memory`` / ``hardware.host_memory``: bytes or a size such as '20GiB'."""
    from .._units import parse_bytes

    v = st.flat.get(f"hardware.{key}")
    if v is None:
        return
    try:
        if isinstance(v, bool) or parse_bytes(v) <= 0:
            raise ValueError
        st.kw[key] = v
    except (ValueError, TypeError, HfMemkitError):
        st.c.add(f"hardware.{key}", f"expected bytes or a size such as '{example}', got "
                                    f"{describe(v)}")


# -- trainer, pins ----------------------------------------------------------------------------

def _trainer_section(st: _State) -> None:
    """``trainer``: a registered trainer (``_trainers.TRAINERS``) whose config is installed."""
    v = st.flat.get("trainer")
    if v is None:
        return
    from .._trainers import TRAINERS, trainer_of_args
    from .._trainers.detect import NOT_MODELLED

    allowed = ", ".join(f"{k.name} ({k.title})" for k in TRAINERS)
    if not isinstance(v, str) or not v:
        st.c.add("trainer", f"expected one of {allowed}, got {describe(v)}")
        return
    try:
        name = trainer_of_args(None, v)
    except HfMemkitError as exc:   # TRL trainers not modelled (ORPO, PPO, ...) are refused by name
        refused = v.lower().replace("-", "_") in NOT_MODELLED
        st.c.add("trainer", str(exc) if refused else f"unknown trainer {quoted(v)}"
                 f"{did_you_mean(v, TRAINERS.names())}; allowed: {allowed}")
        return
    try:
        TRAINERS.get(name).config_type()  # its package is installed (pip install hint)
    except HfMemkitError as exc:
        st.c.add("trainer", str(exc))
        return
    st.kw["trainer"] = name


def _pins_section(st: _State) -> None:
    pins = st.flat.get("pins")
    if pins is None or st.c.mapping("pins", pins) is None:
        return
    if "trainer" in st.flat and "trainer" not in st.kw:
        return   # the trainer is wrong: its config's fields cannot be checked
    st.kw["pins"] = check_pins(dict(pins), st.c, dev=st.dev, trainer=st.kw.get("trainer"))


# -- what plan_training checks (PlanRequest.problems, written once) ---------------------------

# PlanRequest field (or pinned TrainingArguments field) -> the recipe key that holds it
REQUEST_KEYS = {"method": "training.method", "engine": "hardware.engine",
                "seq_len": "training.seq_len", "target_batch_size": "training.target_batch_size",
                "num_gpus": "hardware.num_gpus", "num_nodes": "hardware.num_nodes",
                "headroom": "hardware.headroom"}


def check_request(st: _State) -> None:
    """The rules ``plan_training`` applies (methods and engines from their registries, the
    target-batch rule, nodes), on the values that passed their own checks."""
    from .._plan import PlanRequest

    kw = st.kw
    req = PlanRequest(seq_len=kw.get("seq_len"), target_batch_size=kw.get("target_batch_size"),
                      num_gpus=st.gpus, method=kw.get("method", "auto"),
                      engine=kw.get("engine", "auto"), num_nodes=kw.get("num_nodes"),
                      constraints=dict(kw.get("pins", {})), partial=True,
                      trainer=kw.get("trainer"))
    for p in req.problems():   # any problem fails the whole recipe (validate raises)
        st.c.add(REQUEST_KEYS.get(p.field, f"pins.{p.field}"), p.under_key)


# -- callbacks, output_dir --------------------------------------------------------------------

def _outputs_section(st: _State) -> None:
    c, flat = st.c, st.flat
    cbs = flat.get("callbacks")
    if cbs is not None:
        if not isinstance(cbs, list) or not all(isinstance(x, str) for x in cbs):
            c.add("callbacks", f"expected a list of names ({', '.join(CALLBACKS)}), got "
                               f"{describe(cbs)}")
        else:
            for x in cbs:
                if x not in CALLBACKS:
                    c.add("callbacks", f"unknown callback `{excerpt(x)}`{did_you_mean(x, CALLBACKS)}; "
                                       f"allowed: {', '.join(CALLBACKS)}")
            st.kw["callbacks"] = list(cbs)
    if flat.get("output_dir") is not None and c.string("output_dir", flat["output_dir"]):
        st.kw["output_dir"] = flat["output_dir"]
