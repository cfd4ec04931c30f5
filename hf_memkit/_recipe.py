"""Recipes: a training setup in a YAML file -> ``Recipe``, validated all at once.

A recipe names the model, the data, the shape of the run (seq_len, target batch, method), the
hardware it is planned for, and ``pins`` that override the planner. ``load_recipe`` reads it
with ``yaml.safe_load`` (plain data only: no ``!!python/...`` tags, no imports), checks every key
and value, and raises one ``ConfigError`` listing every problem, each as ``FILE: KEY: what is
wrong``. The planner, ``hf-memkit plan RECIPE`` and ``hf-memkit train RECIPE`` consume it.

Schema (every key but ``model``, ``training.seq_len`` and ``training.target_batch_size`` is
optional; ``Recipe.schema()`` gives the same table with defaults)::

    model: NAME                 # or the mapping below
    model:
      name: Llama-3.1-8B        # catalog name, local model directory, or a config.json path
      overrides: {num_hidden_layers: 2}   # config fields; random init unless the dir has weights
      task: causal-lm           # head; default: read from config.architectures
      tokenizer: ./tok          # local tokenizer directory (needed for data from a file)
    data: synthetic             # or a path, or the mapping below
    data:
      source: train.jsonl       # 'synthetic', or a local .txt (one example per line) / .jsonl file
      num_samples: 256          # synthetic: how many; a file: use at most this many
      text_field: text          # .jsonl: the text key
      label_field: label        # .jsonl, sequence-classification: the label key
    training:
      seq_len: 2048
      target_batch_size: 32     # effective batch = micro-batch x accumulation x GPUs, kept exact
      method: auto              # auto | full | lora | qlora
    hardware:
      device: RTX-4090          # catalog GPU (hf-memkit devices), 'cpu', or omitted = this machine
      num_gpus: 1
      max_memory: 20GiB         # explicit budget (overrides the device's)
      headroom: 0.1             # fraction of device memory kept free
    pins: {learning_rate: 2.0e-4, max_steps: 100}   # any TrainingArguments field
    callbacks: [memory, throughput]                 # and/or oom_guard (OOMGuardTrainer)
    output_dir: outputs/my-run

Relative paths in ``model``/``data`` are relative to the recipe file; ``output_dir`` is
relative to the working directory.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import warnings
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from ._errors import ConfigError, HfMemkitError, did_you_mean

METHODS = ("auto", "full", "lora", "qlora")
CALLBACKS = ("memory", "throughput", "oom_guard")
DATA_SUFFIXES = (".txt", ".jsonl", ".json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "tokenizer.model")
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
# Keys a recipe owns itself; pinning them is a mistake with a better spelling.
_OWNED_PINS = {"output_dir": "output_dir"}
_MISSING = object()


def _key(path: str, help_: str, default: Any = _MISSING) -> Any:
    """A dataclass field read from YAML key ``path`` (``section.name``)."""
    meta = {"key": path, "help": help_}
    if default is _MISSING:
        return field(metadata=meta)
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda d=default: type(d)(d), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class Recipe:
    """A validated recipe. Build one with ``load_recipe(path)``; every field maps to one YAML key
    (``Recipe.schema()``), and ``save(path)`` writes a file ``load_recipe`` reads back equal."""

    model: str = _key("model.name", "catalog name (hf-memkit: Llama-3.1-8B, bert-large-uncased, "
                      "...), a local model directory, or a config.json path")
    seq_len: int = _key("training.seq_len", "tokens per sequence (the longest of a batch): "
                        "activations grow linearly with it (quadratically with eager attention)")
    target_batch_size: int = _key("training.target_batch_size", "effective batch size; the "
                                  "plan splits it into micro-batch x accumulation x GPUs exactly")
    model_overrides: dict[str, Any] = _key("model.overrides", "config fields to change, e.g. "
                                           "{num_hidden_layers: 2}; the model is built from the "
                                           "config with random weights unless the model "
                                           "directory holds weights", {})
    task: str | None = _key("model.task", "head: causal-lm, sequence-classification, masked-lm, "
                            "...; default: read from config.architectures", None)
    tokenizer: str | None = _key("model.tokenizer", "local tokenizer directory (data from a file "
                                 "needs one; default: the model directory's own)", None)
    data: str = _key("data.source", "'synthetic' (random learnable token sequences, "
                     "hf_memkit._synthetic.SyntheticTextDataset) or a local .txt (one example "
                     "per line) / .jsonl file", "synthetic")
    num_samples: int | None = _key("data.num_samples", "synthetic: number of samples (default: "
                                   "enough for max_steps); a file: use at most this many", None)
    text_field: str = _key("data.text_field", "JSON-lines key holding the text", "text")
    label_field: str = _key("data.label_field", "JSON-lines key holding the class label "
                            "(sequence-classification)", "label")
    method: str = _key("training.method", "auto (full fine-tuning whenever it fits, else LoRA, "
                       "LoRA on an 8-bit base, QLoRA) | full | lora | qlora", "auto")
    device: str | None = _key("hardware.device", "catalog GPU to plan for (hf-memkit devices), "
                              "'cpu', or omitted for this machine", None)
    num_gpus: int = _key("hardware.num_gpus", "GPUs (data-parallel ranks); the effective batch "
                         "is split across them", 1)
    max_memory: int | str | None = _key("hardware.max_memory", "explicit per-GPU budget, bytes or "
                                        "'20GiB'; overrides device memory x (1 - headroom)", None)
    headroom: float = _key("hardware.headroom", "fraction of device memory kept free", 0.1)
    num_nodes: int = _key("hardware.num_nodes", "nodes the num_gpus are spread over (GPUs per "
                          "node = num_gpus / num_nodes)", 1)
    engine: str = _key("hardware.engine", "auto | ddp | fsdp | deepspeed: the data-parallel "
                       "engine when num_gpus > 1 (auto = DDP if a replica fits, else FSDP2)",
                       "auto")
    host_memory: int | str | None = _key("hardware.host_memory", "CPU RAM per node that CPU "
                                         "offload may use, e.g. '512GiB'", None)
    pins: dict[str, Any] = _key("pins", "TrainingArguments fields that override the planner "
                                "(e.g. optim, activation_checkpointing) or just set (max_steps, "
                                "learning_rate, logging_steps)", {})
    callbacks: list[str] = _key("callbacks", "memory (MemoryCallback: memory logs, "
                                "memory_report.json, memory_timeline.png), throughput "
                                "(ThroughputCallback), oom_guard (train with OOMGuardTrainer)",
                                ["memory", "throughput"])
    output_dir: str | None = _key("output_dir", "where the model, logs, report and PNG go "
                                  "(default: outputs/<recipe name>)", None)
    source: str | None = field(default=None, compare=False,
                               metadata={"help": "the file this recipe was loaded from"})

    # -- what the planner and the trainer need ------------------------------------------------

    @property
    def name(self) -> str:
        return Path(self.source).stem if self.source else "recipe"

    @property
    def is_synthetic(self) -> bool:
        return self.data == "synthetic"

    def model_config(self):
        """The model's ``PretrainedConfig`` with ``model_overrides`` applied (no weights)."""
        return _config_with_overrides(self.model, self.model_overrides)

    def model_ref(self) -> Any:
        """What ``plan_training`` takes: the name/directory, or a config when overridden."""
        return self.model_config() if self.model_overrides else self.model

    def has_weights(self) -> bool:
        return Path(self.model).is_dir() and any((Path(self.model) / f).is_file()
                                                 for f in WEIGHT_FILES)

    def tokenizer_dir(self) -> str | None:
        if self.tokenizer:
            return self.tokenizer
        if Path(self.model).is_dir() and _has_tokenizer(Path(self.model)):
            return self.model
        return None

    def plan_kwargs(self, **overrides: Any) -> dict[str, Any]:
        """Keyword arguments of ``plan_training``; ``overrides`` (not None) win."""
        kw = dict(model=self.model_ref(), seq_len=self.seq_len,
                  target_batch_size=self.target_batch_size, device=self.device,
                  num_gpus=self.num_gpus, method=self.method, headroom=self.headroom,
                  max_memory=self.max_memory, task=self.task, num_nodes=self.num_nodes,
                  engine=self.engine, host_memory=self.host_memory, **self.pins)
        kw.update({k: v for k, v in overrides.items() if v is not None})
        return kw

    # -- files --------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """The nested YAML form (only keys that differ from their defaults, plus required ones)."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            if "key" not in f.metadata:
                continue
            value = getattr(self, f.name)
            default = f.default if f.default is not dataclasses.MISSING else (
                f.default_factory() if f.default_factory is not dataclasses.MISSING else _MISSING)
            if default is not _MISSING and value == default:
                continue
            node = out
            *parents, leaf = f.metadata["key"].split(".")
            for p in parents:
                node = node.setdefault(p, {})
            node[leaf] = value
        return out

    def save(self, path: str | os.PathLike) -> None:
        with open(path, "w") as fh:
            yaml.safe_dump(self.to_dict(), fh, sort_keys=False)

    @classmethod
    def schema(cls) -> list[tuple[str, Any, str]]:
        """``(yaml key, default, help)`` for every key, in file order."""
        rows = []
        for f in dataclasses.fields(cls):
            if "key" not in f.metadata:
                continue
            if f.default is not dataclasses.MISSING:
                default = f.default
            elif f.default_factory is not dataclasses.MISSING:
                default = f.default_factory()
            else:
                default = "(required)"
            rows.append((f.metadata["key"], default, f.metadata["help"]))
        return rows


