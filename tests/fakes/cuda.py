"""``torch.cuda`` as a CUDA build of torch answers it, over a ``tests.fakes.machine.Machine``.

``install_cuda(machine, monkeypatch)`` replaces the ``torch.cuda`` functions CUDA-only code
calls. The rules (see ``tests.fakes.machine``): CUDA's device order (FASTEST_FIRST unless
``CUDA_DEVICE_ORDER=PCI_BUS_ID``), ``CUDA_VISIBLE_DEVICES`` parsed as torch's
``_parse_visible_devices`` parses it (the first entry's kind, integer or ``GPU-``/``MIG-``,
is the list's kind; integers index CUDA's order, UUIDs may be unique prefixes; the first entry
of another kind, invalid or negative, ends the list; a repeat empties it), a MIG GPU seen as
its first instance unless one is named and one MIG device per process at most,
``get_device_properties`` without a context, ``mem_get_info`` / ``synchronize`` / allocations
creating one on that device that NVML then counts, and ``set_device`` creating one only when
the device is not already current (``c10::cuda::SetDevice`` skips ``cudaSetDevice`` then). A torch build
whose device properties lack fields (``install_cuda(..., missing_properties=("uuid",))``) is
answered without those attributes, as ``getattr(props, "uuid", None)`` then sees. Per-process
state (current device, the allocator's counters) belongs to ``machine.this``, so
``machine.become(rank)`` switches ranks.
"""

from __future__ import annotations

import os
import re
import types

import torch

from .machine import Gpu, Machine, Mig


def _strtoul(s: str) -> int:
    """torch's ``_strtoul``: the integer ``s`` starts with (a sign allowed), else -1."""
    m = re.match(r"[+-]?\d+", s)
    return int(m.group()) if m else -1


def _visible_entries(var: str) -> list[str] | list[int]:
    """``CUDA_VISIBLE_DEVICES`` split as torch's ``_parse_visible_devices`` splits it: the first
    entry's kind (``GPU-``, ``MIG-`` or an integer) is the list's kind and the first entry of
    another kind (or a negative/non-numeric one) ends it; a repeated entry empties it. UUID
    entries are kept as written (no strip); integers are read like ``strtoul`` (``1gpu`` is 1)."""
    entries: list = []
    prefix = next((p for p in ("GPU-", "MIG-") if var.startswith(p)), None)
    for elem in var.split(","):
        value = elem if prefix else _strtoul(elem.strip())
        if value in entries:
            return []
        if (prefix and not elem.startswith(prefix)) or (not prefix and value < 0):
            break
        entries.append(value)
    return entries


def _by_prefix(candidate: str, targets: list[Gpu | Mig]) -> Gpu | Mig | None:
    found = [t for t in targets if t.uuid.startswith(candidate)]
    return found[0] if len(found) == 1 else None


def _resolve(machine: Machine, ordered: list[Gpu | Mig], entry: str | int) -> Gpu | Mig | None:
    """The device an entry names: an integer indexes CUDA's order; a UUID (prefix) names a
    GPU (a GPU in MIG mode: its first instance) or a MIG instance."""
    if isinstance(entry, int):
        return ordered[entry] if entry < len(ordered) else None
    pool = machine.gpus if entry.startswith("GPU-") else [m for g in machine.gpus for m in g.migs]
    t = _by_prefix(entry, pool)
    return t.migs[0] if isinstance(t, Gpu) and t.migs else t


def _one_mig(devices: list[Gpu | Mig]) -> list[Gpu | Mig]:
    """A CUDA process enumerates one MIG device at most (the first it reaches): CUDA cannot use
    more than one MIG instance per process, however many are created or named."""
    migs = [d for d in devices if isinstance(d, Mig)]
    return [d for d in devices if not isinstance(d, Mig) or d is migs[0]]


def enumerate_devices(machine: Machine, env: dict[str, str] | None = None) -> list[Gpu | Mig]:
    """The CUDA devices this process sees, in CUDA's order."""
    env = os.environ if env is None else env
    gpus = list(machine.gpus)
    if env.get("CUDA_DEVICE_ORDER", "FASTEST_FIRST") != "PCI_BUS_ID":
        gpus.sort(key=lambda g: (g.cc, g.sm_count), reverse=True)   # stable: PCI order in ties
    ordered = [g.migs[0] if g.migs else g for g in gpus]
    var = env.get("CUDA_VISIBLE_DEVICES")
    if var is None:
        return _one_mig(ordered)
    seen: list[Gpu | Mig] = []
    for entry in _visible_entries(var):
        t = _resolve(machine, ordered, entry)
        if t is None:        # unknown, ambiguous or past the last device: the list ends
            break
        if t in seen:        # two entries naming one device (two prefixes of one UUID)
            return []
        seen.append(t)
    return _one_mig(seen)


class UUID:
    """What ``props.uuid`` is: ``str()`` gives the hex form without ``GPU-``/``MIG-``."""

    def __init__(self, uuid: str):
        self._text = uuid.split("-", 1)[1]

    def __str__(self) -> str:
        return self._text


