"""probe_device through fakes of NVML and torch.cuda; the GPU catalog; bad names."""

from __future__ import annotations

import re

import pytest
import torch

import hf_memkit as mk
from hf_memkit._device import catalog as _gpu_catalog
from hf_memkit._units import GiB, MiB
from tests.helpers import A100_80, T4, V100_16, FakeGpu


def test_cpu_probe_describes_this_machine():
    import psutil

    dev = mk.probe_device()
    assert dev.kind == "cpu"
    assert dev.total_memory == psutil.virtual_memory().total
    assert 0 < dev.free_memory <= dev.total_memory
    assert dev.supports_bf16 is True  # torch CPU autocast offers bf16
    assert dev.compute_capability is None and dev.supports_tf32 is False


def test_ampere_via_nvml(fake_cuda):
    nvml = fake_cuda([A100_80])
    dev = mk.probe_device()
    assert (dev.kind, dev.source, dev.name) == ("cuda", "nvml", "NVIDIA A100-SXM4-80GB")
    assert dev.total_memory == 81920 * MiB and dev.free_memory == 80000 * MiB
    assert dev.compute_capability == (8, 0)
    assert dev.supports_bf16 and dev.supports_tf32 and dev.supports_fp16_tensor_cores
    assert dev.catalog_name == "A100-80GB" and dev.peak_tflops["bf16"] == 312.0
    assert dev.driver_version == "550.54.15"
    assert nvml.calls[-1] == "shutdown"  # NVML handle released


def test_volta_has_fp16_tensor_cores_but_no_bf16(fake_cuda):
    fake_cuda([V100_16])
    dev = mk.probe_device()
    assert dev.compute_capability == (7, 0)
    assert not dev.supports_bf16 and not dev.supports_tf32 and dev.supports_fp16_tensor_cores
    assert dev.catalog_name == "V100-SXM2-16GB"


def test_turing(fake_cuda):
    fake_cuda([T4])
    dev = mk.probe_device()
    assert dev.compute_capability == (7, 5) and dev.catalog_name == "T4"
    assert not dev.supports_bf16 and dev.supports_fp16_tensor_cores


@pytest.mark.parametrize("mode", ["missing", "init_raises", "query_raises"])
def test_nvml_unavailable_falls_back_to_torch(fake_cuda, mode, caplog):
    fake_cuda([A100_80], nvml=mode)
    dev = mk.probe_device()
    assert dev.source == "torch.cuda"
    assert dev.total_memory == 81920 * MiB and dev.free_memory == 80000 * MiB
    assert dev.name == "NVIDIA A100-SXM4-80GB" and dev.supports_bf16


def test_mig_slice_reports_slice_memory(fake_cuda):
    mig = FakeGpu("NVIDIA A100-SXM4-40GB", 40960 * MiB, 40000 * MiB, (8, 0), mig=True,
                  mig_total=4864 * MiB, mig_name="NVIDIA A100-SXM4-40GB MIG 1g.5gb")
    fake_cuda([mig])
    dev = mk.probe_device()
    assert dev.mig is True
    assert dev.total_memory == 4864 * MiB  # the slice, not the whole card
    assert "MIG" in dev.name


def test_several_gpus_index_and_count(fake_cuda):
    fake_cuda([A100_80, V100_16])
    d0, d1 = mk.probe_device(0), mk.probe_device(1)
    assert d0.count == d1.count == 2
    assert (d0.index, d1.index) == (0, 1)
    assert d1.catalog_name == "V100-SXM2-16GB"
    with pytest.raises(mk.HfMemkitError, match=r"index 2 does not exist.*0\.\.1"):
        mk.probe_device(2)


def test_cuda_visible_devices_maps_to_nvml_index(fake_cuda, monkeypatch):
    # NVML numbers all GPUs; CUDA only the visible ones, in CUDA_VISIBLE_DEVICES order.
    gpus = [A100_80, V100_16]
    fake_cuda(gpus)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: type("P", (), dict(name=V100_16.name, major=7, minor=0,
                                                     total_memory=V100_16.total))())
    dev = mk.probe_device(0)
    assert dev.name == "Tesla V100-SXM2-16GB" and dev.total_memory == 16160 * MiB