# ----------------------------------------------------------------------------------------------
# loading and validation
# ----------------------------------------------------------------------------------------------

_FIELDS = {f.metadata["key"]: f.name for f in dataclasses.fields(Recipe) if "key" in f.metadata}
_SECTIONS: dict[str, set[str]] = {}
for _k in _FIELDS:
    if "." in _k:
        _s, _leaf = _k.split(".", 1)
        _SECTIONS.setdefault(_s, set()).add(_leaf)
_TOP = {k for k in _FIELDS if "." not in k} | set(_SECTIONS)
_SHORTHAND = {"model": "name", "data": "source"}   # `model: NAME`, `data: synthetic`


def load_recipe(path: str | os.PathLike) -> Recipe:
    """Read and validate a recipe file (or a bundled recipe's name); raise one ``ConfigError``
    listing every problem, each as ``FILE: KEY: what is wrong, what is allowed``."""
    file = resolve_recipe_path(path)
    where = _display(file)
    try:
        text = file.read_text()
    except OSError as exc:
        raise ConfigError([f"{where}: cannot read: {exc.strerror}"], source=where) from None
    try:
        raw = yaml.safe_load(text)
    except yaml.constructor.ConstructorError as exc:
        tag = _tag_of(exc)
        raise ConfigError([
            f"{where}: line {exc.problem_mark.line + 1 if exc.problem_mark else '?'}: tag "
            f"`{tag}` is not allowed: recipes are plain data read with yaml.safe_load (no "
            "executable tags, no imports); write the value as a plain string, number, list or "
            "mapping"], source=where) from None
    except yaml.YAMLError as exc:
        raise ConfigError([f"{where}: not valid YAML: {exc}"], source=where) from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError([f"{where}: the top level must be a mapping of keys (model, data, "
                           f"training, hardware, pins, callbacks, output_dir), got "
                           f"{type(raw).__name__}"], source=where)
    return _validate(raw, file, where)


