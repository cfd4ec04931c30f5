"""Resolve a model reference to a ``PretrainedConfig`` without downloading or allocating weights.

Accepted: a bundled catalog name (public ``config.json`` hyperparameters shipped in
``hf_memkit/model_configs/``), a local directory holding ``config.json``, or a Hugging Face Hub
id, whose ``config.json`` alone is read from the local HF cache or fetched (``names.fetch_config``).
"""

from __future__ import annotations

import json
import os
from importlib import resources
from pathlib import Path
from typing import Any

from transformers import AutoConfig, PretrainedConfig

from .._errors import HfMemkitError, did_you_mean, quoted, read_json_file
from .names import bundled_files, canonical_name, fetch_config, list_models


def load_bundled_config(name: str) -> PretrainedConfig:
    canonical = canonical_name(name)
    if canonical is None:
        raise KeyError(name)
    text = (resources.files("hf_memkit") / "model_configs" / bundled_files()[canonical]).read_text()
    data = json.loads(text)
    model_type = data.pop("model_type")
    config = AutoConfig.for_model(model_type, **data)
    config.name_or_path = canonical
    return config


CONFIG_CAP = 64 * 2**20  # bytes of a config.json (the largest hold label maps of a few MiB)


def _check_config_file(file: Path) -> dict:
    """``config.json`` read and checked before transformers sees it: UTF-8, JSON, a mapping with
    a ``model_type`` transformers knows. A config whose type only the directory's own Python
    defines (``auto_map``) is refused: hf_memkit never runs a model's custom code."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    fix = ("write it with config.save_pretrained(dir), or use a catalog name: "
           f"{', '.join(list_models())}")
    d = read_json_file(file, name=f"`{file}`", what="a config.json", cap=CONFIG_CAP,
                       fix=f"a config.json is one JSON object with a `model_type`: {fix}")
    if not isinstance(d, dict):
        raise HfMemkitError(f"`{file}` holds a JSON {type(d).__name__}, not an object; a "
                            f"config.json is one JSON object with a `model_type`: {fix}")
    model_type = d.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise HfMemkitError(f"`{file}` has no `model_type` (got {model_type!r}); set it to a "
                            f"transformers model type such as \"llama\", or {fix}")
    if model_type not in CONFIG_MAPPING:
        if d.get("auto_map"):
            raise remote_code_error(file, model_type)
        raise HfMemkitError(
            f"`{file}`: model_type `{model_type}` is not a model type transformers "
            f"{_transformers_version()} knows{did_you_mean(model_type, list(CONFIG_MAPPING.keys()))}; "
            "use a model type transformers ships (e.g. llama, mistral, gpt2, bert), or a newer "
            "transformers")
    bad = [k for k in SIZE_FIELDS if isinstance(d.get(k), str) or (
        isinstance(d.get(k), (int, float)) and not isinstance(d[k], bool) and d[k] < 1)]
    if bad:   # transformers divides by some of them (head_dim = hidden_size // heads)
        raise HfMemkitError("; ".join(f"`{file}`: {k}={quoted(d[k])} is not a size" for k in bad)
                            + "; each must be a positive integer: the model's real value")
    return d


# sizes a config.json holds that must be positive integers (a zero is divided by, a negative
# makes a tensor of negative size)
SIZE_FIELDS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size",
               "vocab_size", "head_dim", "n_embd", "n_head", "d_model", "num_heads")


def remote_code_error(where: Any, model_type: str | None = None) -> HfMemkitError:
    what = f"model_type `{model_type}` is" if model_type else "its config or model class is"
    return HfMemkitError(
        f"`{where}` needs custom code: {what} defined by the model's own Python files "
        "(auto_map), and hf_memkit never runs a model's code (it reads configs with "
        "trust_remote_code=False), so the command line and recipes cannot use it. To proceed, "
        "review the code, build the model yourself in Python on the meta device (config = "
        "AutoConfig.from_pretrained(DIR, trust_remote_code=True); with torch.device('meta'): "
        "model = AutoModelForCausalLM.from_config(config, trust_remote_code=True)) and pass the "
        "model to hf_memkit.estimate_memory / plan_training; or use a model type transformers "
        "ships")


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def _from_pretrained(ref: str, file: Path, **kwargs: Any) -> PretrainedConfig:
    """``AutoConfig.from_pretrained`` that never runs custom code; its errors name the file."""
    try:
        return AutoConfig.from_pretrained(ref, trust_remote_code=False, **kwargs)
    except Exception as exc:  # transformers: ValueError, OSError, strict-dataclass errors
        text = str(exc)
        if "trust_remote_code" in text:
            raise remote_code_error(file) from None
        raise HfMemkitError(f"transformers cannot read `{file}`: {type(exc).__name__}: "
                            f"{text.strip()}; fix the value it names, or write the config "
                            "with config.save_pretrained(dir)") from None


def resolve_config(ref: str | os.PathLike) -> PretrainedConfig:
    """A config from a catalog name, a local directory with ``config.json``, or a Hub id (its
    ``config.json`` from the HF cache, else fetched). Custom code (``auto_map``) is never run:
    ``trust_remote_code=False`` everywhere."""
    path = Path(ref)
    try:
        is_dir, is_json = path.is_dir(), path.suffix == ".json" and path.is_file()
    except OSError:  # a name too long for the file system: no file, maybe a catalog name
        is_dir = is_json = False
    if is_dir:
        if not os.path.lexists(path / "config.json"):  # a FIFO or a device: read_user_file says
            raise HfMemkitError(
                f"directory `{path}` has no config.json; point at a model directory "
                "(as written by save_pretrained) or use a catalog name: "
                f"{', '.join(list_models())}"
            )
        _check_config_file(path / "config.json")
        return _from_pretrained(str(path), path / "config.json")
    if is_json:
        _check_config_file(path)
        return _from_pretrained(str(path), path)
    name = str(ref)
    try:
        return load_bundled_config(name)
    except KeyError:
        pass
    file = fetch_config(name)  # a hub id: its config.json alone, cached or fetched
    _check_config_file(file)
    return _from_pretrained(str(file.parent), file)
