"""A GPU machine as the real APIs see it: physical GPUs in PCI order, MIG instances, and the
processes that hold memory on them.

Nothing here is shaped by hf_memkit. Two views read one ``Machine``, each with its API's rules:
``tests.fakes.nvml`` (nvidia-ml-py's real module over a fake C library) and
``tests.fakes.cuda`` (``torch.cuda`` as a CUDA build of torch answers). The rules they follow:

- NVML numbers GPUs in PCI bus order and ignores ``CUDA_VISIBLE_DEVICES``.
- CUDA numbers them FASTEST_FIRST unless ``CUDA_DEVICE_ORDER=PCI_BUS_ID``; the integers in
  ``CUDA_VISIBLE_DEVICES`` index CUDA's order; ``GPU-``/``MIG-`` entries may be unique UUID
  prefixes; the first entry's kind (integer, ``GPU-``, ``MIG-``) is the list's, and the first
  entry of another kind, or invalid, ends the list; a repeated one empties it (torch's
  ``_parse_visible_devices`` / ``_transform_uuid_to_ordinals``).
- A CUDA process enumerates one MIG device at most (the first it reaches), however many MIG
  instances exist or ``CUDA_VISIBLE_DEVICES`` names (NVIDIA's MIG user guide).
- A CUDA context is created on a device by the first call that needs one (``mem_get_info``,
  any allocation, ``set_device`` to a device that is not already current under CUDA 12), not
  by ``get_device_properties`` nor ``set_device`` to the current device; NVML then counts it
  in the device's ``used``.
- NVML v1 ``used`` = total - free, the driver's own reservation included; v2 reports that
  reservation apart. CUDA's ``totalGlobalMem`` leaves the reservation out.
- On a GPU in MIG mode, the parent's memory info and process list need root
  (``NVML_ERROR_NO_PERMISSION``); each MIG instance's own handle answers for its slice;
  utilisation is ``NOT_SUPPORTED``.
- A process list names each process once per device it holds memory on, with its host pid and
  bytes; on a GPU under Windows' WDDM driver model every ``usedGpuMemory`` is
  ``NVML_VALUE_NOT_AVAILABLE`` (Windows' kernel driver manages the memory, not NVIDIA's).
- The driver's library is one per process: nvidia-ml-py and a direct
  ``ctypes.CDLL("libnvidia-ml.so.1")`` reach the same one, and an older driver's library lacks
  newer symbols (``Machine.nvml_absent``), so a caller falls back to an older version of a call.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from hf_memkit._units import MiB

CONTEXT = 420 * MiB          # what a CUDA context costs on a device (0.3-0.5 GiB in practice)
BLOCK = 2 * MiB              # the caching allocator's smallest segment of the large pool


@dataclass
class Mig:
    """One MIG instance (a GPU instance with one compute instance)."""

    profile: str                      # e.g. "3g.40gb"
    total: int                        # bytes of the slice
    uuid: str                         # "MIG-<hex>", as nvidia-smi -L prints it
    reserved: int = 0                 # the driver's reservation inside the slice
    parent: Gpu | None = field(default=None, repr=False, compare=False)

    @property
    def name(self) -> str:            # what CUDA's cudaDeviceProp.name says for a MIG device
        return f"{self.parent.name} MIG {self.profile}"


@dataclass
class Gpu:
    """One physical GPU. ``uuid`` is NVML's form, ``GPU-<hex>``."""

    name: str
    total: int
    cc: tuple[int, int]
    uuid: str
    pci_bus: int
    sm_count: int = 108
    reserved: int = 512 * MiB         # the driver's own reservation (NVML v2 `reserved`)
    migs: list[Mig] = field(default_factory=list)   # non-empty: MIG mode is on
    mig_capable: bool = False
    wddm: bool = False                # Windows, WDDM driver model: no per-process bytes

    def __post_init__(self):
        for m in self.migs:
            m.parent = self
        self.mig_capable = self.mig_capable or bool(self.migs)

    @property
    def pci_bus_id(self) -> str:       # NVML's busId form
        return f"00000000:{self.pci_bus:02X}:00.0"


@dataclass
class Process:
    """One process: what it holds on each device (by the device's UUID) and its CUDA state."""

    pid: int
    kind: str = "compute"                             # or "graphics"
    context: dict[str, int] = field(default_factory=dict)
    reserved: dict[str, int] = field(default_factory=dict)
    allocated: dict[str, int] = field(default_factory=dict)
    peak_allocated: dict[str, int] = field(default_factory=dict)
    peak_reserved: dict[str, int] = field(default_factory=dict)
    current_device: int = 0

    def held(self, uuid: str) -> int:
        return self.context.get(uuid, 0) + self.reserved.get(uuid, 0)