def resolve_recipe_path(path: str | os.PathLike) -> Path:
    """A recipe file as given, else a bundled recipe: ``llama-3.1/8b_qlora_rtx4090``,
    ``recipes/llama-3.1/8b_qlora_rtx4090.yaml`` (from any directory, installed or not)."""
    p = Path(path)
    if p.is_file():
        return p
    rel = Path(*p.parts[1:]) if p.parts[:1] == ("recipes",) else p
    root = bundled_recipes_dir()
    if root is not None:
        for cand in (root / rel, root / rel.with_suffix(".yaml")):
            if cand.is_file():
                return cand
    known = [str(r.relative_to(root).with_suffix("")) for r in bundled_recipes()] if root else []
    raise ConfigError([f"{path}: no such file{did_you_mean(str(rel.with_suffix('')), known)}; "
                       "give a recipe path or a bundled recipe "
                       f"({', '.join(known) or 'none found'}; hf-memkit recipes list)"],
                      source=str(path))


@cache
def bundled_recipes_dir() -> Path | None:
    """The bundled ``recipes/``: package data of an installed hf-memkit (``hf_memkit/recipes``,
    a link to the repository's ``recipes/`` in a checkout), else the checkout's ``recipes/``."""
    cands = []
    try:
        cands.append(Path(str(resources.files("hf_memkit") / "recipes")))
    except (ModuleNotFoundError, TypeError):
        pass
    cands.append(Path(__file__).resolve().parent.parent / "recipes")
    for c in cands:
        if c.is_dir():
            return c
    return None


def bundled_recipes() -> list[Path]:
    root = bundled_recipes_dir()
    return sorted(root.rglob("*.yaml")) if root else []