class FakeCuda:
    def __init__(self, machine: Machine, missing_properties: tuple[str, ...] = ()):
        self.machine = machine
        self.initialized = False
        self.missing_properties = set(missing_properties)

    def devices(self) -> list[Gpu | Mig]:
        return enumerate_devices(self.machine)

    def target(self, device=None) -> Gpu | Mig:
        index = self.index(device)
        devs = self.devices()
        if not 0 <= index < len(devs):
            raise RuntimeError("CUDA error: invalid device ordinal")
        return devs[index]

    def index(self, device=None) -> int:
        if device is None:
            return self.machine.this.current_device
        if isinstance(device, torch.device):
            return self.machine.this.current_device if device.index is None else device.index
        if isinstance(device, str):
            return self.index(torch.device(device))
        return int(device)

    # --- torch.cuda ---------------------------------------------------------------------------

    def is_available(self) -> bool:
        return bool(self.devices())

    def device_count(self) -> int:
        return len(self.devices())

    def is_initialized(self) -> bool:
        return self.initialized

    def init(self) -> None:
        self.initialized = True

    def current_device(self) -> int:
        self.initialized = True
        return self.machine.this.current_device

    def set_device(self, device) -> None:
        """``torch.cuda.set_device``: a negative index does nothing; else CUDA is initialised
        and ``c10::cuda::SetDevice(index, force=false)`` calls ``cudaSetDevice`` (which makes
        the device's primary context under CUDA 12) only when ``index`` is not current."""
        index = self.index(device)
        if index < 0:
            return
        self.initialized = True
        if index == self.machine.this.current_device:
            return
        self.target(index)                                   # an invalid ordinal raises
        self.machine.this.current_device = index
        self.machine.open_context(self.target().uuid)

    def get_device_properties(self, device=None):
        self.initialized = True
        t = self.target(device)
        g = t.parent if isinstance(t, Mig) else t
        props = dict(
            name=t.name, major=g.cc[0], minor=g.cc[1],
            total_memory=t.total - self.machine.reserved_of(t),
            multi_processor_count=g.sm_count if isinstance(t, Gpu) else g.sm_count // 7,
            uuid=UUID(t.uuid), pci_bus_id=g.pci_bus, pci_device_id=0, pci_domain_id=0,
            is_integrated=0, is_multi_gpu_board=0, L2_cache_size=40 * 2**20)
        return types.SimpleNamespace(**{k: v for k, v in props.items()
                                        if k not in self.missing_properties})

    def get_device_name(self, device=None) -> str:
        return self.get_device_properties(device).name

    def get_device_capability(self, device=None) -> tuple[int, int]:
        p = self.get_device_properties(device)
        return p.major, p.minor

    def mem_get_info(self, device=None) -> tuple[int, int]:
        self.initialized = True
        t = self.target(device)
        self.machine.open_context(t.uuid)                # cudaMemGetInfo needs a context
        return self.machine.free(t), t.total - self.machine.reserved_of(t)

    def _stat(self, table: str, device) -> int:
        return int(getattr(self.machine.this, table).get(self.target(device).uuid, 0))

    def memory_allocated(self, device=None) -> int:
        return self._stat("allocated", device)

    def memory_reserved(self, device=None) -> int:
        return self._stat("reserved", device)

    def max_memory_allocated(self, device=None) -> int:
        return self._stat("peak_allocated", device)

    def max_memory_reserved(self, device=None) -> int:
        return self._stat("peak_reserved", device)

    def reset_peak_memory_stats(self, device=None) -> None:
        p, u = self.machine.this, self.target(device).uuid
        p.peak_allocated[u] = p.allocated.get(u, 0)
        p.peak_reserved[u] = p.reserved.get(u, 0)

    def memory_stats(self, device=None) -> dict[str, int]:
        a, r = self.memory_allocated(device), self.memory_reserved(device)
        pa, pr = self.max_memory_allocated(device), self.max_memory_reserved(device)
        return {"allocated_bytes.all.current": a, "allocated_bytes.all.peak": pa,
                "active_bytes.all.current": a, "active_bytes.all.peak": pa,
                "reserved_bytes.all.current": r, "reserved_bytes.all.peak": pr,
                "num_alloc_retries": 0, "num_ooms": 0} if self.initialized else {}

    def empty_cache(self) -> None:
        p = self.machine.this
        for u, a in p.allocated.items():
            p.reserved[u] = -(-a // (2 * 2**20)) * 2 * 2**20

    def synchronize(self, device=None) -> None:
        self.initialized = True
        self.machine.open_context(self.target(device).uuid)   # cudaDeviceSynchronize needs one

    # --- what tests do to it -----------------------------------------------------------------

    def allocate(self, nbytes: int, device=None) -> None:
        """This process allocates ``nbytes`` on ``device`` (as a tensor would)."""
        self.initialized = True
        self.machine.allocate(self.target(device).uuid, nbytes)

    def release(self, nbytes: int, device=None) -> None:
        """This process frees ``nbytes`` of tensors; the allocator keeps the blocks reserved."""
        self.machine.release(self.target(device).uuid, nbytes)


PATCHED = ("is_available", "device_count", "is_initialized", "init", "current_device",
           "set_device", "get_device_properties", "get_device_name", "get_device_capability",
           "mem_get_info", "memory_allocated", "memory_reserved", "max_memory_allocated",
           "max_memory_reserved", "reset_peak_memory_stats", "memory_stats", "empty_cache",
           "synchronize")


def install_cuda(machine: Machine, monkeypatch, *,
                 missing_properties: tuple[str, ...] = ()) -> FakeCuda:
    """Replace those ``torch.cuda`` (and ``torch.cuda.memory``) functions; ``torch.version.cuda``
    reads ``machine.cuda_version``. ``missing_properties``: fields this torch build's
    ``get_device_properties`` does not have (e.g. ``"uuid"``)."""
    fake = FakeCuda(machine, missing_properties)
    for name in PATCHED:
        monkeypatch.setattr(torch.cuda, name, getattr(fake, name))
        if hasattr(torch.cuda.memory, name):
            monkeypatch.setattr(torch.cuda.memory, name, getattr(fake, name))
    monkeypatch.setattr(torch.version, "cuda", machine.cuda_version)
    return fake