def test_broken_driver_never_crashes(monkeypatch):
    def boom():
        raise RuntimeError("Found no NVIDIA driver on your system")

    monkeypatch.setattr(torch.cuda, "is_available", boom)
    assert mk.probe_device().kind == "cpu"


# --- catalog ----------------------------------------------------------------------------------

REQUIRED = ["T4", "V100-SXM2-16GB", "V100-32GB", "A10G", "L4", "L40S", "RTX-3090", "RTX-4090",
            "A100-40GB", "A100-80GB", "H100-80GB", "H100-PCIe-80GB", "H200"]


def test_catalog_has_required_gpus():
    assert set(REQUIRED) <= set(mk.list_devices())


@pytest.mark.parametrize("name", sorted(_gpu_catalog.catalog()))
def test_every_catalog_entry_is_complete_and_consistent(name):
    spec = _gpu_catalog.catalog()[name]
    dev = mk.get_device(name)
    assert dev.kind == "cuda" and dev.name == name and dev.source == "catalog"
    assert 8 * GiB < dev.total_memory < 150 * GiB
    assert set(dev.peak_tflops) == {"fp32", "tf32", "fp16", "bf16"}
    # Tensor-core math is faster than plain fp32 on every card in the catalog.
    assert dev.peak_tflops["fp16"] > dev.peak_tflops["fp32"] > 0
    assert (dev.peak_tflops["bf16"] > 0) == dev.supports_bf16 == (spec.compute_capability >= (8, 0))
    assert (dev.peak_tflops["tf32"] > 0) == dev.supports_tf32
    assert dev.memory_bandwidth > 1e11 and dev.interconnect_bandwidth >= 16e9
    assert re.fullmatch(r"(nvlink|pcie)\d", dev.interconnect)
    assert spec.source, "every entry cites its datasheet"
    for alias in spec.aliases:  # every alias resolves to its own entry, in any case
        assert mk.get_device(alias).name == name
        assert mk.get_device(alias.upper()).name == name
        assert mk.get_device(alias.lower()).name == name


@pytest.mark.parametrize("alias,expected", [
    ("a100", "A100-80GB"), ("A100-SXM4-80GB", "A100-80GB"), ("NVIDIA A100-SXM4-40GB", "A100-40GB"),
    ("h100", "H100-80GB"), ("NVIDIA H100 80GB HBM3", "H100-80GB"), ("NVIDIA H100 PCIe", "H100-PCIe-80GB"),
    ("Tesla T4", "T4"), ("NVIDIA GeForce RTX 4090", "RTX-4090"), ("rtx3090", "RTX-3090"),
    ("Tesla V100-SXM2-32GB", "V100-32GB"), ("nvidia l40s", "L40S"),
])
def test_aliases_and_nvml_names(alias, expected):
    assert mk.get_device(alias).name == expected


def test_unknown_gpu_lists_known_ones():
    with pytest.raises(mk.HfMemkitError) as e:
        mk.get_device("A100-90GB")
    msg = str(e.value)
    assert "`A100-90GB`" in msg and "A100-80GB" in msg and "H100-80GB" in msg
    assert "hf-memkit devices" in msg


def test_get_device_cpu_and_replace():
    cpu = mk.get_device("cpu")
    assert cpu.kind == "cpu"
    small = cpu.replace(total_memory=2 * GiB)
    assert small.total_memory == 2 * GiB and small.name == cpu.name
    with pytest.raises(mk.HfMemkitError, match="positive"):
        cpu.replace(total_memory=0)


def test_device_info_round_trips_through_dict():
    import json

    dev = mk.get_device("H100")
    again = mk.DeviceInfo.from_dict(json.loads(json.dumps(dev.to_dict())))
    assert again == dev