def _display(file: Path) -> str:
    try:
        rel = file.resolve().relative_to(Path.cwd().resolve())
        return str(rel)
    except ValueError:
        root = bundled_recipes_dir()
        if root is not None:
            try:
                return "recipes/" + str(file.resolve().relative_to(root.resolve()))
            except ValueError:
                pass
        return str(file)


def _tag_of(exc: yaml.constructor.ConstructorError) -> str:
    text = str(exc.problem or "")
    if "tag '" in text:
        return text.split("tag '", 1)[1].split("'", 1)[0].replace("tag:yaml.org,2002:", "!!")
    return text


def _describe(v: Any) -> str:
    if isinstance(v, str):
        return f"{v!r} (a string)" if v.strip().lstrip("-").replace(".", "", 1).isdigit() else repr(v)
    if isinstance(v, bool):
        return f"{v!r} (a boolean)"
    return repr(v)


class _Checker:
    def __init__(self, where: str):
        self.where = where
        self.problems: list[str] = []

    def add(self, key: str, msg: str) -> None:
        self.problems.append(f"{self.where}: {key}: {msg}")

    def positive_int(self, key: str, v: Any) -> int | None:
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
        self.add(key, f"expected a positive integer, got {_describe(v)}")
        return None

    def string(self, key: str, v: Any) -> str | None:
        if isinstance(v, str) and v:
            return v
        self.add(key, f"expected a non-empty string, got {_describe(v)}")
        return None

    def mapping(self, key: str, v: Any) -> dict | None:
        if isinstance(v, dict):
            return v
        self.add(key, f"expected a mapping (key: value lines), got {_describe(v)}")
        return None


def _flatten(raw: dict, c: _Checker) -> dict[str, Any]:
    """Nested YAML -> {'section.key': value}; unknown keys are reported with a suggestion."""
    leaves = {k.split(".")[-1]: k for k in _FIELDS}
    flat: dict[str, Any] = {}
    for top, value in raw.items():
        top = str(top)
        if top not in _TOP:
            hint = did_you_mean(top, _TOP)
            if not hint and top in leaves:
                hint = f" (did you mean `{leaves[top]}`?)"
            c.add(top, f"unknown key{hint}; allowed: {', '.join(sorted(_TOP))}")
            continue
        if top in _SECTIONS:
            if isinstance(value, str) and top in _SHORTHAND:
                value = {_SHORTHAND[top]: value}
            if value is None:
                continue
            if not isinstance(value, dict):
                c.add(top, f"expected a mapping of {', '.join(sorted(_SECTIONS[top]))}"
                      + (f" (or a string: the {_SHORTHAND[top]})" if top in _SHORTHAND else "")
                      + f", got {_describe(value)}")
                continue
            for k, v in value.items():
                k = str(k)
                if k not in _SECTIONS[top]:
                    hint = did_you_mean(k, _SECTIONS[top])
                    if not hint and k in leaves:
                        hint = f" (did you mean `{leaves[k]}`?)"
                    c.add(f"{top}.{k}", f"unknown key{hint}; allowed in `{top}`: "
                          f"{', '.join(sorted(_SECTIONS[top]))}")
                    continue
                flat[f"{top}.{k}"] = v
        else:
            flat[top] = value
    return flat


