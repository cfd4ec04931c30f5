"""A machine with several GPUs, as CUDA and NVML each see it, for the NVML tests of
bench/gpu_truth.py (tests/unit/bench/test_gpu_truth.py). What a CPU machine cannot have, faked by
the real rules:

  * NVML numbers the cards in PCI order; CUDA fastest first (``cuda_order``), and
    ``CUDA_VISIBLE_DEVICES`` entries are CUDA indices or unique UUID prefixes ("GPU-..."/"MIG-...");
  * ``torch.cuda.get_device_properties(i).uuid`` prints the UUID without NVML's prefix;
  * NVML's ``GetHandleByUUID`` takes only the whole "GPU-<uuid>" / "MIG-<uuid>", and
    ``GetHandleByPciBusId`` a "domain:bus:device.function" address (hexadecimal);
  * process listings may answer NVML_ERROR_NOT_SUPPORTED (3) or NO_PERMISSION (4).

Both NVML front ends are here: a ``pynvml`` module and a ``libnvidia-ml.so.1`` for ctypes.
"""

from __future__ import annotations

import ctypes
import os
import types
from dataclasses import dataclass, field

NOT_FOUND, NOT_SUPPORTED, NO_PERMISSION, INSUFFICIENT_SIZE = 6, 3, 4, 7
NOT_AVAILABLE = 2**64 - 1


@dataclass
class Card:
    name: str
    uuid: str  # as torch prints it: no "GPU-" / "MIG-"
    bus: int
    used: int
    kind: str = "GPU"  # "MIG" for a MIG instance
    compute: list[tuple[int, int]] = field(default_factory=list)  # (pid, used bytes)
    graphics: list[tuple[int, int]] | int = field(default_factory=list)  # or an NVML error

    @property
    def nvml_uuid(self) -> str:
        return f"{self.kind}-{self.uuid}"

    @property
    def pci(self) -> tuple[int, int, int]:
        return (0, self.bus, 0)


class Machine:
    def __init__(self, cards: list[Card], cuda_order: list[int], torch_uuids: bool = True):
        self.cards = cards  # NVML's order: PCI
        self.cuda_order = cuda_order  # CUDA's: indices into cards, fastest first
        self.torch_uuids = torch_uuids  # False: torch reports no UUID (PCI address only)

    # ------------------------------------------------------------------ CUDA
    def visible(self) -> list[Card]:
        physical = [self.cards[i] for i in self.cuda_order]
        env = os.environ.get("CUDA_VISIBLE_DEVICES")
        if env is None:
            return physical
        out = []
        for entry in (e.strip() for e in env.split(",")):
            if entry.isdigit():
                found = [physical[int(entry)]] if int(entry) < len(physical) else []
            else:  # a unique prefix of the full UUID
                found = [c for c in physical if c.nvml_uuid.startswith(entry)]
            if len(found) != 1:
                break  # CUDA stops at the first invalid entry
            out.append(found[0])
        return out

    def get_device_properties(self, i: int) -> types.SimpleNamespace:
        c = self.visible()[i]
        return types.SimpleNamespace(name=c.name, uuid=c.uuid if self.torch_uuids else "",
                                     pci_domain_id=0, pci_bus_id=c.bus, pci_device_id=0,
                                     total_memory=80 * 2**30)

    # ------------------------------------------------------------------ NVML
    def by_uuid(self, uuid: str) -> int | None:
        return next((i for i, c in enumerate(self.cards) if c.nvml_uuid == uuid), None)

    def by_pci(self, bus_id: str) -> int | None:
        dom, bus, rest = bus_id.split(":")
        dev, _fn = rest.split(".")
        key = (int(dom, 16), int(bus, 16), int(dev, 16))
        return next((i for i, c in enumerate(self.cards) if c.pci == key), None)

    def procs(self, i: int, kind: str) -> list[tuple[int, int]] | int:
        return getattr(self.cards[i], kind)


class NVMLError(Exception):
    def __init__(self, value: int):
        super().__init__(f"NVML error {value}")
        self.value = value


