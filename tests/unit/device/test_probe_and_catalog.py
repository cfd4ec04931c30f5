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
    assert nvml.calls[-1] == "nvmlShutdown"  # NVML handle released


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
    machine = fake_cuda([A100_80], nvml=mode)
    dev = mk.probe_device()
    assert dev.source == "torch.cuda"
    # torch.cuda.mem_get_info opens a CUDA context first: free is read after it exists
    assert dev.total_memory == 81920 * MiB
    assert dev.free_memory == 80000 * MiB - machine.context_bytes
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
def test_every_catalog_entry_is_complete_plausible_and_sourced(name):
    spec = _gpu_catalog.catalog()[name]
    dev = mk.get_device(name)
    assert dev.name == name and dev.source == "catalog" and dev.vendor == spec.vendor
    # ROCm GPUs are torch's cuda devices; Apple silicon trains on mps, without a compute capability
    assert dev.kind == {"nvidia": "cuda", "amd": "cuda", "apple": "mps"}[spec.vendor]
    assert (dev.compute_capability is None) == (spec.vendor == "apple")
    assert 8 * GiB < dev.total_memory < 300 * GiB
    assert set(dev.peak_tflops) == {"fp32", "tf32", "fp16", "bf16"}
    assert dev.peak_tflops["fp16"] >= dev.peak_tflops["fp32"] > 0
    assert (dev.peak_tflops["bf16"] > 0) == dev.supports_bf16
    if spec.vendor == "nvidia":  # bf16 and TF32 tensor cores: Ampere (sm_80) and newer
        assert dev.supports_bf16 == dev.supports_tf32 == (spec.compute_capability >= (8, 0))
        assert (dev.peak_tflops["tf32"] > 0) == dev.supports_tf32
        # Tensor-core math is faster than plain fp32 on every NVIDIA card in the catalog.
        assert dev.peak_tflops["fp16"] > dev.peak_tflops["fp32"]
    else:  # transformers allows tf32=True on CUDA builds of torch only
        assert not dev.supports_tf32
    assert dev.memory_bandwidth > 1e11
    if spec.vendor == "apple":
        assert dev.interconnect == "none" and dev.interconnect_bandwidth == 0
    else:
        assert dev.interconnect_bandwidth >= 16e9
        assert re.fullmatch(r"(nvlink|pcie)\d|xgmi", dev.interconnect)
    assert re.search(r"https://\S+", spec.source), "every entry cites its source by URL"
    for alias in spec.aliases:  # every alias resolves to its own entry, in any case
        assert mk.get_device(alias).name == name
        assert mk.get_device(alias.upper()).name == name
        assert mk.get_device(alias.lower()).name == name


NEW_GENERATION = ["B200", "B300", "GB200", "GB300", "H20", "RTX-5090", "RTX-PRO-6000", "MI300X",
                  "MI325X", "MI355X", "M2-Max-96GB"]


def test_catalog_has_the_current_generation():
    assert set(NEW_GENERATION) <= set(mk.list_devices())


@pytest.mark.parametrize("reported,expected,total_mib", [
    # what nvidia-smi / ROCm print, and the total a plan must fit in
    ("NVIDIA B200", "B200", 183359), ("NVIDIA GB200", "GB200", 189471),
    ("NVIDIA B300 SXM6 AC", "B300", 275040), ("NVIDIA GB300", "GB300", 284208),
    ("NVIDIA H20", "H20", 97871), ("NVIDIA H200", "H200", 143771),
    ("NVIDIA GeForce RTX 5090", "RTX-5090", 32607),
    ("NVIDIA RTX PRO 6000 Blackwell Workstation Edition", "RTX-PRO-6000", 97887),
    ("AMD Instinct MI300X", "MI300X", 196592), ("AMD Instinct MI300X VF", "MI300X-VF", None),
    ("AMD Instinct MI355X", "MI355X", None),
])
def test_names_that_contain_each_other_resolve_to_their_own_entry(reported, expected, total_mib):
    """B300 is a substring of GB300, H20 of H200, MI300X of MI300X VF: each resolves to its own
    entry (names are matched whole), with its own total."""
    dev = mk.get_device(reported)
    assert dev.name == expected
    if total_mib is not None:
        assert dev.total_memory == total_mib * MiB
    keys = {}
    for spec in _gpu_catalog.catalog().values():
        for n in (spec.name, *spec.aliases):
            key = _gpu_catalog.normalize_gpu_name(n)
            assert keys.setdefault(key, spec.name) == spec.name, f"{n} is two entries' name"