def _validate(raw: dict, file: Path, where: str) -> Recipe:
    c = _Checker(where)
    flat = _flatten(raw, c)
    base = file.resolve().parent
    kw: dict[str, Any] = {"source": where}
    for key in ("model.name", "training.seq_len", "training.target_batch_size"):
        if flat.get(key) is None:
            c.add(key, "required" + {"model.name": " (a catalog name, a model directory or a "
                                                   "config.json; see hf-memkit plan --help)",
                                     "training.seq_len": " (tokens per sequence, e.g. 2048)",
                                     "training.target_batch_size": " (effective batch size, "
                                                                   "e.g. 32)"}[key])

    def local(v: str) -> Path | None:
        """A path relative to the recipe file (or absolute / from the cwd) that exists."""
        p = Path(os.path.expanduser(v))
        for cand in ((p,) if p.is_absolute() else (base / p, p)):
            if cand.exists():
                return cand.resolve()
        return None

    # -- model ----------------------------------------------------------------------------------
    config = None
    name = flat.get("model.name")
    if name is not None and c.string("model.name", name):
        path = local(name)
        kw["model"] = str(path) if path is not None else name
        if path is None and (name.startswith((".", "/", "~")) or name.endswith(".json")):
            c.add("model.name", f"no such directory or file `{name}` (relative paths are "
                                f"relative to the recipe file, {base})")
        else:
            try:
                from ._model_catalog import resolve_config

                config = resolve_config(kw["model"])
            except HfMemkitError as exc:
                c.add("model.name", str(exc))
    overrides = flat.get("model.overrides")
    if overrides is not None and c.mapping("model.overrides", overrides) is not None:
        kw["model_overrides"] = dict(overrides)
        if config is not None:
            allowed = _config_keys(config)
            bad = [k for k in overrides if k not in allowed]
            for k in bad:
                c.add(f"model.overrides.{k}", f"not a field of {type(config).__name__}"
                      f"{did_you_mean(k, allowed)}")
            if not bad:
                try:
                    config = _apply_overrides(config, overrides)
                except Exception as exc:  # the config class rejects the combination
                    c.add("model.overrides", f"{type(config).__name__} rejects these values: "
                                             f"{exc}")
                    config = None
    task = flat.get("model.task")
    if task is not None and c.string("model.task", task):
        from ._profile import normalize_task

        try:
            kw["task"] = normalize_task(task)
        except HfMemkitError as exc:
            c.add("model.task", str(exc))
    tok = flat.get("model.tokenizer")
    if tok is not None and c.string("model.tokenizer", tok):
        p = local(tok)
        if p is None or not p.is_dir():
            c.add("model.tokenizer", f"no such directory `{tok}` (relative paths are relative "
                                     f"to the recipe file, {base})")
        elif not _has_tokenizer(p):
            c.add("model.tokenizer", f"`{tok}` holds no tokenizer files "
                                     f"({', '.join(TOKENIZER_FILES)}); write one with "
                                     "tokenizer.save_pretrained(dir)")
        else:
            kw["tokenizer"] = str(p)

    # -- data -------------------------------------------------------------------------------------
    data = flat.get("data.source", "synthetic")
    if c.string("data.source", data):
        if data == "synthetic":
            kw["data"] = data
        else:
            p = local(data)
            if p is None or not p.is_file():
                c.add("data.source", f"no such file `{data}`; give 'synthetic' or a local "
                                     f"{'/'.join(DATA_SUFFIXES)} file (relative paths are "
                                     f"relative to the recipe file, {base})")
            elif p.suffix not in DATA_SUFFIXES:
                c.add("data.source", f"`{data}`: unsupported file type `{p.suffix}`; allowed: "
                                     f"{', '.join(DATA_SUFFIXES)} (JSON lines), or 'synthetic'")
            else:
                kw["data"] = str(p)
                model_dir = Path(kw.get("model", ""))
                if "tokenizer" not in kw and tok is None and not (
                        model_dir.is_dir() and _has_tokenizer(model_dir)):
                    c.add("model.tokenizer", f"data from a file (`{data}`) needs a tokenizer: "
                          "set model.tokenizer to a local directory holding one (as written by "
                          "tokenizer.save_pretrained); nothing is downloaded")
    if flat.get("data.num_samples") is not None:
        kw["num_samples"] = c.positive_int("data.num_samples", flat["data.num_samples"])
    for key, attr in (("data.text_field", "text_field"), ("data.label_field", "label_field")):
        if key in flat and c.string(key, flat[key]):
            kw[attr] = flat[key]

    # -- training -------------------------------------------------------------------------------
    seq_len = target = None
    if flat.get("training.seq_len") is not None:
        seq_len = kw["seq_len"] = c.positive_int("training.seq_len", flat["training.seq_len"])
    if flat.get("training.target_batch_size") is not None:
        target = kw["target_batch_size"] = c.positive_int("training.target_batch_size",
                                                          flat["training.target_batch_size"])
    method = flat.get("training.method", "auto")
    if method not in METHODS:
        c.add("training.method", f"expected one of {', '.join(METHODS)}, got "
                                 f"{_describe(method)}{did_you_mean(str(method), METHODS)}")
    else:
        kw["method"] = method
        from ._compat import is_bitsandbytes_available, is_peft_available

        if method in ("lora", "qlora") and not is_peft_available():
            c.add("training.method", f"`{method}` needs peft: pip install 'hf-memkit[peft]'")
        if method == "qlora" and not is_bitsandbytes_available():
            c.add("training.method", "`qlora` needs bitsandbytes: pip install 'hf-memkit[bnb]'")
    if config is not None and seq_len:
        limit = getattr(config, "max_position_embeddings", None) or getattr(
            config, "n_positions", None)
        if isinstance(limit, int) and seq_len > limit:
            c.add("training.seq_len", f"{seq_len} is longer than the model's {limit} positions "
                                      "(max_position_embeddings); lower seq_len or set "
                                      "model.overrides.max_position_embeddings")

    # -- hardware -------------------------------------------------------------------------------
    dev = None
    device = flat.get("hardware.device")
    if device is not None and c.string("hardware.device", device):
        from ._device import get_device, list_devices

        try:
            dev = get_device(device)
            kw["device"] = "cpu" if dev.kind == "cpu" else dev.name
        except HfMemkitError:
            c.add("hardware.device", f"unknown GPU `{device}`"
                  f"{did_you_mean(device, [*list_devices(), 'cpu'])}; allowed: 'cpu', or a "
                  f"catalog GPU: {', '.join(list_devices())} (hf-memkit devices), or omit the "
                  "key to use this machine")
    gpus = 1
    if flat.get("hardware.num_gpus") is not None:
        gpus = kw["num_gpus"] = c.positive_int("hardware.num_gpus", flat["hardware.num_gpus"])
        if gpus and gpus > 1 and dev is not None and dev.kind == "cpu":
            c.add("hardware.num_gpus", f"{gpus} GPUs with device 'cpu'; set a catalog GPU or "
                                       "num_gpus: 1")
    if gpus and target and target % gpus:
        lo = target - target % gpus
        c.add("training.target_batch_size",
              f"{target} is not divisible by num_gpus={gpus}; nearest valid targets: "
              f"{', '.join(str(v) for v in (lo, lo + gpus) if v > 0)}")
    def size(key: str, example: str) -> None:
        from ._units import parse_bytes

        v = flat.get(f"hardware.{key}")
        if v is None:
            return
        try:
            if isinstance(v, bool) or parse_bytes(v) <= 0:
                raise ValueError
            kw[key] = v
        except (ValueError, TypeError, HfMemkitError):
            c.add(f"hardware.{key}", f"expected bytes or a size such as '{example}', got "
                                     f"{_describe(v)}")

    size("max_memory", "20GiB")
    size("host_memory", "512GiB")
    nodes = flat.get("hardware.num_nodes")
    if nodes is not None:
        n_nodes = c.positive_int("hardware.num_nodes", nodes)
        if n_nodes:
            kw["num_nodes"] = n_nodes
            if gpus and gpus % n_nodes:
                c.add("hardware.num_nodes", f"num_gpus={gpus} is not a multiple of "
                                            f"num_nodes={n_nodes}; num_gpus counts all nodes")
    eng = flat.get("hardware.engine")
    if eng is not None:
        from ._plan import ENGINES

        if eng in ENGINES:
            kw["engine"] = eng
        else:
            c.add("hardware.engine", f"unknown engine {_describe(eng)}"
                  f"{did_you_mean(str(eng), ENGINES)}; allowed: {', '.join(ENGINES)}")
    hr = flat.get("hardware.headroom")
    if hr is not None:
        if isinstance(hr, (int, float)) and not isinstance(hr, bool) and 0 <= hr < 1:
            kw["headroom"] = float(hr)
        else:
            c.add("hardware.headroom", f"expected a fraction in [0, 1), e.g. 0.1, got "
                                       f"{_describe(hr)}")

    # -- pins -------------------------------------------------------------------------------------
    pins = flat.get("pins")
    if pins is not None and c.mapping("pins", pins) is not None:
        kw["pins"] = _check_pins(dict(pins), c, dev=dev, target=target, gpus=gpus)

    # -- callbacks, output_dir --------------------------------------------------------------------
    cbs = flat.get("callbacks")
    if cbs is not None:
        if not isinstance(cbs, list) or not all(isinstance(x, str) for x in cbs):
            c.add("callbacks", f"expected a list of names ({', '.join(CALLBACKS)}), got "
                               f"{_describe(cbs)}")
        else:
            for x in cbs:
                if x not in CALLBACKS:
                    c.add("callbacks", f"unknown callback `{x}`{did_you_mean(x, CALLBACKS)}; "
                                       f"allowed: {', '.join(CALLBACKS)}")
            kw["callbacks"] = list(cbs)
    if flat.get("output_dir") is not None and c.string("output_dir", flat["output_dir"]):
        kw["output_dir"] = flat["output_dir"]

    if c.problems:
        raise ConfigError(c.problems, source=where)
    return Recipe(**kw)