def fake_pynvml(m: Machine) -> types.ModuleType:
    """nvidia-ml-py's calls over ``m``; handles are NVML indices."""
    mod = types.ModuleType("pynvml")
    mod.NVMLError = NVMLError
    mod.calls = []

    def found(i):
        if i is None:
            raise NVMLError(NOT_FOUND)
        return i

    def running(kind):
        def listing(h):
            p = m.procs(h, kind)
            if isinstance(p, int):
                raise NVMLError(p)
            return [types.SimpleNamespace(pid=pid, usedGpuMemory=None if used == NOT_AVAILABLE
                                          else used) for pid, used in p]
        return listing

    funcs = {
        "nvmlInit": lambda: mod.calls.append("init"),
        "nvmlShutdown": lambda: mod.calls.append("shutdown"),
        "nvmlDeviceGetHandleByIndex": lambda i: i,
        "nvmlDeviceGetHandleByUUID": lambda u: found(m.by_uuid(u)),
        "nvmlDeviceGetHandleByPciBusId": lambda b: found(m.by_pci(b)),
        "nvmlDeviceGetMemoryInfo": lambda h: types.SimpleNamespace(used=m.cards[h].used),
        "nvmlDeviceGetName": lambda h: m.cards[h].name.encode(),
        "nvmlDeviceGetUUID": lambda h: m.cards[h].nvml_uuid,
        "nvmlSystemGetDriverVersion": lambda: "570.86.15",
        "nvmlDeviceGetComputeRunningProcesses": running("compute"),
        "nvmlDeviceGetGraphicsRunningProcesses": running("graphics"),
    }
    for name, f in funcs.items():
        setattr(mod, name, f)
    return mod


class FakeNvmlLib:
    """``ctypes.CDLL("libnvidia-ml.so.1")`` over ``m``: return codes, out-parameters through
    ``byref``; a handle is its NVML index + 1 (a void pointer is never 0)."""

    def __init__(self, m: Machine, *, versions: tuple[str, ...] = ("_v3",)):
        self.m, self.calls = m, []
        for kind in ("Compute", "Graphics"):
            for v in versions:
                setattr(self, f"nvmlDeviceGet{kind}RunningProcesses{v}", self._running(kind))

    def nvmlInit_v2(self):
        return 0

    def nvmlShutdown(self):
        self.calls.append("shutdown")
        return 0

    def _handle(self, i, ref):
        if i is None:
            return NOT_FOUND
        ref._obj.value = i + 1
        return 0

    def nvmlDeviceGetHandleByUUID(self, uuid, ref):
        return self._handle(self.m.by_uuid(uuid.value.decode()), ref)

    def nvmlDeviceGetHandleByPciBusId_v2(self, bus_id, ref):
        return self._handle(self.m.by_pci(bus_id.value.decode()), ref)

    def nvmlDeviceGetMemoryInfo(self, h, ref):
        ref._obj.used = self.m.cards[h.value - 1].used
        return 0

    @staticmethod
    def _put(text, buf, size):
        buf.value = text.encode()[: size.value - 1]
        return 0

    def nvmlDeviceGetName(self, h, buf, size):
        return self._put(self.m.cards[h.value - 1].name, buf, size)

    def nvmlDeviceGetUUID(self, h, buf, size):
        return self._put(self.m.cards[h.value - 1].nvml_uuid, buf, size)

    def nvmlSystemGetDriverVersion(self, buf, size):
        return self._put("570.86.15", buf, size)

    def _running(self, kind):
        def call(h, count_ref, infos):
            p = self.m.procs(h.value - 1, kind.lower())
            if isinstance(p, int):
                return p
            count = count_ref._obj
            if infos is None:
                count.value = len(p)
                return INSUFFICIENT_SIZE if p else 0
            if count.value < len(p):
                return INSUFFICIENT_SIZE
            for i, (pid, used) in enumerate(p):
                infos[i].pid, infos[i].usedGpuMemory = pid, ctypes.c_ulonglong(used).value
            count.value = len(p)
            return 0
        return call
