"""The model names the catalog knows, read without torch or transformers: the command line
checks a model name against them before any heavy import (``check_model_ref``).

A name is a bundled config (``hf_memkit/model_configs/<name>.json``, the published
``config.json`` hyperparameters), a hub id naming one (``HUB_IDS``), a hub id whose
``config.json`` is in the local Hugging Face cache, or a local file or directory
(``catalog.resolve_config`` reads those).
"""

from __future__ import annotations

import os
from functools import cache
from importlib import resources
from pathlib import Path

from .._errors import HfMemkitError, did_you_mean, excerpt, not_a_file

# Hub ids that name a bundled config. The files hold the published config.json values.
HUB_IDS = {
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
    "Qwen/Qwen3-8B": "Qwen3-8B",
    "Qwen/Qwen3-8B-Base": "Qwen3-8B",
    "Qwen/Qwen3-4B": "Qwen3-4B",
    "Qwen/Qwen3-4B-Base": "Qwen3-4B",
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
def bundled_files() -> dict[str, str]:
    root = resources.files("hf_memkit") / "model_configs"
    return {p.name[: -len(".json")]: p.name for p in root.iterdir() if p.name.endswith(".json")}


def list_models() -> list[str]:
    """Names of the bundled model configs."""
    return sorted(bundled_files())


def canonical_name(name: str) -> str | None:
    files = bundled_files()
    lowered = {k.lower(): k for k in files}
    for key in (name, HUB_IDS.get(name, ""), name.split("/")[-1]):
        if key.lower() in lowered:
            return lowered[key.lower()]
    hub = {k.lower(): v for k, v in HUB_IDS.items()}
    return hub.get(name.lower())



def unknown_model_error(name: str) -> HfMemkitError:
    """The error for a model reference that names nothing ``resolve_config`` can read."""
    if os.path.lexists(name):   # there, but neither a folder nor a config.json: say what it is
        what = ("a broken symbolic link" if not os.path.exists(name) else
                "a file that is not a .json config" if os.path.isfile(name) else
                not_a_file(os.stat(name).st_mode))
        return HfMemkitError(f"`{excerpt(name)}` is {what}; give a model directory holding "
                             "config.json, a config.json file or a catalog name")
    return HfMemkitError(
        f"unknown model `{excerpt(name)}`{did_you_mean(name, list_models())}; bundled configs: "
        f"{', '.join(list_models())}. Otherwise pass a local directory holding config.json "
        f"(e.g. `huggingface-cli download {excerpt(name)} config.json --local-dir ./cfg`), a "
        "PretrainedConfig, or a model"
    )


def check_model_ref(ref: str) -> None:
    """Raise ``unknown_model_error`` where ``ref`` is neither a local path, a bundled config,
    nor a hub id whose config is in the local Hugging Face cache; what it names is read (and
    its own errors raised) by ``catalog.resolve_config``. Imports neither torch nor
    transformers."""
    if canonical_name(ref) is not None:
        return
    try:
        if Path(ref).is_dir() or Path(ref).is_file():
            return
    except OSError:  # a name too long for the file system: not a path
        pass
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:  # pragma: no cover - transformers requires huggingface_hub
        return
    try:
        found = try_to_load_from_cache(ref, "config.json")
    except Exception:  # not a valid repo id: resolve_config cannot read it either
        found = None
    if not isinstance(found, str):
        raise unknown_model_error(ref)
