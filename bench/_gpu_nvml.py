"""NVML for ``bench/gpu_truth.py``: which NVML device a CUDA device is, the memory in use on it,
the other processes on it, and the one device each measured child is pinned to.

Which card: NVML numbers GPUs in PCI order, CUDA (by default) fastest first, and the integers in
``CUDA_VISIBLE_DEVICES`` index CUDA's order, so no index of one is an index of the other. The
bridge is the UUID torch reports for the CUDA device (``torch.cuda.get_device_properties(i).uuid``,
printed without NVML's prefix): NVML's ``GetHandleByUUID`` wants the whole of it behind "GPU-"
(a GPU) or "MIG-" (a MIG instance), never a prefix of it as CUDA accepts. Where torch has no UUID
the PCI address (``pci_domain_id`` / ``pci_bus_id`` / ``pci_device_id``, as "0000:BB:DD.0") goes to
``GetHandleByPciBusId_v2``. Reading device properties creates no CUDA context
(``torch.cuda.mem_get_info`` does).

Readers: ``pynvml`` (nvidia-ml-py), else ``libnvidia-ml.so.1`` through ctypes (the same calls),
else ``torch.cuda.mem_get_info`` (readable only once CUDA is initialised: no baseline).
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable
from typing import Any

SAMPLE_INTERVAL_S = 0.005
NVML_SUCCESS, NVML_ERROR_INSUFFICIENT_SIZE = 0, 7
# errors a process listing may answer with where it is not allowed or not offered: "unknown"
TOLERATED = {3: "NVML_ERROR_NOT_SUPPORTED", 4: "NVML_ERROR_NO_PERMISSION"}
NOT_AVAILABLE = 2**64 - 1  # NVML_VALUE_NOT_AVAILABLE of usedGpuMemory (unsigned long long)
KINDS = ("compute", "graphics")


class NvmlError(RuntimeError):
    """An NVML call that returned ``rc`` (an ``nvmlReturn_t``)."""

    def __init__(self, call: str, rc: int):
        self.rc = int(rc)
        super().__init__(f"{call} failed with nvmlReturn_t {rc} "
                         f"({TOLERATED.get(self.rc, 'see nvml.h')})")


# --------------------------------------------------------------------------------------------
# CUDA device -> NVML device
# --------------------------------------------------------------------------------------------
def cuda_device_ids(index: int = 0, get_properties: Callable[[int], Any] | None = None
                    ) -> dict[str, Any]:
    """What CUDA says device ``index`` (in this process's CUDA order) is: its name, the UUID
    torch reports (no "GPU-"/"MIG-" prefix) and its PCI address "0000:BB:DD.0" (None where
    unknown)."""
    if get_properties is None:
        import torch

        get_properties = torch.cuda.get_device_properties
    p = get_properties(index)
    uuid = str(getattr(p, "uuid", "") or "").strip()
    for prefix in ("GPU-", "MIG-"):
        uuid = uuid.removeprefix(prefix)
    parts = [getattr(p, k, None) for k in ("pci_domain_id", "pci_bus_id", "pci_device_id")]
    pci = (f"{parts[0]:04x}:{parts[1]:02x}:{parts[2]:02x}.0"
           if all(isinstance(v, int) and v >= 0 for v in parts) else None)
    return {"index": index, "name": str(getattr(p, "name", "")), "uuid": uuid or None,
            "pci_bus_id": pci}


def nvml_uuids(ids: dict[str, Any]) -> list[str]:
    """The full NVML UUIDs the device may have: "MIG-<uuid>" first for a MIG instance (its
    name says "MIG"), else "GPU-<uuid>" first."""
    if not ids.get("uuid"):
        return []
    mig = " MIG " in f" {ids.get('name', '')} "
    return [p + ids["uuid"] for p in (("MIG-", "GPU-") if mig else ("GPU-", "MIG-"))]


def resolve_handle(ids: dict[str, Any], by_uuid: Callable[[str], Any],
                   by_pci: Callable[[str], Any]) -> tuple[Any, dict[str, Any]]:
    """(NVML handle, how it was found) of the CUDA device ``ids`` describes: by its full UUID,
    else by its PCI address. Never by index (NVML's index is not CUDA's)."""
    tried = []
    for uuid in nvml_uuids(ids):
        try:
            return by_uuid(uuid), {"by": "uuid", "nvml_uuid": uuid}
        except Exception as exc:
            tried.append(f"{uuid}: {exc}")
    if ids.get("pci_bus_id"):
        try:
            return by_pci(ids["pci_bus_id"]), {"by": "pci_bus_id", "pci_bus_id": ids["pci_bus_id"]}
        except Exception as exc:
            tried.append(f"{ids['pci_bus_id']}: {exc}")
    raise LookupError(f"no NVML device is CUDA device {ids.get('index')} ({ids.get('name')}); "
                      f"tried {tried or 'nothing: torch reports neither a UUID nor a PCI address'}")


def other_processes(list_processes: Callable[[str], list[tuple[int, int | None]]],
                    own_pid: int) -> dict[str, Any]:
    """NVML's compute and graphics processes on the device but ``own_pid``: pid and bytes used
    (None where NVML cannot say); ``others_used_bytes`` sums the bytes it gives. A listing NVML
    refuses (not supported, no permission) or fails is "unknown". NVML reports host pids: in a
    container this process may be listed under another pid, among the others
    (``own_pid_listed`` False)."""
    out: dict[str, Any] = {"own_pid": own_pid, "own_pid_listed": False}
    others: dict[int, int | None] = {}  # a pid in both lists counts once
    for kind in KINDS:
        try:
            procs = list_processes(kind)
        except Exception as exc:
            rc = getattr(exc, "rc", None)
            out[kind], out[f"{kind}_error"] = "unknown", TOLERATED.get(rc) or str(exc)[:200]
            continue
        out["own_pid_listed"] |= any(pid == own_pid for pid, _ in procs)
        out[kind] = [{"pid": pid, "used_gpu_memory": used} for pid, used in procs
                     if pid != own_pid]
        for pid, used in procs:
            if pid != own_pid:
                others[pid] = max((v for v in (others.get(pid), used) if v is not None),
                                  default=None)
    known = all(out[k] != "unknown" for k in KINDS)
    out["others"] = sorted(others) if known else "unknown"
    out["others_used_bytes"] = sum(v or 0 for v in others.values()) if known else "unknown"
    return out


# --------------------------------------------------------------------------------------------
# readers
# --------------------------------------------------------------------------------------------
class _NvmlMemory(ctypes.Structure):  # nvmlMemory_t (v1)
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong),
                ("used", ctypes.c_ulonglong)]


class _ProcessInfoV1(ctypes.Structure):  # nvmlProcessInfo_v1_t
    _fields_ = [("pid", ctypes.c_uint), ("usedGpuMemory", ctypes.c_ulonglong)]


class _ProcessInfoV2(ctypes.Structure):  # nvmlProcessInfo_v2_t (= _t, of the _v2 / _v3 calls)
    _fields_ = [("pid", ctypes.c_uint), ("usedGpuMemory", ctypes.c_ulonglong),
                ("gpuInstanceId", ctypes.c_uint), ("computeInstanceId", ctypes.c_uint)]


def _used(v: Any) -> int | None:
    return None if v is None or int(v) == NOT_AVAILABLE else int(v)


class _PyNvml:
    source = "pynvml"

    def __init__(self, ids: dict[str, Any]):
        import pynvml  # nvidia-ml-py

        pynvml.nvmlInit()
        self.m = pynvml
        try:
            self.h, self.mapping = resolve_handle(ids, pynvml.nvmlDeviceGetHandleByUUID,
                                                  pynvml.nvmlDeviceGetHandleByPciBusId)
        except Exception:
            pynvml.nvmlShutdown()
            raise

    @staticmethod
    def _text(v: Any) -> str:
        return v.decode() if isinstance(v, bytes) else str(v)

    def used(self) -> int | None:
        return int(self.m.nvmlDeviceGetMemoryInfo(self.h).used)

    def name(self) -> str:
        return self._text(self.m.nvmlDeviceGetName(self.h))

    def uuid(self) -> str:
        return self._text(self.m.nvmlDeviceGetUUID(self.h))

    def driver(self) -> str:
        return self._text(self.m.nvmlSystemGetDriverVersion())

    def processes(self, kind: str) -> list[tuple[int, int | None]]:
        call = f"nvmlDeviceGet{kind.title()}RunningProcesses"
        try:
            procs = getattr(self.m, call)(self.h)
        except self.m.NVMLError as exc:
            raise NvmlError(call, getattr(exc, "value", -1)) from exc
        return [(int(p.pid), _used(p.usedGpuMemory)) for p in procs]

    def close(self) -> None:
        self.m.nvmlShutdown()


def _nvml_library() -> Any:
    return ctypes.CDLL("libnvidia-ml.so.1")


class _CtypesNvml:
    """The same NVML calls straight from the driver's library (no nvidia-ml-py needed)."""

    source = "libnvidia-ml.so.1 (ctypes)"

    def __init__(self, ids: dict[str, Any], lib: Any = None):
        self.lib = lib if lib is not None else _nvml_library()
        self._ok("nvmlInit_v2", self.lib.nvmlInit_v2())
        try:
            self.h, self.mapping = resolve_handle(ids, self._by_uuid, self._by_pci)
        except Exception:
            self.lib.nvmlShutdown()
            raise

    @staticmethod
    def _ok(call: str, rc: int) -> None:
        if rc != NVML_SUCCESS:
            raise NvmlError(call, rc)

    def _handle(self, call: str, key: str) -> ctypes.c_void_p:
        h = ctypes.c_void_p()
        self._ok(call, getattr(self.lib, call)(ctypes.c_char_p(key.encode()), ctypes.byref(h)))
        return h

    def _by_uuid(self, uuid: str) -> ctypes.c_void_p:
        return self._handle("nvmlDeviceGetHandleByUUID", uuid)

    def _by_pci(self, bus_id: str) -> ctypes.c_void_p:
        return self._handle("nvmlDeviceGetHandleByPciBusId_v2", bus_id)

    def used(self) -> int | None:
        mem = _NvmlMemory()
        self._ok("nvmlDeviceGetMemoryInfo",
                 self.lib.nvmlDeviceGetMemoryInfo(self.h, ctypes.byref(mem)))
        return int(mem.used)

    def _text(self, call: str, *args: Any) -> str:
        buf = ctypes.create_string_buffer(96)
        self._ok(call, getattr(self.lib, call)(*args, buf, ctypes.c_uint(96)))
        return buf.value.decode(errors="replace")

    def name(self) -> str:
        return self._text("nvmlDeviceGetName", self.h)

    def uuid(self) -> str:
        return self._text("nvmlDeviceGetUUID", self.h)

    def driver(self) -> str:
        return self._text("nvmlSystemGetDriverVersion")

    def processes(self, kind: str) -> list[tuple[int, int | None]]:
        base = f"nvmlDeviceGet{kind.title()}RunningProcesses"
        versions = ((base + "_v3", _ProcessInfoV2), (base + "_v2", _ProcessInfoV2),
                    (base, _ProcessInfoV1))
        # the newest the driver's library has (a missing symbol: an older driver)
        found = [(c, st, getattr(self.lib, c, None)) for c, st in versions]
        call, struct, fn = next((f for f in found if f[2] is not None), (base, None, None))
        if fn is None:
            raise NvmlError(base, -1)
        count = ctypes.c_uint(0)
        rc = fn(self.h, ctypes.byref(count), None)
        if rc == NVML_SUCCESS:
            return []
        if rc != NVML_ERROR_INSUFFICIENT_SIZE:
            raise NvmlError(call, rc)
        count.value = count.value * 2 + 5  # room for processes started in between
        infos = (struct * count.value)()
        self._ok(call, fn(self.h, ctypes.byref(count), infos))
        return [(int(infos[i].pid), _used(infos[i].usedGpuMemory)) for i in range(count.value)]

    def close(self) -> None:
        self.lib.nvmlShutdown()


class _TorchMemInfo:
    """No NVML: device-wide ``total - free`` from CUDA, readable only once CUDA is initialised."""

    source = "torch.cuda.mem_get_info (no NVML: no reading before CUDA init)"
    mapping = {"by": "none (no NVML)"}

    def __init__(self, index: int):
        self.index = index

    def used(self) -> int | None:
        import torch

        # reading it would create the context it is meant to measure (device properties, read
        # to find the device, initialise torch's CUDA state but create no context)
        has_context = getattr(torch._C, "_cuda_hasPrimaryContext", None)
        if not torch.cuda.is_initialized() or (has_context is not None
                                               and not has_context(self.index)):
            return None
        free, total = torch.cuda.mem_get_info(self.index)
        return int(total - free)

    def name(self) -> None:
        return None

    def uuid(self) -> None:
        return None

    def driver(self) -> None:
        return None

    def processes(self, kind: str) -> list[tuple[int, int | None]]:
        raise RuntimeError("no NVML: the processes on the GPU are unknown")

    def close(self) -> None:
        pass


class _NoNvml(_TorchMemInfo):
    source = "none (cpu smoke)"
    mapping = {"by": "none (cpu smoke)"}

    def used(self) -> None:
        return None


def open_nvml(index: int = 0, *, smoke: bool = False,
              get_properties: Callable[[int], Any] | None = None) -> Any:
    """The best reader of memory in use on CUDA device ``index``: pynvml, ctypes NVML, else
    torch's mem_get_info; ``reader.ids`` is what CUDA says the device is, ``reader.mapping`` how
    NVML's handle was found, ``reader.failures`` why better readers were not used."""
    if smoke:
        reader: Any = _NoNvml(index)
        reader.ids, reader.failures = None, []
        return reader
    failures: list[str] = []
    try:
        ids = cuda_device_ids(index, get_properties)
    except Exception as exc:
        ids = None
        failures.append(f"torch.cuda.get_device_properties({index}): {type(exc).__name__}: {exc}")
    for cls in (_PyNvml, _CtypesNvml) if ids is not None else ():
        try:
            reader = cls(ids)
            reader.ids, reader.failures = ids, failures
            return reader
        except Exception as exc:
            failures.append(f"{cls.source}: {type(exc).__name__}: {exc}")
    reader = _TorchMemInfo(index)
    reader.ids, reader.failures = ids, failures
    return reader


def reader_processes(reader: Any, own_pid: int | None = None) -> dict[str, Any]:
    """``other_processes`` of the device ``reader`` reads (this process excluded); "unknown"
    from a reader that cannot list them."""
    listing = getattr(reader, "processes", None)
    if listing is None:
        def listing(kind: str) -> list[tuple[int, int | None]]:
            raise RuntimeError(f"{getattr(reader, 'source', reader)} lists no processes")
    return other_processes(listing, os.getpid() if own_pid is None else own_pid)


# --------------------------------------------------------------------------------------------
# parent: one device per child
# --------------------------------------------------------------------------------------------
def pin_device(index: int = 0, get_properties: Callable[[int], Any] | None = None,
               opener: Callable[..., Any] = open_nvml) -> dict[str, Any]:
    """The ``CUDA_VISIBLE_DEVICES`` value that shows a child CUDA device ``index`` (of this
    process) and nothing else: its full UUID (NVML's, where NVML finds the device; else
    "GPU-"/"MIG-" + torch's); the index's own entry only where no UUID is known."""
    ids = cuda_device_ids(index, get_properties)
    reader = opener(index, get_properties=get_properties)
    try:
        nvml_uuid = reader.uuid()
    except Exception:
        nvml_uuid = None
    finally:
        reader.close()
    from hf_memkit._device.nvml import visible_entries  # torch's reading of the variable

    visible = visible_entries(os.environ.get("CUDA_VISIBLE_DEVICES")) or []
    uuid = nvml_uuid or next(iter(nvml_uuids(ids)), None)
    if nvml_uuid:
        by = f"uuid (NVML's, of the device found by {reader.mapping['by']})"
    elif uuid:
        by = "uuid (torch's; NVML did not confirm its GPU-/MIG- prefix)"
    else:
        by = "index (no UUID known: this process's CUDA_VISIBLE_DEVICES entry)"
    value = uuid or (visible[index] if index < len(visible) else str(index))
    return {"cuda_visible_devices": value, "pinned_by": by, "uuid": uuid, "name": ids["name"],
            "pci_bus_id": ids["pci_bus_id"], "parent_index": index,
            "parent_cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "nvml_source": reader.source}


# --------------------------------------------------------------------------------------------
# sampling
# --------------------------------------------------------------------------------------------
class PeakSampler:
    """Largest value of ``read()`` seen by a thread polling every ``interval`` seconds."""

    def __init__(self, read: Callable[[], int | None], interval: float = SAMPLE_INTERVAL_S):
        self.read, self.interval = read, interval
        self.peak: int | None = None
        self.samples = self.errors = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _take(self) -> None:
        try:
            v = self.read()
        except Exception:
            self.errors += 1
            return
        self.samples += 1
        if v is not None:
            self.peak = v if self.peak is None else max(self.peak, v)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self._take()

    def start(self) -> None:
        self._take()
        self._thread = threading.Thread(target=self._loop, name="nvml-sampler", daemon=True)
        self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread is not None and not self._stop.is_set()

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._take()
        return {"peak": self.peak, "samples": self.samples, "errors": self.errors,
                "interval_s": self.interval}
