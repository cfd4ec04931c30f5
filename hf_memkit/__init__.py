"""hf_memkit: predict, plan and watch the memory of Hugging Face transformers training.

Data flow (see docs/README.md):
    probe_device / get_device -> DeviceInfo
    profile_model             -> ModelProfile
    estimate_memory           -> MemoryEstimate
    plan_training             -> Plan (-> TrainingArguments, model kwargs, LoRA config)
    MemoryCallback, ThroughputCallback, OOMGuardTrainer: watch a run, survive an OOM
    load_recipe               -> Recipe (a YAML training setup; hf-memkit plan/train RECIPE)

Public names are imported on first use (PEP 562), so ``import hf_memkit`` and ``hf-memkit --help``
do not pay for torch, transformers, peft or bitsandbytes until a name that needs them is read.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

from ._version import __version__

# public name -> the module that defines it; the same names as `__all__` (tests/test_imports.py)
_EXPORTS: dict[str, str] = {
    "Candidate": "._plan",
    "ConfigError": "._errors",
    "DeviceInfo": "._device.probe",
    "HfMemkitError": "._errors",
    "MemoryCallback": ".callbacks",
    "MemoryEstimate": "._estimate",
    "ModelProfile": "._model",
    "OOMGuardMixin": ".callbacks",
    "OOMGuardTrainer": ".callbacks",
    "OOMRecovery": ".callbacks",
    "OOMRecoveryError": ".callbacks",
    "Plan": "._plan",
    "Recipe": "._recipe",
    "ThroughputCallback": ".callbacks",
    "auto_training_args": "._plan",
    "estimate_memory": "._estimate",
    "get_device": "._device.probe",
    "is_oom_error": ".callbacks",
    "list_devices": "._device.probe",
    "load_recipe": "._recipe",
    "max_batch_size": "._plan",
    "max_seq_len": "._plan",
    "plan_training": "._plan",
    "probe_device": "._device.probe",
    "profile_model": "._model",
}

__all__ = [
    "Candidate",
    "ConfigError",
    "DeviceInfo",
    "HfMemkitError",
    "MemoryCallback",
    "MemoryEstimate",
    "ModelProfile",
    "OOMGuardMixin",
    "OOMGuardTrainer",
    "OOMRecovery",
    "OOMRecoveryError",
    "Plan",
    "Recipe",
    "ThroughputCallback",
    "auto_training_args",
    "estimate_memory",
    "get_device",
    "is_oom_error",
    "list_devices",
    "load_recipe",
    "max_batch_size",
    "max_seq_len",
    "plan_training",
    "probe_device",
    "profile_model",
    "__version__",
]

if TYPE_CHECKING:  # what static tools and IDEs see; at run time, __getattr__ below
    from ._device.probe import DeviceInfo, get_device, list_devices, probe_device
    from ._errors import ConfigError, HfMemkitError
    from ._estimate import MemoryEstimate, estimate_memory
    from ._model import ModelProfile, profile_model
    from ._plan import (
        Candidate,
        Plan,
        auto_training_args,
        max_batch_size,
        max_seq_len,
        plan_training,
    )
    from ._recipe import Recipe, load_recipe
    from .callbacks import (
        MemoryCallback,
        OOMGuardMixin,
        OOMGuardTrainer,
        OOMRecovery,
        OOMRecoveryError,
        ThroughputCallback,
        is_oom_error,
    )


def __getattr__(name: str) -> Any:
    """Import the module behind a public name on first access and cache the name here.
    A submodule (``hf_memkit._plan``, ``hf_memkit.testing``) is imported on access as well, as
    it was when this package imported everything eagerly."""
    module = _EXPORTS.get(name)
    if module is None:
        if not name.startswith("__") and importlib.util.find_spec(f"{__name__}.{name}"):
            return importlib.import_module(f".{name}", __name__)
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from ._compat import quiet_notices

    with quiet_notices():
        value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