def _check_pins(pins: dict[str, Any], c: _Checker, *, dev: Any, target: int | None,
                gpus: int | None) -> dict[str, Any]:
    from ._setup import normalize_args, training_args_fields

    fields = training_args_fields()
    known = {}
    for k, v in pins.items():
        k = str(k)
        if k in _OWNED_PINS:
            c.add(f"pins.{k}", f"set it as the top-level `{_OWNED_PINS[k]}` key instead")
        elif k not in fields:
            hint = did_you_mean(k, fields)
            if not hint and k in {key.split(".")[-1] for key in _FIELDS}:
                hint = f" (did you mean the recipe key `{_leaf_key(k)}`?)"
            c.add(f"pins.{k}", f"not a TrainingArguments field{hint}")
        else:
            known[k] = v
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            normalize_args(known, source="pins")
        except ConfigError as exc:
            for p in exc.problems:
                c.add("pins", p)
    if dev is not None:
        if known.get("bf16") and not dev.supports_bf16 and dev.kind != "cpu":
            c.add("pins.bf16", f"{dev.name} has no bf16 support (compute capability "
                               f"{'.'.join(map(str, dev.compute_capability or ()))}); use fp16: "
                               "true or drop the pin")
        if known.get("fp16") and dev.kind == "cpu":
            c.add("pins.fp16", "fp16 mixed precision needs a CUDA GPU; on 'cpu' drop it (or "
                               "use bf16: true)")
        if known.get("tf32") and not dev.supports_tf32:
            c.add("pins.tf32", f"{dev.name} has no TF32 (needs an Ampere or newer GPU); drop "
                               "the pin")
    mb = known.get("per_device_train_batch_size")
    if isinstance(mb, int) and not isinstance(mb, bool) and mb > 0 and target and gpus:
        per_rank = target // gpus
        accum = known.get("gradient_accumulation_steps")
        if per_rank % mb:
            c.add("pins.per_device_train_batch_size",
                  f"micro-batch {mb} does not divide the per-GPU batch {per_rank} "
                  f"(target_batch_size {target} / {gpus} GPU(s)); divisors: "
                  f"{', '.join(str(d) for d in range(1, per_rank + 1) if per_rank % d == 0)}")
        elif isinstance(accum, int) and mb * accum != per_rank:
            c.add("pins.gradient_accumulation_steps",
                  f"micro-batch {mb} x accumulation {accum} x {gpus} GPU(s) = "
                  f"{mb * accum * gpus}, not target_batch_size {target}; drop the "
                  f"accumulation pin (the plan derives it) or set it to {per_rank // mb}")
    return known


