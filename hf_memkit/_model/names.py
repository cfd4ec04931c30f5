"""The model names the catalog knows, read without torch or transformers: the command line
checks a model name against them before any heavy import (``check_model_ref``).

A name is a bundled config (``hf_memkit/model_configs/<name>.json``, the published
``config.json`` hyperparameters), a hub id naming one (``HUB_IDS``), a local file or directory,
or any other Hugging Face Hub id, whose ``config.json`` alone is read from the local HF cache or
fetched through ``huggingface_hub`` (``fetch_config``; ``HF_HUB_OFFLINE`` keeps it to the
cache). ``catalog.resolve_config`` reads them all.
"""

from __future__ import annotations

import os
import re
from functools import cache
from importlib import resources
from pathlib import Path

from .._errors import HfMemkitError, excerpt, not_a_file

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



# a size in a model's name: "8B", "0.5B", "410m", "70b", "1.5B", and the size words of a family
_SIZE = re.compile(r"(?<![a-z0-9.])(\d+(?:\.\d+)?)\s*([bmk])(?![a-z])"
                   r"|(?<![a-z])(tiny|mini|small|base|medium|large|xl|xxl)(?![a-z])", re.I)


def _sizes(name: str) -> set[str]:
    return {(m[1] + m[2] if m[1] else m[3]).lower() for m in _SIZE.finditer(name)}


def model_did_you_mean(name: str) -> str:
    """`` (did you mean `x`?)`` for a bundled name close to ``name`` of the same size: a name
    that differs in its size ("Qwen2.5-3B" against "Qwen2.5-7B", "bert-base" against
    "bert-large") is another model, and planning it would answer for the wrong one."""
    import difflib

    own = _sizes(name)
    matches = difflib.get_close_matches(name, list_models(), n=5, cutoff=0.6)
    for close in matches:
        if _sizes(close) == own:
            return f" (did you mean `{close}`?)"
    orgs = [k.split("/")[0] for c in matches for k, v in HUB_IDS.items() if v == c and "/" in k]
    if orgs and "/" not in name:  # another size of a bundled family: the Hub has it by its id
        return f" (not bundled; on the Hugging Face Hub perhaps `{orgs[0]}/{excerpt(name)}`)"
    return ""


def unknown_model_error(name: str, why: str = "") -> HfMemkitError:
    """The error for a model reference that names nothing ``resolve_config`` can read (``why``:
    what the Hub said, when it was asked)."""
    if os.path.lexists(name):   # there, but neither a folder nor a config.json: say what it is
        what = ("a broken symbolic link" if not os.path.exists(name) else
                "a file that is not a .json config" if os.path.isfile(name) else
                not_a_file(os.stat(name).st_mode))
        return HfMemkitError(f"`{excerpt(name)}` is {what}; give a model directory holding "
                             "config.json, a config.json file or a catalog name")
    return HfMemkitError(
        f"unknown model `{excerpt(name)}`{model_did_you_mean(name)}{why}; bundled configs: "
        f"{', '.join(list_models())}. Otherwise give a Hugging Face Hub id (`org/name`, its "
        "config.json is fetched), a local directory holding config.json (e.g. `hf download "
        f"{excerpt(name)} config.json --local-dir ./cfg`), a PretrainedConfig, or a model"
    )


def _hub_error(ref: str, exc: Exception) -> HfMemkitError:
    """What went wrong fetching ``ref``'s config.json, and what to do (``hf`` is the command
    huggingface_hub installs)."""
    from huggingface_hub import errors

    name = excerpt(ref)
    if isinstance(exc, errors.GatedRepoError):
        return HfMemkitError(
            f"`{name}` is a gated model on the Hugging Face Hub: accept its licence on "
            f"https://huggingface.co/{name}, then run `hf auth login` (or set HF_TOKEN) and "
            "ask again; or pass a local directory holding its config.json")
    if isinstance(exc, errors.LocalEntryNotFoundError):
        return HfMemkitError(
            f"`{name}`: its config.json is not in the local Hugging Face cache and the Hub "
            "cannot be reached (HF_HUB_OFFLINE is set, or no network). Where the Hub is "
            f"reachable run `hf download {name} config.json`, then ask again; or unset "
            "HF_HUB_OFFLINE; or pass a local directory holding config.json")
    if isinstance(exc, errors.RevisionNotFoundError):
        return HfMemkitError(f"`{name}`: the Hub has no such revision; give the model id alone "
                             "(its main revision) or a local directory holding config.json")
    if isinstance(exc, errors.RepositoryNotFoundError):
        return unknown_model_error(ref, " (the Hugging Face Hub has no model of that id, or it "
                                   "is private: `hf auth login` for a private one)")
    if isinstance(exc, errors.EntryNotFoundError):
        return HfMemkitError(f"`{name}` on the Hugging Face Hub has no config.json (not a "
                             "transformers model?); pass a local directory holding one")
    return HfMemkitError(f"`{name}`: fetching its config.json from the Hugging Face Hub failed "
                         f"({type(exc).__name__}: {excerpt(str(exc))}); run `hf download "
                         f"{name} config.json` and ask again, or pass a local directory")


def fetch_config(ref: str) -> Path:
    """The local path of hub id ``ref``'s ``config.json``: from the local HF cache, else fetched
    through ``huggingface_hub`` (that file alone; ``HF_HUB_OFFLINE``, ``HF_HOME`` and
    ``HF_HUB_CACHE`` as huggingface_hub reads them). Nothing else of the repository is read,
    and no code in it is run.

    Args:
        ref (`str`): A Hugging Face Hub model id (``"Qwen/Qwen2.5-1.5B"``).

    Returns:
        `Path`: The cached ``config.json``.

    Raises:
        HfMemkitError: ``ref`` is no valid id, names no model, is gated, has no config.json,
            or is not cached while the Hub cannot be reached; the message says what to do.
    """
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import GatedRepoError, HFValidationError

    try:
        return Path(hf_hub_download(ref, "config.json"))
    except HFValidationError:
        raise unknown_model_error(ref) from None
    except Exception as exc:  # huggingface_hub's errors (and the network's), mapped to ours
        if "/" not in ref and not isinstance(exc, GatedRepoError):
            raise unknown_model_error(ref) from None  # a mistyped bundled name, not a hub id
        raise _hub_error(ref, exc) from None


def check_model_ref(ref: str) -> None:
    """Raise an error naming the problem where ``ref`` is neither a local path, a bundled
    config, nor a hub id whose config.json is cached or can be fetched (``fetch_config``); what
    it names is read (and its own errors raised) by ``catalog.resolve_config``. Imports neither
    torch nor transformers."""
    if canonical_name(ref) is not None:
        return
    try:
        if Path(ref).is_dir() or Path(ref).is_file():
            return
    except OSError:  # a name too long for the file system: not a path
        pass
    fetch_config(ref)
