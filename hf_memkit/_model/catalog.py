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

from transformers import AutoConfig, PretrainedConfig

from .._errors import HfMemkitError, did_you_mean

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


def resolve_config(ref: str | os.PathLike) -> PretrainedConfig:
    """A config from a catalog name, a local directory with ``config.json``, or the HF cache."""
    path = Path(ref)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise HfMemkitError(
                f"directory `{path}` has no config.json; point at a model directory "
                "(as written by save_pretrained) or use a catalog name: "
                f"{', '.join(list_models())}"
            )
        return AutoConfig.from_pretrained(str(path))
    if path.suffix == ".json" and path.is_file():
        return AutoConfig.from_pretrained(str(path))
    name = str(ref)
    try:
        return load_bundled_config(name)
    except KeyError:
        pass
    try:  # a hub id whose config.json is already cached locally; never downloads
        return AutoConfig.from_pretrained(name, local_files_only=True)
    except Exception:
        pass
    raise HfMemkitError(
        f"unknown model `{name}`{did_you_mean(name, list_models())}; bundled configs: "
        f"{', '.join(list_models())}. Otherwise pass a local directory holding config.json "
        f"(e.g. `huggingface-cli download {name} config.json --local-dir ./cfg`), a "
        "PretrainedConfig, or a model"
    )