def test_mi300x_vf_reports_less_than_bare_metal():
    assert mk.get_device("MI300X-VF").total_memory < mk.get_device("MI300X").total_memory


def test_rocm_gpu_probes_as_cuda_with_amd_vendor(fake_cuda, monkeypatch):
    """torch's ROCm build shows an MI300X as a cuda device with the gfx942 capability (9, 4):
    bf16 yes, TF32 no (transformers checks torch.version.cuda), the catalog entry found."""
    fake_cuda([FakeGpu("AMD Instinct MI300X", 196592 * MiB, 190000 * MiB, (9, 4))],
              nvml="missing")
    monkeypatch.setattr(torch.version, "hip", "6.4.43483", raising=False)
    dev = mk.probe_device()
    assert (dev.kind, dev.vendor, dev.catalog_name) == ("cuda", "amd", "MI300X")
    assert dev.supports_bf16 and not dev.supports_tf32
    assert dev.peak_tflops["bf16"] == 1307.4


def test_estimate_on_rocm_says_it_applies_the_cuda_allocator_model():
    est = mk.estimate_memory("gpt2", {"per_device_train_batch_size": 1, "bf16": True},
                             seq_len=64, device="MI300X")
    rocm = [n for n in est.notes if n.startswith("ROCm target")]
    assert rocm and "caching-allocator model is applied" in rocm[0]
    assert est.breakdown["context"] > 0  # the CUDA model's context, as on an NVIDIA card
    nvidia = mk.estimate_memory("gpt2", {"per_device_train_batch_size": 1, "bf16": True},
                                seq_len=64, device="H100-80GB")
    assert not any(n.startswith("ROCm") for n in nvidia.notes)


def test_mps_estimate_is_a_tensor_peak_and_plans_are_refused():
    """No MPS allocator model: the estimate is the live-tensor peak and says so; a plan and a
    largest-batch query refuse (a plan must never exceed the memory it is given)."""
    est = mk.estimate_memory("gpt2", {"per_device_train_batch_size": 1}, seq_len=64,
                             device="M2-Max-96GB")
    assert est.device.kind == "mps" and est.device_used == est.peak_allocated
    assert est.breakdown["context"] == 0 and est.breakdown["fragmentation"] == 0
    assert any(n.startswith("MPS target") and "lower bound" in n for n in est.notes)
    with pytest.raises(mk.HfMemkitError, match="MPS .*no model of the MPS allocator"):
        mk.plan_training("gpt2", seq_len=64, target_batch_size=8, device="M2-Max-96GB")
    with pytest.raises(mk.HfMemkitError, match="device='H100-80GB'"):
        mk.max_batch_size("gpt2", seq_len=64, device="M2-Ultra-192GB")


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


def test_the_budget_starts_from_what_cuda_hands_out(fake_cuda):
    """NVML's total counts what the driver and firmware keep; torch's total_memory (the
    "total capacity" of its OOM message) does not. A probed GPU reads it; a catalog card carries
    the published figure, within a GiB under NVML's; an unmeasured card is given 1 GiB less."""
    from hf_memkit._estimate.budget import DRIVER_RESERVE, cuda_capacity, memory_budget

    fake_cuda([A100_80])
    dev = mk.probe_device()
    assert dev.cuda_memory == torch.cuda.get_device_properties(0).total_memory
    assert cuda_capacity(dev)[0] == dev.cuda_memory
    for name in mk.list_devices():
        d = mk.get_device(name)
        if d.vendor != "nvidia":
            assert cuda_capacity(d)[0] == d.total_memory
            continue
        cap = cuda_capacity(d)[0]
        if d.cuda_memory is not None:
            assert 0 <= d.total_memory - d.cuda_memory < GiB, name
        else:
            assert cap == d.total_memory - DRIVER_RESERVE, name
    rtx = mk.get_device("RTX-4090")
    budget = memory_budget(rtx)       # headless by default: no other tenant
    assert budget.bytes == rtx.cuda_memory and "no other tenant assumed" in budget.basis
    assert memory_budget(rtx, headroom=0.05).bytes == int(0.95 * rtx.cuda_memory)
