"""NVML's C library, faked: what the driver's ``libnvidia-ml.so.1`` answers.

``install_nvml(machine, monkeypatch)`` makes ``FakeLib`` what loading ``libnvidia-ml.so.1``
gives, through ``ctypes.CDLL`` (and the ``CDLL`` nvidia-ml-py imported from ctypes): the real
``pynvml`` then loads it itself on ``nvmlInit`` and runs its real Python (argument structs,
``NVMLError`` subclasses, the two-call process-list protocol), and code that calls the library
through ctypes directly reaches the same library, as ``dlopen`` gives one per process.
``nvidia_ml_py=False``: the package is not installed, only the driver's library is.
Each C function takes the ctypes arguments a caller passes (``byref`` structs and integers,
``c_char_p``, ``c_uint``, ``c_void_p`` / ``nvmlDevice_t`` handles, buffers and their sizes) and
returns an ``nvmlReturn_t``, following NVML's documented rules (see ``tests.fakes.machine``).
"""

from __future__ import annotations

import ctypes
import os
import sys

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
NOT_AVAILABLE = 2**64 - 1     # NVML_VALUE_NOT_AVAILABLE (unsigned long long)
LIBRARY = "libnvidia-ml.so.1"
NO_LIBRARY = f"{LIBRARY}: cannot open shared object file: No such file or directory"
INIT = ("nvmlInitWithFlags", "nvmlInit_v2", "nvmlInit",          # callable before an init
        "nvmlErrorString")
REAL_CDLL = ctypes.CDLL


class _Fn:
    """A C function: callable, and takes attributes (pynvml sets ``restype`` on some)."""

    def __init__(self, lib: FakeLib, name: str, impl):
        self.lib, self.name, self.impl, self.restype = lib, name, impl, None

    def __call__(self, *args):
        m = self.lib.machine
        m.calls.append(self.name)
        if self.name in m.nvml_errors:
            return m.nvml_errors[self.name]
        if self.name not in INIT and self.lib.refcount == 0:
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


def _int(arg) -> int:
    return int(arg.value if hasattr(arg, "value") else arg)


def _put(buf, size, text: str) -> int:
    """A string into the caller's buffer of ``size`` bytes, its NUL included."""
    data = text.encode()
    if len(data) + 1 > _int(size):
        return pynvml.NVML_ERROR_INSUFFICIENT_SIZE
    buf.value = data
    return S


