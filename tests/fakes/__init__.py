"""Fakes of what a CPU machine cannot have, following the real APIs' rules: a GPU machine
(``machine``), NVML's C library under the real nvidia-ml-py (``nvml``) and ``torch.cuda``
(``cuda``). The way CUDA-only code is tested: build a ``Machine``, install both views, call
the code, assert what a real GPU machine would show."""

from .cuda import FakeCuda, enumerate_devices, install_cuda
from .machine import Gpu, Machine, Mig, a100, h100, mig_uuid_of, t4, uuid_of
from .nvml import FakeLib, install_nvml, remove_nvml_library

__all__ = ["FakeCuda", "FakeLib", "Gpu", "Machine", "Mig", "a100", "enumerate_devices", "h100",
           "install_cuda", "install_nvml", "mig_uuid_of", "remove_nvml_library", "t4",
           "uuid_of"]
