"""hf_memkit: predict, plan and watch the memory of Hugging Face transformers training.

Data flow (see README):
    probe_device / get_device -> DeviceInfo
    profile_model             -> ModelProfile
    estimate_memory           -> MemoryEstimate
    plan_training             -> Plan (-> TrainingArguments, model kwargs, LoRA config)
    MemoryCallback, ThroughputCallback, OOMGuardTrainer: watch a run, survive an OOM
    load_recipe               -> Recipe (a YAML training setup; hf-memkit plan/train RECIPE)
"""

from ._device import DeviceInfo, get_device, list_devices, probe_device
from ._errors import ConfigError, HfMemkitError
from ._estimate import MemoryEstimate, estimate_memory
from ._model import ModelProfile, profile_model
from ._plan import Candidate, Plan, auto_training_args, max_batch_size, max_seq_len, plan_training
from ._recipe import Recipe, load_recipe
from ._version import __version__
from .callbacks import (
    MemoryCallback,
    OOMGuardMixin,
    OOMGuardTrainer,
    OOMRecovery,
    OOMRecoveryError,
    ThroughputCallback,
    is_oom_error,
)

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
