"""The CUDA/NVML fakes against the real libraries' rules, and two NVML defects (issue 43,
item 5). Each test failed before its fix: the fakes followed this project's guesses, not
torch's ``set_device`` / ``_parse_visible_devices`` and CUDA's one-MIG-device rule, and
``nvml.processes`` / ``measure_calibration`` mishandled NVML errors the real pynvml raises."""

from __future__ import annotations

import pynvml
import pytest
import torch

import hf_memkit as mk
from hf_memkit import HfMemkitError
from hf_memkit._device import measure as measure_mod
from hf_memkit._device.measure import measure_calibration
from hf_memkit._device.nvml import nvml_handle, processes, visible_entries
from hf_memkit._units import GiB, MiB
from tests.fakes import (
    Machine,
    a100,
    enumerate_devices,
    mig_uuid_of,
    remove_nvml_library,
    t4,
    uuid_of,
)


def _nvml_used(index: int) -> int:
    """NVML v1 ``used`` of the GPU at NVML index ``index``, read through the real pynvml."""
    pynvml.nvmlInit()
    try:
        return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(index)).used)
    finally:
        pynvml.nvmlShutdown()


# --- 1: set_device to the current device makes no context ---------------------------------------

def test_set_device_makes_a_context_only_when_the_device_changes(machine):
    """``c10::cuda::SetDevice(i, force=false)`` calls ``cudaSetDevice`` (which makes the
    primary context) only when ``i`` is not current; a fresh process's current device is 0."""
    m = machine([a100(0x07, 0), a100(0x41, 1)])
    used = [_nvml_used(0), _nvml_used(1)]
    torch.cuda.set_device(0)
    assert torch.cuda.is_initialized() and torch.cuda.current_device() == 0
    assert m.this.context == {} and [_nvml_used(0), _nvml_used(1)] == used
    torch.cuda.set_device("cuda:1")             # another device: cudaSetDevice, a context there
    assert m.this.context == {uuid_of(1): m.context_bytes}
    assert [_nvml_used(0), _nvml_used(1)] == [used[0], used[1] + m.context_bytes]
    torch.cuda.set_device(torch.device("cuda", 1))   # current again: nothing more
    assert _nvml_used(1) == used[1] + m.context_bytes
    torch.cuda.set_device(0)                    # 0 is not current now: its context is made
    assert m.this.context == {uuid_of(0): m.context_bytes, uuid_of(1): m.context_bytes}


# --- 2: one MIG device per CUDA process ------------------------------------------------------

TWO_SLICES = [("3g.40gb", 40 * GiB), ("3g.40gb", 40 * GiB)]


@pytest.mark.parametrize("visible, expect", [
    (f"{mig_uuid_of(0, 0)},{mig_uuid_of(0, 1)}", mig_uuid_of(0, 0)),
    (f"{mig_uuid_of(0, 1)},{mig_uuid_of(1, 0)}", mig_uuid_of(0, 1)),   # the first named
    (None, mig_uuid_of(0, 0)),                  # two GPUs in MIG mode, nothing named
])
def test_a_cuda_process_enumerates_one_mig_device(machine, monkeypatch, visible, expect):
    """NVIDIA's MIG guide: whatever the number of MIG devices created or made visible, a CUDA
    process enumerates a single one."""
    machine([a100(0x07, 0, migs=TWO_SLICES), a100(0x41, 1, migs=TWO_SLICES)])
    if visible is not None:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert torch.cuda.device_count() == 1
    assert str(torch.cuda.get_device_properties(0).uuid) == expect.split("-", 1)[1]
    assert torch.cuda.get_device_name(0) == "NVIDIA A100-SXM4-80GB MIG 3g.40gb"
    with pytest.raises(RuntimeError, match="invalid device ordinal"):
        torch.cuda.get_device_properties(1)


# --- 3: CUDA_VISIBLE_DEVICES read as torch reads it -------------------------------------------

def _torch_sees(m: Machine) -> list[str]:
    """The devices torch's own code makes of ``CUDA_VISIBLE_DEVICES``: ``_parse_visible_devices``;
    UUIDs through ``_transform_uuid_to_ordinals`` over ``_raw_device_uuid_nvml`` (NVML's order,
    read from the fake driver library); integers cut at ``_device_count_nvml``'s count and
    mapped through CUDA's unfiltered order."""
    parsed = torch.cuda._parse_visible_devices()
    if parsed and isinstance(parsed[0], str):
        ordinals = torch.cuda._transform_uuid_to_ordinals(parsed,
                                                          torch.cuda._raw_device_uuid_nvml())
        return [m.gpus[i].uuid for i in ordinals]
    order = enumerate_devices(m, env={})
    return [order[i].uuid for i in parsed[:max(0, torch.cuda._device_count_nvml())]]


# CUDA's order on this machine: A100 #1, A100 #2, T4 #0; NVML's (PCI): T4, A100 #1, A100 #2.
VISIBLE_CASES = [
    ("1gpu2,2ampere", 2),                       # strtoul: "1,2" (torch's comment)
    ("0,2,-1,1", 2),                            # a negative entry ends the list (CUDA's doc)
    ("2,1", 2), (" 1, 0", 2), ("+1", 1),
    ("0,0", 0), ("", 0), ("0,3,1", 1),          # a repeat empties it; 3 is past the devices
    (f"1,{uuid_of(0)}", 1),                     # integers first: the UUID ends the list
    (f"{uuid_of(0)},1", 1),                     # a UUID first: the integer ends it
    (f"{uuid_of(2)[:32]},{uuid_of(0)[:32]}", 2),
    (f"{uuid_of(1)}, {uuid_of(2)}", 1),         # UUID entries are not stripped
    (f"{uuid_of(1)},{mig_uuid_of(0, 0)}", 1),   # a MIG- entry ends a GPU- list
    (uuid_of(1)[:12], 0),                       # an ambiguous prefix ends it
    (f"{uuid_of(1)},{uuid_of(1)[:32]}", 0),     # two names of one GPU empty it
    (f"{uuid_of(1)},{uuid_of(1)}", 0),
    (f"{uuid_of(2)},GPU-ffff,{uuid_of(0)}", 1),
]


