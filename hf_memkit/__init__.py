"""hf_memkit: predict, plan and watch the memory of Hugging Face transformers training.

Data flow (see README):
    probe_device / get_device -> DeviceInfo
    profile_model             -> ModelProfile
    estimate_memory           -> MemoryEstimate
"""

from ._device import DeviceInfo, get_device, list_devices, probe_device
from ._errors import ConfigError, HfMemkitError
from ._estimate import MemoryEstimate, estimate_memory
from ._profile import ModelProfile, profile_model
from ._version import __version__

__all__ = [
    "ConfigError",
    "DeviceInfo",
    "HfMemkitError",
    "MemoryEstimate",
    "ModelProfile",
    "__version__",
    "estimate_memory",
    "get_device",
    "list_devices",
    "probe_device",
    "profile_model",
]
