"""NVML's C library, faked under nvidia-ml-py's real ``pynvml`` module.

``install_nvml(machine, monkeypatch)`` sets ``pynvml.nvmlLib`` to ``FakeLib``: every pynvml
function then runs its real Python (argument structs, ``NVMLError`` subclasses, the
two-call process-list protocol) and reaches this library where the real one would be called.
Each C function takes the ctypes arguments pynvml passes and returns an ``nvmlReturn_t``,
following NVML's documented rules (see ``tests.fakes.machine``).
"""

from __future__ import annotations

import ctypes

import pynvml

from .machine import Gpu, Machine, Mig

S = pynvml.NVML_SUCCESS
ERROR_TEXT = {
    pynvml.NVML_ERROR_UNINITIALIZED: b"Uninitialized",
    pynvml.NVML_ERROR_INVALID_ARGUMENT: b"Invalid Argument",
    pynvml.NVML_ERROR_NOT_SUPPORTED: b"Not Supported",
    pynvml.NVML_ERROR_NO_PERMISSION: b"Insufficient Permissions",
    pynvml.NVML_ERROR_NOT_FOUND: b"Not Found",
    pynvml.NVML_ERROR_INSUFFICIENT_SIZE: b"Insufficient Size",
    pynvml.NVML_ERROR_LIBRARY_NOT_FOUND: b"NVML Shared Library Not Found",
    pynvml.NVML_ERROR_UNKNOWN: b"Unknown Error",
}
NOT_IN_MIG = 0xFFFFFFFF       # gpuInstanceId / computeInstanceId of a process outside MIG


class _Fn:
    """A C function: callable, and takes attributes (pynvml sets ``restype`` on some)."""

    def __init__(self, lib: FakeLib, name: str, impl):
        self.lib, self.name, self.impl, self.restype = lib, name, impl, None

    def __call__(self, *args):
        m = self.lib.machine
        m.calls.append(self.name)
        if self.name in m.nvml_errors:
            return m.nvml_errors[self.name]
        if self.name not in ("nvmlInitWithFlags", "nvmlErrorString") and self.lib.refcount == 0:
            return pynvml.NVML_ERROR_UNINITIALIZED
        return self.impl(*args)


def _obj(ref):
    """The object behind ``byref(x)`` (or ``x`` itself)."""
    return getattr(ref, "_obj", ref)


def _address(handle) -> int:
    if isinstance(handle, int):
        return handle
    if isinstance(handle, ctypes.c_void_p):
        return handle.value or 0
    return ctypes.cast(handle, ctypes.c_void_p).value or 0


def _write_handle(ref, value: int) -> None:
    ptr = _obj(ref)
    ctypes.cast(ctypes.pointer(ptr), ctypes.POINTER(ctypes.c_void_p))[0] = value


def _text(arg) -> str:
    raw = arg.value if hasattr(arg, "value") else arg
    return raw.decode() if isinstance(raw, bytes) else str(raw)


