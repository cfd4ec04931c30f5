"""Shared fixtures: fakes of what this CPU machine cannot have (NVML, CUDA devices). What tests
import by name (the fake GPUs, ``require``, the paths) is in ``tests/helpers.py``."""

from __future__ import annotations

import atexit
import ipaddress
import os
import shutil
import socket
import sys
import tempfile

# The suite never touches the network: Hugging Face libraries stay offline (read at import, so
# set before they load; subprocesses inherit it), and any connection or name lookup beyond this
# machine fails the test that made it.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
# ... and never writes to the user's cache: calibrations and traces go to a folder of the run's
# own (subprocesses inherit it), and no trace is kept between tests, so a test that needs a
# fresh trace is never answered from disk; the tests of the trace store turn it on in a folder
# of their own (tests/unit/estimate/test_trace_store.py).
_CACHE = tempfile.mkdtemp(prefix="hf_memkit-tests-")
atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)
os.environ["HF_MEMKIT_CACHE"] = _CACHE
os.environ["HF_MEMKIT_NO_CACHE"] = "1"

from tests.helpers import FakeGpu, NetworkAccessError  # noqa: E402

_LOCAL_NAMES = {"localhost", "", socket.gethostname(), socket.getfqdn()}


def _local(host) -> bool:
    if host is None or (isinstance(host, str) and host.lower() in _LOCAL_NAMES):
        return True
    try:
        ip = ipaddress.ip_address(host.decode() if isinstance(host, bytes) else str(host))
    except ValueError:
        return False
    return ip.is_loopback or ip.is_unspecified or ip.is_private


def _guard_network() -> None:
    real_connect, real_connect_ex = socket.socket.connect, socket.socket.connect_ex
    real_getaddrinfo = socket.getaddrinfo

    def check(sock, address):
        if sock.family in (socket.AF_INET, socket.AF_INET6) and not _local(address[0]):
            raise NetworkAccessError(f"the test suite must not use the network: connect to "
                                     f"{address!r}")

    def connect(self, address):
        check(self, address)
        return real_connect(self, address)

    def connect_ex(self, address):
        check(self, address)
        return real_connect_ex(self, address)

    def getaddrinfo(host, *args, **kwargs):
        if not _local(host):
            raise NetworkAccessError(f"the test suite must not use the network: lookup of "
                                     f"{host!r}")
        return real_getaddrinfo(host, *args, **kwargs)

    socket.socket.connect, socket.socket.connect_ex = connect, connect_ex
    socket.getaddrinfo = getaddrinfo


_guard_network()

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True)
def _cuda_visible_devices_restored(monkeypatch):
    """``hf-memkit train`` pins ``CUDA_VISIBLE_DEVICES`` in its own process (``pin_one_device``);
    a test that runs it in-process gets the variable back as it was."""
    value = os.environ.get("CUDA_VISIBLE_DEVICES")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", value if value is not None else "")
    if value is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES")


@pytest.fixture
def fake_cuda(monkeypatch):
    """Install a GPU machine built from ``FakeGpu`` records (``tests.fakes``): ``torch.cuda``
    with CUDA's rules and, by default, nvidia-ml-py over a fake NVML library with NVML's.

    Usage: ``fake_cuda(gpus, nvml="ok" | "missing" | "init_raises" | "query_raises")`` returns
    the ``Machine`` (its ``gpus`` in PCI order = the list's order; what is not ``free`` is held
    by another process). ``"missing"``: nvidia-ml-py not installed; ``"init_raises"``: installed
    but the driver's library is absent; ``"query_raises"``: handle lookups fail.
    """
    from tests.fakes import Gpu, Machine, Mig, install_cuda, install_nvml, remove_nvml_library
    from tests.fakes.machine import mig_uuid_of, uuid_of

    def install(gpus: list[FakeGpu], nvml: str = "ok"):
        real = []
        for i, g in enumerate(gpus):
            migs = [Mig((g.mig_name or "").rsplit(" ", 1)[-1] or "1g.5gb", g.mig_total,
                        mig_uuid_of(i, 0))] if g.mig else []
            real.append(Gpu(g.name, g.total, g.cc, uuid_of(i), 0x10 * (i + 1), reserved=0,
                            migs=migs, mig_capable=g.name.startswith(("NVIDIA A100",
                                                                      "NVIDIA H100"))))
        machine = Machine(real)
        for i, g in enumerate(gpus):
            target = real[i].migs[0] if g.mig else real[i]
            held = (g.mig_total if g.mig else g.total) - g.free
            if held > 0 and not g.mig:
                machine.spawn(4000 + i, target.uuid, held)
        machine.cuda = install_cuda(machine, monkeypatch)
        if nvml == "missing":
            monkeypatch.setitem(sys.modules, "pynvml", None)  # import raises ImportError
        elif nvml == "init_raises":
            remove_nvml_library(monkeypatch)
        else:
            install_nvml(machine, monkeypatch)
            if nvml == "query_raises":
                machine.nvml_errors.update({"nvmlDeviceGetHandleByIndex_v2": 999,
                                            "nvmlDeviceGetHandleByUUID": 999})
        return machine

    return install


@pytest.fixture(scope="module")
def base_model():
    """The OOM tests' tiny Llama in float64 (bit-comparable runs), one per test module."""
    from transformers import LlamaForCausalLM

    from hf_memkit._run.synthetic import tiny_llama_config

    torch.manual_seed(0)
    cfg = tiny_llama_config(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=2, num_key_value_heads=1, vocab_size=64)
    return LlamaForCausalLM(cfg).double()


@pytest.fixture
def clean_cuda_env(monkeypatch):
    """A CUDA estimate reads CUDA_MODULE_LOADING, NCCL_BUFFSIZE, the allocator options, the
    cuBLAS workspace settings and the cuDNN-attention switch from the environment."""
    for var in ("CUDA_MODULE_LOADING", "NCCL_BUFFSIZE", "PYTORCH_CUDA_ALLOC_CONF",
                "PYTORCH_ALLOC_CONF", "CUBLAS_WORKSPACE_CONFIG", "CUBLASLT_WORKSPACE_SIZE",
                "TORCH_CUBLASLT_UNIFIED_WORKSPACE", "TORCH_CUDNN_SDPA_DEPRIORITIZED"):
        monkeypatch.delenv(var, raising=False)
