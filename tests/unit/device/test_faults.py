"""Faults: a broken CUDA install, a missing NVML, and the train command's re-exec for exact CPU
readings. Only what this CPU machine cannot have is faked (CUDA devices, NVML, torch.cuda
raising). Inexact CPU readings in real runs, Ctrl-C and a failing run:
tests/integration/test_train_faults.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import hf_memkit as mk
from hf_memkit._callbacks._readers import CudaReader
from hf_memkit._device import probe as _device
from hf_memkit._units import MiB
from tests.helpers import A100_80, FakeGpu


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    """Each test sees the once-per-process warnings as if the process had just started."""
    monkeypatch.setattr(_device, "_WARNED", set())


def _warnings(caplog, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelname == "WARNING" and text in r.getMessage()]


# ----------------------------------------------------------------------------------------------
# probe_device on a broken CUDA install, without NVML
# ----------------------------------------------------------------------------------------------


def _props_raise(monkeypatch):
    def boom(i):
        raise RuntimeError("CUDA error: no CUDA-capable device is detected")

    monkeypatch.setattr(torch.cuda, "get_device_properties", boom)


def test_device_properties_raising_falls_back_to_nvml_and_catalog(fake_cuda, monkeypatch, caplog):
    fake_cuda([A100_80])
    _props_raise(monkeypatch)
    with caplog.at_level("WARNING", logger="hf_memkit"):
        dev = mk.probe_device()
        again = mk.probe_device()
    assert (dev.kind, dev.source, dev.catalog_name) == ("cuda", "nvml", "A100-80GB")
    assert dev.compute_capability == (8, 0) and dev.supports_bf16   # from the catalog entry
    assert dev.total_memory == A100_80.total and dev.free_memory == A100_80.free
    assert again == dev
    [msg] = _warnings(caplog, "get_device_properties(0) raised RuntimeError")
    assert "catalog entry A100-80GB" in msg and "nvidia-smi" in msg


def test_device_properties_raising_without_nvml_describes_the_cpu(fake_cuda, monkeypatch, caplog):
    fake_cuda([FakeGpu("NVIDIA Mystery GPU", 8000 * MiB, 7000 * MiB, (9, 0))], nvml="missing")
    _props_raise(monkeypatch)
    with caplog.at_level("WARNING", logger="hf_memkit"):
        dev = mk.probe_device()
    assert dev.kind == "cpu" and dev.source == "psutil"
    [msg] = _warnings(caplog, "get_device_properties(0) raised")
    assert "describing the CPU instead" in msg and "--gpu A100-80GB" in msg
    assert len(_warnings(caplog, "pip install nvidia-ml-py")) == 1   # and why NVML did not help


def test_is_available_raising_warns_once_and_probes_the_cpu(monkeypatch, caplog):
    def broken():
        raise RuntimeError("Unexpected error from cudaGetDeviceCount(): driver/library mismatch")

    monkeypatch.setattr(torch.cuda, "is_available", broken)
    with caplog.at_level("WARNING", logger="hf_memkit"):
        devs = [mk.probe_device(), mk.probe_device()]
    assert all(d.kind == "cpu" for d in devs)
    [msg] = _warnings(caplog, "torch.cuda.is_available() raised RuntimeError")
    assert "driver/library mismatch" in msg and "no CUDA GPU" in msg and "nvidia-smi" in msg


def test_missing_nvml_warns_once_what_is_lost_and_the_fix(fake_cuda, caplog, monkeypatch):
    fake_cuda([A100_80], nvml="missing")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with caplog.at_level("WARNING", logger="hf_memkit"):
        dev = mk.probe_device()
        mk.probe_device()
        assert CudaReader(0).open_nvml() is False   # MemoryCallback's NVML: the same warning
    assert dev.source == "torch.cuda" and dev.driver_version is None
    [msg] = _warnings(caplog, "nvidia-ml-py is not installed")
    assert "pip install nvidia-ml-py" in msg
    assert "memory/nvml_used_gib" in msg and "driver version" in msg and "MIG" in msg


# ----------------------------------------------------------------------------------------------
# CPU readings without MALLOC_MMAP_THRESHOLD_
# ----------------------------------------------------------------------------------------------


def test_reexec_never_loops_and_never_replaces_a_python_caller(monkeypatch):
    from hf_memkit.commands import train as train_cmd

    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    # called from Python (here: pytest), not as the hf-memkit program: this process stays
    monkeypatch.delenv(train_cmd.REEXEC_GUARD, raising=False)
    assert train_cmd.reexec_with_mmap_threshold("tiny-llama/1m_full_cpu") is None
    # the program, already re-executed once (the guard is set): no second exec
    monkeypatch.setattr(sys, "argv", [str(Path(sys.executable).parent / "hf-memkit"), "train",
                                      "tiny-llama/1m_full_cpu"])
    monkeypatch.setenv(train_cmd.REEXEC_GUARD, "1")
    assert train_cmd.reexec_with_mmap_threshold("tiny-llama/1m_full_cpu") is None
