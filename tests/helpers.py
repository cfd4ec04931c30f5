"""Shared test helpers: fakes of what this CPU machine cannot have (NVML, CUDA devices), the
optional-extra rule, and the paths tests read beside them. Fixtures live in ``tests/conftest.py``;
this module holds what tests import by name (``from tests.helpers import A100_80, FakeGpu``)."""

from __future__ import annotations

import importlib
import os
import types
from dataclasses import dataclass
from pathlib import Path

import pytest

from hf_memkit._units import MiB

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent                 # the repository
BENCH = ROOT / "bench"
TEST_RECIPES = TESTS / "recipes"    # recipes that only the tests use


class NetworkAccessError(RuntimeError):
    """A test reached for the network."""


# `make test` (and so CI) installs every extra and sets HF_MEMKIT_STRICT_TESTS: there a missing
# optional package or ../shared is a failure, never a silent skip.
STRICT = bool(os.environ.get("HF_MEMKIT_STRICT_TESTS") or os.environ.get("CI"))


def require(module: str):
    """Import an optional extra (peft, bitsandbytes, deepspeed): skipped where it is not
    installed, but a failure under ``make test``, which installs them all."""
    if STRICT:
        return importlib.import_module(module)
    return pytest.importorskip(module)


@dataclass
class FakeGpu:
    name: str                      # as NVML reports it, e.g. "NVIDIA A100-SXM4-80GB"
    total: int
    free: int
    cc: tuple[int, int]
    mig: bool = False
    mig_total: int | None = None   # what CUDA sees inside a MIG slice
    mig_name: str | None = None


class NVMLError(Exception):
    pass


def make_fake_pynvml(gpus: list[FakeGpu], *, init_raises: bool = False,
                     query_raises: bool = False) -> types.ModuleType:
    """A module with the nvidia-ml-py functions hf_memkit calls, backed by ``gpus``."""
    m = types.ModuleType("pynvml")
    m.NVMLError = NVMLError
    m.NVML_DEVICE_MIG_ENABLE = 1
    m.calls = []

    def nvmlInit():
        m.calls.append("init")
        if init_raises:
            raise NVMLError("NVML Shared Library Not Found")

    def nvmlShutdown():
        m.calls.append("shutdown")

    def nvmlDeviceGetCount():
        return len(gpus)

    def nvmlDeviceGetHandleByIndex(i):
        if query_raises:
            raise NVMLError("Unknown Error")
        return gpus[i]

    def nvmlDeviceGetHandleByUUID(uuid):
        return gpus[int(uuid.rsplit("-", 1)[-1])]

    def nvmlDeviceGetName(h):
        return h.name.encode()  # older nvidia-ml-py returns bytes

    def nvmlDeviceGetMemoryInfo(h):
        return types.SimpleNamespace(total=h.total, free=h.free, used=h.total - h.free)

    def nvmlDeviceGetMigMode(h):
        if not h.name.startswith("NVIDIA A100") and not h.name.startswith("NVIDIA H100"):
            raise NVMLError("Not Supported")
        return (1 if h.mig else 0, 1 if h.mig else 0)

    def nvmlSystemGetDriverVersion():
        return "550.54.15"

    for f in (nvmlInit, nvmlShutdown, nvmlDeviceGetCount, nvmlDeviceGetHandleByIndex,
              nvmlDeviceGetHandleByUUID, nvmlDeviceGetName, nvmlDeviceGetMemoryInfo,
              nvmlDeviceGetMigMode, nvmlSystemGetDriverVersion):
        setattr(m, f.__name__, f)
    return m


A100_80 = FakeGpu("NVIDIA A100-SXM4-80GB", 81920 * MiB, 80000 * MiB, (8, 0))
V100_16 = FakeGpu("Tesla V100-SXM2-16GB", 16160 * MiB, 15000 * MiB, (7, 0))
T4 = FakeGpu("Tesla T4", 15360 * MiB, 15000 * MiB, (7, 5))