def _leaf_key(leaf: str) -> str:
    return next(k for k in _FIELDS if k.split(".")[-1] == leaf)


def _has_tokenizer(d: Path) -> bool:
    return any((d / f).is_file() for f in TOKENIZER_FILES)


def _config_keys(config) -> set[str]:
    keys = set(config.to_dict())
    for cls in type(config).__mro__:
        if "__init__" in vars(cls):
            keys |= {p for p in inspect.signature(cls.__init__).parameters
                     if p not in ("self", "kwargs")}
    return keys | {"num_labels"}


def _apply_overrides(config, overrides: dict[str, Any]):
    """A new config of the same class: the overrides applied through ``__init__``, so derived
    fields (head_dim, rope parameters) are recomputed as when the config is built."""
    from transformers import AutoConfig

    d = config.to_dict()
    d.update(overrides)
    if "num_labels" in overrides:
        d.pop("id2label", None)
        d.pop("label2id", None)
    model_type = d.pop("model_type")
    d.pop("transformers_version", None)
    new = AutoConfig.for_model(model_type, **d)
    base = getattr(config, "name_or_path", "") or model_type
    new.name_or_path = f"{base} + {len(overrides)} config override(s)"
    return new


def _config_with_overrides(model: str, overrides: dict[str, Any]):
    from ._model_catalog import resolve_config

    config = resolve_config(model)
    return _apply_overrides(config, overrides) if overrides else config


__all__ = ["Recipe", "load_recipe", "bundled_recipes", "bundled_recipes_dir",
           "resolve_recipe_path"]
