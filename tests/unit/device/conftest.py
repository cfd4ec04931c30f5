"""Fixtures of the device room's tests."""

from __future__ import annotations

import pytest

from tests.fakes import Machine, install_cuda, install_nvml


@pytest.fixture
def machine(monkeypatch):
    """Install a Machine: ``machine(gpus, root=False)`` with nvidia-ml-py and torch.cuda."""
    for var in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.setenv(var, "")     # recorded, so that what the code under test sets
        monkeypatch.delenv(var)         # is undone after the test

    def make(gpus, **kw):
        m = Machine(gpus, **kw)
        install_nvml(m, monkeypatch)
        m.cuda = install_cuda(m, monkeypatch)
        return m

    return make
