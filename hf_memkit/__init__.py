"""hf_memkit: predict, plan and watch the memory of Hugging Face transformers training.

Data flow (see README):
    probe_device / get_device -> DeviceInfo
    profile_model             -> ModelProfile
"""

from ._device import DeviceInfo, get_device, list_devices, probe_device
from ._errors import ConfigError, HfMemkitError
from ._profile import ModelProfile, profile_model
from ._version import __version__

__all__ = [
    "ConfigError",
    "DeviceInfo",
    "HfMemkitError",
    "ModelProfile",
    "__version__",
    "get_device",
    "list_devices",
    "probe_device",
    "profile_model",
]
