"""Fences around optional dependencies (STYLE.md §11).

Each ``is_*_available`` answers without importing the package twice; ``require`` raises an
error that names the feature lost and the extra that brings it back.
"""

from __future__ import annotations

import importlib
import importlib.util
from functools import cache

from ._errors import HfMemkitError

_EXTRA = {
    "pynvml": "nvml",
    "peft": "peft",
    "bitsandbytes": "bnb",
    "matplotlib": "plot",
}


@cache
def _has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def is_nvml_available() -> bool:
    return _has("pynvml")


def is_peft_available() -> bool:
    return _has("peft")


def is_bitsandbytes_available() -> bool:
    return _has("bitsandbytes")


def is_matplotlib_available() -> bool:
    return _has("matplotlib")


def is_flash_attn_available() -> bool:
    return _has("flash_attn")


def require(module: str, feature: str):
    """Import ``module`` or raise an error naming the lost ``feature`` and the pip extra."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        extra = _EXTRA.get(module)
        hint = f"pip install 'hf-memkit[{extra}]'" if extra else f"pip install {module}"
        raise HfMemkitError(f"{feature} needs `{module}`, which is not installed; {hint}") from exc