class FakeLib:
    """``libnvidia-ml.so.1`` over ``machine``. Handles are addresses 0x1000 + n."""

    def __init__(self, machine: Machine):
        self.machine, self.refcount = machine, 0
        self._handles = {0x1000 + i: t for i, t in enumerate(machine.targets())}

    def __getattr__(self, name: str):
        impl = getattr(type(self), "_" + name, None)
        if impl is None:
            raise AttributeError(name)   # pynvml turns this into NVMLError_FunctionNotFound
        fn = _Fn(self, name, impl.__get__(self))
        self.__dict__[name] = fn
        return fn

    def _id(self, t: Gpu | Mig) -> int:
        return next(k for k, v in self._handles.items() if v is t)

    def _target(self, handle) -> Gpu | Mig | None:
        return self._handles.get(_address(handle))

    def _give(self, ref, t: Gpu | Mig | None) -> int:
        if t is None:
            return pynvml.NVML_ERROR_NOT_FOUND
        _write_handle(ref, self._id(t))
        return S

    # --- the library ------------------------------------------------------------------------

    def _nvmlInitWithFlags(self, flags):
        self.refcount += 1
        return S

    def _nvmlShutdown(self):
        self.refcount = max(0, self.refcount - 1)
        return S

    def _nvmlErrorString(self, code):
        return ERROR_TEXT.get(code, b"Unknown Error")

    def _nvmlSystemGetDriverVersion(self, buf, size):
        buf.value = self.machine.driver.encode()
        return S

    def _nvmlDeviceGetCount_v2(self, ref):
        _obj(ref).value = len(self.machine.gpus)
        return S

    def _nvmlDeviceGetHandleByIndex_v2(self, index, ref):
        i = _obj(index).value if hasattr(index, "value") else int(index)
        if not 0 <= i < len(self.machine.gpus):
            return pynvml.NVML_ERROR_INVALID_ARGUMENT
        return self._give(ref, self.machine.gpus[i])

    def _nvmlDeviceGetHandleByUUID(self, uuid, ref):
        text = _text(uuid)   # NVML matches the full UUID only, never a prefix
        return self._give(ref, next((t for t in self.machine.targets() if t.uuid == text), None))

    def _nvmlDeviceGetHandleByPciBusId_v2(self, bus_id, ref):
        text = _text(bus_id).upper()
        found = next((g for g in self.machine.gpus
                      if g.pci_bus_id.endswith(text.split(":", 1)[-1]) and
                      int(text.split(":")[-2], 16) == g.pci_bus), None)
        return self._give(ref, found)

    def _nvmlDeviceGetName(self, handle, buf, size):
        t = self._target(handle)
        if t is None:
            return pynvml.NVML_ERROR_INVALID_ARGUMENT
        buf.value = t.name.encode()
        return S

    def _nvmlDeviceGetUUID(self, handle, buf, size):
        t = self._target(handle)
        if t is None:
            return pynvml.NVML_ERROR_INVALID_ARGUMENT
        buf.value = t.uuid.encode()
        return S

    def _nvmlDeviceGetPciInfo_v3(self, handle, ref):
        t = self._target(handle)
        g = t.parent if isinstance(t, Mig) else t
        if g is None:
            return pynvml.NVML_ERROR_INVALID_ARGUMENT
        info = _obj(ref)
        info.busId = g.pci_bus_id.encode()
        info.domain, info.bus, info.device = 0, g.pci_bus, 0
        return S

    def _nvmlDeviceGetCudaComputeCapability(self, handle, major, minor):
        t = self._target(handle)
        g = t.parent if isinstance(t, Mig) else t
        _obj(major).value, _obj(minor).value = g.cc
        return S

    def _memory(self, handle) -> tuple[int, Gpu | Mig | None]:
        t = self._target(handle)
        if t is None:
            return pynvml.NVML_ERROR_INVALID_ARGUMENT, None
        if isinstance(t, Gpu) and t.migs and not self.machine.root:
            return pynvml.NVML_ERROR_NO_PERMISSION, None
        return S, t

    def _nvmlDeviceGetMemoryInfo(self, handle, ref):
        rc, t = self._memory(handle)
        if rc != S:
            return rc
        mem, free = _obj(ref), self.machine.free(t)
        mem.total, mem.free, mem.used = t.total, free, t.total - free   # v1: reserve in `used`
        return S

    def _nvmlDeviceGetMemoryInfo_v2(self, handle, ref):
        rc, t = self._memory(handle)
        if rc != S:
            return rc
        mem, m = _obj(ref), self.machine
        mem.total, mem.reserved, mem.free = t.total, m.reserved_of(t), m.free(t)
        mem.used = m.used_by_processes(t)
        return S

    def _nvmlDeviceGetMigMode(self, handle, current, pending):
        t = self._target(handle)
        if isinstance(t, Mig) or t is None:
            return pynvml.NVML_ERROR_INVALID_ARGUMENT
        if not t.mig_capable:
            return pynvml.NVML_ERROR_NOT_SUPPORTED
        _obj(current).value = _obj(pending).value = 1 if t.migs else 0
        return S

    def _nvmlDeviceIsMigDeviceHandle(self, handle, ref):
        _obj(ref).value = 1 if isinstance(self._target(handle), Mig) else 0
        return S

    def _nvmlDeviceGetMaxMigDeviceCount(self, handle, ref):
        t = self._target(handle)
        if not isinstance(t, Gpu) or not t.mig_capable:
            return pynvml.NVML_ERROR_NOT_SUPPORTED
        _obj(ref).value = 7
        return S

    def _nvmlDeviceGetMigDeviceHandleByIndex(self, handle, index, ref):
        t = self._target(handle)
        i = index.value if hasattr(index, "value") else int(index)
        if not isinstance(t, Gpu) or not 0 <= i < len(t.migs):
            return pynvml.NVML_ERROR_NOT_FOUND
        return self._give(ref, t.migs[i])

    def _nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, handle, ref):
        t = self._target(handle)
        if not isinstance(t, Mig):
            return pynvml.NVML_ERROR_INVALID_ARGUMENT
        return self._give(ref, t.parent)

    def _nvmlDeviceGetUtilizationRates(self, handle, ref):
        t = self._target(handle)
        if isinstance(t, Mig) or (isinstance(t, Gpu) and t.migs):
            return pynvml.NVML_ERROR_NOT_SUPPORTED
        u = _obj(ref)
        u.gpu, u.memory = 97, 41
        return S

    def _processes(self, handle, ref, array, kind: str) -> int:
        t = self._target(handle)
        if isinstance(t, Gpu) and t.migs and not self.machine.root:
            return pynvml.NVML_ERROR_NO_PERMISSION
        uuids = [t.uuid] + ([m.uuid for m in t.migs] if isinstance(t, Gpu) else [])
        procs = [(p, u) for p in self.machine.processes if p.kind == kind
                 for u in uuids if p.held(u)]
        count = _obj(ref)
        if array is None or count.value < len(procs):
            wanted = len(procs)
            count.value = wanted
            return S if wanted == 0 else pynvml.NVML_ERROR_INSUFFICIENT_SIZE
        for k, (p, u) in enumerate(procs):
            in_mig = u != t.uuid or isinstance(t, Mig)
            array[k].pid, array[k].usedGpuMemory = p.pid, p.held(u)
            array[k].gpuInstanceId = array[k].computeInstanceId = 0 if in_mig else NOT_IN_MIG
        count.value = len(procs)
        return S

    def _nvmlDeviceGetComputeRunningProcesses_v3(self, handle, ref, array):
        return self._processes(handle, ref, array, "compute")

    def _nvmlDeviceGetGraphicsRunningProcesses_v3(self, handle, ref, array):
        return self._processes(handle, ref, array, "graphics")


def install_nvml(machine: Machine, monkeypatch) -> FakeLib:
    """Put ``FakeLib(machine)`` under the real ``pynvml``; undone with the test's monkeypatch."""
    lib = FakeLib(machine)
    monkeypatch.setattr(pynvml, "nvmlLib", lib)
    monkeypatch.setattr(pynvml, "_nvmlGetFunctionPointer_cache", {})
    monkeypatch.setattr(pynvml, "_nvmlLib_refcount", 0)
    return lib


def remove_nvml_library(monkeypatch) -> None:
    """nvidia-ml-py installed, the driver's ``libnvidia-ml.so.1`` not: ``nvmlInit`` raises
    ``NVMLError_LibraryNotFound`` as it does on a machine without the NVIDIA driver."""
    def missing(*args, **kwargs):
        raise OSError("libnvidia-ml.so.1: cannot open shared object file")

    monkeypatch.setattr(pynvml, "nvmlLib", None)
    monkeypatch.setattr(pynvml, "_nvmlGetFunctionPointer_cache", {})
    monkeypatch.setattr(pynvml, "CDLL", missing)