class Machine:
    """GPUs in PCI order and the processes on them; ``this`` is the process under test."""

    def __init__(self, gpus: list[Gpu], *, root: bool = False, driver: str = "550.54.15",
                 cuda: str = "12.4", context: int = CONTEXT):
        self.gpus = sorted(gpus, key=lambda g: g.pci_bus)
        self.root, self.driver, self.cuda_version, self.context_bytes = root, driver, cuda, context
        self.this = Process(os.getpid())
        self.processes: list[Process] = [self.this]
        self.nvml_errors: dict[str, int] = {}   # C function name -> nvmlReturn_t it fails with
        self.nvml_absent: set[str] = set()     # C functions the driver's library lacks (older)
        self.calls: list[str] = []             # NVML C functions called, in order

    # --- what is where ----------------------------------------------------------------------

    def targets(self) -> list[Gpu | Mig]:
        return [*self.gpus, *(m for g in self.gpus for m in g.migs)]

    def target(self, uuid: str) -> Gpu | Mig:
        for t in self.targets():
            if t.uuid == uuid:
                return t
        raise KeyError(uuid)

    def used_by_processes(self, t: Gpu | Mig) -> int:
        uuids = [t.uuid] + ([m.uuid for m in t.migs] if isinstance(t, Gpu) else [])
        return sum(p.held(u) for p in self.processes for u in uuids)

    def reserved_of(self, t: Gpu | Mig) -> int:
        if isinstance(t, Gpu):
            return t.reserved + sum(m.reserved for m in t.migs)
        return t.reserved

    def free(self, t: Gpu | Mig) -> int:
        return t.total - self.reserved_of(t) - self.used_by_processes(t)

    # --- processes --------------------------------------------------------------------------

    def spawn(self, pid: int, uuid: str, held: int, *, kind: str = "compute") -> Process:
        """Another process holding ``held`` bytes (its context included) on device ``uuid``."""
        p = Process(pid, kind=kind, context={uuid: min(held, self.context_bytes)},
                    reserved={uuid: max(0, held - self.context_bytes)})
        self.processes.append(p)
        return p

    def become(self, p: Process) -> None:
        """Run what follows as process ``p`` (a torchrun rank, say)."""
        if p not in self.processes:
            self.processes.append(p)
        self.this = p

    def open_context(self, uuid: str) -> None:
        self.this.context.setdefault(uuid, self.context_bytes)

    def allocate(self, uuid: str, nbytes: int) -> None:
        """This process allocates ``nbytes`` through the caching allocator (a context first)."""
        p = self.this
        self.open_context(uuid)
        p.allocated[uuid] = p.allocated.get(uuid, 0) + nbytes
        need = -(-p.allocated[uuid] // BLOCK) * BLOCK
        p.reserved[uuid] = max(p.reserved.get(uuid, 0), need)
        p.peak_allocated[uuid] = max(p.peak_allocated.get(uuid, 0), p.allocated[uuid])
        p.peak_reserved[uuid] = max(p.peak_reserved.get(uuid, 0), p.reserved[uuid])

    def release(self, uuid: str, nbytes: int) -> None:
        p = self.this
        p.allocated[uuid] = max(0, p.allocated.get(uuid, 0) - nbytes)


def uuid_of(index: int, stem: str = "8932f937") -> str:
    """A full GPU UUID, distinct per index, with a shared 8-hex stem so prefixes are ambiguous
    until they reach the index digits."""
    return f"GPU-{stem}-d72c-4106-c12f-{index:04x}2e9b4d1a"


def mig_uuid_of(gpu: int, slot: int) -> str:
    return f"MIG-6e4b1c4a-{gpu:04x}-5{slot:03x}-9f1e-0c2a5d7b3e11"


def a100(bus: int, index: int, *, migs: list[tuple[str, int]] = ()) -> Gpu:
    """An A100-SXM4-80GB at PCI bus ``bus``; ``migs`` as (profile, bytes) puts it in MIG mode."""
    g = Gpu("NVIDIA A100-SXM4-80GB", 81920 * MiB, (8, 0), uuid_of(index), bus, sm_count=108,
            mig_capable=True,
            migs=[Mig(p, b, mig_uuid_of(index, k)) for k, (p, b) in enumerate(migs)])
    return g


def t4(bus: int, index: int) -> Gpu:
    return Gpu("Tesla T4", 15360 * MiB, (7, 5), uuid_of(index), bus, sm_count=40,
               reserved=256 * MiB)


def h100(bus: int, index: int) -> Gpu:
    return Gpu("NVIDIA H100 80GB HBM3", 81559 * MiB, (9, 0), uuid_of(index), bus, sm_count=132,
               mig_capable=True)