@pytest.mark.parametrize("visible, count", VISIBLE_CASES)
def test_cuda_visible_devices_follows_torchs_parser(machine, monkeypatch, visible, count):
    m = machine([t4(0x07, 0), a100(0x41, 1), a100(0x81, 2)])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    seen = [t.uuid for t in enumerate_devices(m)]
    assert seen == _torch_sees(m) and len(seen) == count == torch.cuda.device_count()


@pytest.mark.parametrize("visible", [v for v, _count in VISIBLE_CASES] + [
    "01,1", "-0,1", "1,-1,2", ",1,2", f" {uuid_of(0)},{uuid_of(1)}",
    f"{mig_uuid_of(0, 0)},{mig_uuid_of(0, 1)}", f"{mig_uuid_of(0, 0)},{uuid_of(0)}",
    f"{mig_uuid_of(0, 0)},{mig_uuid_of(0, 0)}"])
def test_the_projects_reading_of_cuda_visible_devices_is_torchs(monkeypatch, visible):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert visible_entries(visible) == [str(e) for e in torch.cuda._parse_visible_devices()]
    assert visible_entries(None) is None


@pytest.mark.parametrize("visible", ["0,0", ",1,2", f" {uuid_of(0)},{uuid_of(1)}"])
def test_a_list_that_shows_no_device_is_not_pinned_to_one(machine, monkeypatch, visible):
    """``hf-memkit train`` pins a list to its first entry; a list CUDA reads as no device at
    all (a repeat, an empty first entry, a leading space before a UUID) stays as it is."""
    from hf_memkit._device.probe import pin_one_device

    machine([a100(0x07, 0), a100(0x41, 1)])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert torch.cuda._parse_visible_devices() == [] and torch.cuda.device_count() == 0
    assert pin_one_device() is None
    assert torch.cuda.device_count() == 0


# --- 4: a refused graphics list keeps the compute list -----------------------------------------

GRAPHICS, COMPUTE = ("nvmlDeviceGetGraphicsRunningProcesses_v3",
                     "nvmlDeviceGetComputeRunningProcesses_v3")


def _tenants(m: Machine) -> None:
    m.cuda.allocate(6 * GiB)                    # this process: its context and 6 GiB
    m.spawn(901, uuid_of(0), 10 * GiB)          # a compute tenant
    m.spawn(902, uuid_of(0), 300 * MiB, kind="graphics")


def test_a_refused_graphics_list_keeps_this_process_in_own_memory(machine):
    """The real pynvml raises ``NVMLError_NotSupported`` for the graphics list on some GPUs and
    containers; the compute list still names this process's context."""
    m = machine([a100(0x07, 0)])
    _tenants(m)
    m.nvml_errors[GRAPHICS] = pynvml.NVML_ERROR_NOT_SUPPORTED
    dev = mk.probe_device(0)
    assert dev.own_memory == m.context_bytes + 6 * GiB == m.this.held(uuid_of(0))
    assert dev.others_memory == 10 * GiB        # the graphics tenant is not listed
    pynvml.nvmlInit()
    try:
        handle = nvml_handle(pynvml, 0)
        assert processes(pynvml, handle, raises=True) == {m.this.pid: m.this.held(uuid_of(0)),
                                                          901: 10 * GiB}
        del m.nvml_errors[GRAPHICS]
        m.nvml_errors[COMPUTE] = pynvml.NVML_ERROR_NO_PERMISSION
        assert processes(pynvml, handle) == {902: 300 * MiB}    # and the other way round
        m.nvml_errors[GRAPHICS] = pynvml.NVML_ERROR_NOT_SUPPORTED
        assert processes(pynvml, handle) is None                 # both refused: nothing
        with pytest.raises(pynvml.NVMLError_NoPermission):
            processes(pynvml, handle, raises=True)
    finally:
        pynvml.nvmlShutdown()


# --- 5: no NVML library: calibration's own error, not pynvml's ----------------------------------

@pytest.mark.parametrize("how", ["no library file", "init returns LIBRARY_NOT_FOUND"])
def test_calibration_without_the_nvml_library_says_so(machine, monkeypatch, how):
    m = machine([a100(0x07, 0)])
    if how == "no library file":
        remove_nvml_library(monkeypatch)        # dlopen fails: pynvml raises LibraryNotFound
    else:
        m.nvml_errors["nvmlInitWithFlags"] = pynvml.NVML_ERROR_LIBRARY_NOT_FOUND
    monkeypatch.setattr(measure_mod, "_open_context",
                        lambda device: pytest.fail("CUDA was touched before NVML started"))
    with pytest.raises(HfMemkitError, match=r"NVML did not start \(NVMLError_LibraryNotFound: "
                                            r".*libnvidia-ml\.so\.1 is missing.*nvidia-smi"):
        measure_calibration(0)
    assert m.this.context == {}