class FakeLib:
    """``libnvidia-ml.so.1`` over ``machine``. Handles are addresses 0x1000 + n. A symbol the
    library lacks (not faked, or in ``machine.nvml_absent``) raises ``AttributeError`` as a
    ``ctypes.CDLL`` does; pynvml turns that into ``NVMLError_FunctionNotFound``."""

    def __init__(self, machine: Machine):
        self.machine, self.refcount = machine, 0
        self._handles = {0x1000 + i: t for i, t in enumerate(machine.targets())}
        self._fns: dict[str, _Fn] = {}

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        impl = getattr(type(self), "_" + name, None)
        if impl is None or name in self.machine.nvml_absent:
            raise AttributeError(f"{LIBRARY}: undefined symbol: {name}")
        if name not in self._fns:   # one function object: restype set on it stays
            self._fns[name] = _Fn(self, name, impl.__get__(self))
        return self._fns[name]

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

    def _nvmlInit_v2(self):            # = nvmlInitWithFlags(0)
        return self._nvmlInitWithFlags(0)

    def _nvmlInit(self):               # the v1 symbol, still exported: what torch.cuda calls
        return self._nvmlInitWithFlags(0)

    def _nvmlShutdown(self):
        self.refcount = max(0, self.refcount - 1)
        return S

    def _nvmlErrorString(self, code):
        return ERROR_TEXT.get(code, b"Unknown Error")

    def _nvmlSystemGetDriverVersion(self, buf, size):
        return _put(buf, size, self.machine.driver)

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
        return _put(buf, size, t.name)

    def _nvmlDeviceGetUUID(self, handle, buf, size):
        t = self._target(handle)
        if t is None:
            return pynvml.NVML_ERROR_INVALID_ARGUMENT
        return _put(buf, size, t.uuid)

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

    def _processes(self, handle, ref, array, kind: str, struct: int = 2) -> int:
        """The two-call protocol: without an array (or too small a count) the count wanted and
        ``INSUFFICIENT_SIZE``; ``struct`` 1 is ``nvmlProcessInfo_v1_t`` (pid, usedGpuMemory),
        2 adds the MIG instance ids (``nvmlProcessInfo_t`` of the ``_v2`` and ``_v3`` calls)."""
        t = self._target(handle)
        if t is None:
            return pynvml.NVML_ERROR_INVALID_ARGUMENT
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
        wddm = (t.parent if isinstance(t, Mig) else t).wddm
        for k, (p, u) in enumerate(procs):
            in_mig = u != t.uuid or isinstance(t, Mig)
            array[k].pid = p.pid
            array[k].usedGpuMemory = NOT_AVAILABLE if wddm else p.held(u)
            if struct >= 2:
                array[k].gpuInstanceId = array[k].computeInstanceId = 0 if in_mig else NOT_IN_MIG
        count.value = len(procs)
        return S

    def _nvmlDeviceGetComputeRunningProcesses_v3(self, handle, ref, array):
        return self._processes(handle, ref, array, "compute")

    def _nvmlDeviceGetComputeRunningProcesses_v2(self, handle, ref, array):
        return self._processes(handle, ref, array, "compute")

    def _nvmlDeviceGetComputeRunningProcesses(self, handle, ref, array):   # the v1 struct
        return self._processes(handle, ref, array, "compute", struct=1)

    def _nvmlDeviceGetGraphicsRunningProcesses_v3(self, handle, ref, array):
        return self._processes(handle, ref, array, "graphics")

    def _nvmlDeviceGetGraphicsRunningProcesses_v2(self, handle, ref, array):
        return self._processes(handle, ref, array, "graphics")

    def _nvmlDeviceGetGraphicsRunningProcesses(self, handle, ref, array):  # the v1 struct
        return self._processes(handle, ref, array, "graphics", struct=1)


def _dlopen(monkeypatch, lib: FakeLib | None) -> None:
    """Loading ``libnvidia-ml.so.1`` (by that name or a path to it) through ``ctypes.CDLL``, or
    through the ``CDLL`` nvidia-ml-py took from ctypes, gives ``lib``; ``None``: the library is
    not there (``OSError``, as ``dlopen`` fails). Every other library loads as before."""
    def cdll(name, *args, **kwargs):
        if name is not None and os.path.basename(str(name)) in (LIBRARY, "libnvidia-ml.so"):
            if lib is None:
                raise OSError(NO_LIBRARY)
            return lib
        return REAL_CDLL(name, *args, **kwargs)

    monkeypatch.setattr(ctypes, "CDLL", cdll)
    monkeypatch.setattr(pynvml, "CDLL", cdll)
    monkeypatch.setattr(pynvml, "nvmlLib", None)             # not loaded yet in this process
    monkeypatch.setattr(pynvml, "_nvmlGetFunctionPointer_cache", {})
    monkeypatch.setattr(pynvml, "_nvmlLib_refcount", 0)


def install_nvml(machine: Machine, monkeypatch, *, nvidia_ml_py: bool = True) -> FakeLib:
    """The driver's NVML library over ``machine``: what ``ctypes.CDLL("libnvidia-ml.so.1")``
    loads, and so what the real ``pynvml`` loads on ``nvmlInit`` (one library, one init
    refcount). ``nvidia_ml_py=False``: nvidia-ml-py is not installed (``import pynvml`` raises
    ``ImportError``); the library is. Undone with the test's monkeypatch."""
    lib = FakeLib(machine)
    _dlopen(monkeypatch, lib)
    if not nvidia_ml_py:
        monkeypatch.setitem(sys.modules, "pynvml", None)
    return lib


def remove_nvml_library(monkeypatch) -> None:
    """nvidia-ml-py installed, the driver's ``libnvidia-ml.so.1`` not (a machine or container
    without the NVIDIA driver's libraries): ``nvmlInit`` raises ``NVMLError_LibraryNotFound``
    and ``ctypes.CDLL("libnvidia-ml.so.1")`` raises ``OSError``."""
    _dlopen(monkeypatch, None)
