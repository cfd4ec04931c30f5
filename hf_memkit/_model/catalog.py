"""Resolve a model reference to a ``PretrainedConfig`` without downloading or allocating weights.

Accepted: a bundled catalog name (public ``config.json`` hyperparameters shipped in
``hf_memkit/model_configs/``), a hub id whose config is already in the local HF cache, or a local
directory holding ``config.json``.
"""

from __future__ import annotations

import json
import os
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

from transformers import AutoConfig, PretrainedConfig

from .._errors import HfMemkitError, did_you_mean, excerpt, read_json_file

# Hub ids that name a bundled config. The files hold the published config.json values.
_HUB_IDS = {
    "meta-llama/Llama-3.1-8B": "Llama-3.1-8B",
    "meta-llama/Llama-3.1-8B-Instruct": "Llama-3.1-8B",
    "meta-llama/Meta-Llama-3.1-8B": "Llama-3.1-8B",
    "meta-llama/Llama-3.1-70B": "Llama-3.1-70B",
    "meta-llama/Llama-3.1-70B-Instruct": "Llama-3.1-70B",
    "meta-llama/Meta-Llama-3.1-70B": "Llama-3.1-70B",
    "meta-llama/Llama-3.2-1B": "Llama-3.2-1B",
    "meta-llama/Llama-3.2-1B-Instruct": "Llama-3.2-1B",
    "meta-llama/Llama-3.2-3B": "Llama-3.2-3B",
    "meta-llama/Llama-3.2-3B-Instruct": "Llama-3.2-3B",
    "meta-llama/Llama-2-7b-hf": "Llama-2-7b-hf",
    "meta-llama/Llama-2-7b": "Llama-2-7b-hf",
    "mistralai/Mistral-7B-v0.1": "Mistral-7B-v0.1",
    "Mistral-7B": "Mistral-7B-v0.1",
    "Qwen/Qwen2.5-7B": "Qwen2.5-7B",
    "Qwen/Qwen2.5-7B-Instruct": "Qwen2.5-7B",
    "openai-community/gpt2": "gpt2",
    "openai-community/gpt2-xl": "gpt2-xl",
    "google-bert/bert-base-uncased": "bert-base-uncased",
    "google-bert/bert-large-uncased": "bert-large-uncased",
    "FacebookAI/xlm-roberta-large": "xlm-roberta-large",
    "google-t5/t5-3b": "t5-3b",
    "EleutherAI/pythia-410m": "pythia-410m",
    "EleutherAI/pythia-410m-deduped": "pythia-410m",
    "facebook/opt-350m": "opt-350m",
}


@cache
def _bundled_files() -> dict[str, str]:
    root = resources.files("hf_memkit") / "model_configs"
    return {p.name[: -len(".json")]: p.name for p in root.iterdir() if p.name.endswith(".json")}


def list_models() -> list[str]:
    """Names of the bundled model configs."""
    return sorted(_bundled_files())


def _canonical(name: str) -> str | None:
    files = _bundled_files()
    lowered = {k.lower(): k for k in files}
    for key in (name, _HUB_IDS.get(name, ""), name.split("/")[-1]):
        if key.lower() in lowered:
            return lowered[key.lower()]
    hub = {k.lower(): v for k, v in _HUB_IDS.items()}
    return hub.get(name.lower())


def load_bundled_config(name: str) -> PretrainedConfig:
    canonical = _canonical(name)
    if canonical is None:
        raise KeyError(name)
    text = (resources.files("hf_memkit") / "model_configs" / _bundled_files()[canonical]).read_text()
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
    return d


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
    """A config from a catalog name, a local directory with ``config.json``, or the HF cache.
    Custom code (``auto_map``) is never run: ``trust_remote_code=False`` everywhere."""
    path = Path(ref)
    try:
        is_dir, is_json = path.is_dir(), path.suffix == ".json" and path.is_file()
    except OSError:  # a name too long for the file system: no file, maybe a catalog name
        is_dir = is_json = False
    if is_dir:
        if not (path / "config.json").is_file():
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
    try:  # a hub id whose config.json is already cached locally; never downloads, never runs code
        return AutoConfig.from_pretrained(name, local_files_only=True, trust_remote_code=False)
    except ValueError as exc:
        if "trust_remote_code" in str(exc):
            raise remote_code_error(name) from None
    except Exception:
        pass
    raise HfMemkitError(
        f"unknown model `{excerpt(name)}`{did_you_mean(name, list_models())}; bundled configs: "
        f"{', '.join(list_models())}. Otherwise pass a local directory holding config.json "
        f"(e.g. `huggingface-cli download {excerpt(name)} config.json --local-dir ./cfg`), a "
        "PretrainedConfig, or a model"
    )
