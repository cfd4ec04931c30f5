"""NVML readings of one CUDA device for ``MemoryCallback``, each field on its own.

Fields (bytes, except the utilisation in percent):

* ``nvml_used``: the device's used memory as ``nvidia-smi`` shows it (NVML v1 ``used``: every
  process, the driver's reservation included). On a MIG instance, the instance's own memory.
* ``gpu_util``: NVML's utilisation. NVML does not report it for MIG instances
  (``NVML_ERROR_NOT_SUPPORTED``); the other fields go on without it.
* ``other_processes``: what NVML's process lists (compute and graphics) show for every process on
  this device except this one: a colocated job, a second rank's stray context. Needs the lists
  to be readable (a MIG parent's need root) and to show this process's pid (a container with its
  own PID namespace shows host pids: then it is not logged, rather than logged wrong).

The handle is ``hf_memkit._device.probe.nvml_handle``'s, which maps the CUDA device to its NVML
device; on MIG it is the instance's handle, whose memory and processes need no root.

A field that NVML refuses for good (not supported, no permission, a function this nvidia-ml-py
lacks) stops with one warning that names the cause; the others go on. Any other error skips that
field at that log (one warning) and it is read again at the next. ``missing(field)`` says why a
field has no reading, for messages that depend on it (``calibrate=True``).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from .._device.nvml import processes

logger = logging.getLogger(__name__)

FIELDS = ("nvml_used", "gpu_util", "other_processes")
WHAT = {"nvml_used": "the device's used memory (memory/nvml_used_gib)",
        "gpu_util": "the utilisation (memory/gpu_util)",
        "other_processes": "the process list (memory/other_processes_gib)"}
MIG_ROOT = ("on a GPU in MIG mode NVML gives the parent device's memory and processes to root "
            "only, while each MIG instance's own handle answers: name the instance in "
            "CUDA_VISIBLE_DEVICES (MIG-<uuid>, from `nvidia-smi -L`)")


def _code(pynvml: Any, exc: Exception) -> str | None:
    """``"not_supported"``, ``"no_permission"``, ``"no_function"`` or None (another error)."""
    if isinstance(exc, AttributeError):
        return "no_function"
    value = getattr(exc, "value", None)
    for name, code in (("NVML_ERROR_NOT_SUPPORTED", "not_supported"),
                       ("NVML_ERROR_NO_PERMISSION", "no_permission"),
                       ("NVML_ERROR_FUNCTION_NOT_FOUND", "no_function")):
        if value is not None and value == getattr(pynvml, name, object()):
            return code
    return None


class NvmlFields:
    """The NVML fields of CUDA device ``index``; ``open()`` first, ``read()`` at each log."""

    process_used: int | None = None   # set by each read() that lists this process

    def __init__(self, index: int):
        self.index = index
        self.nvml: Any = None
        self.handle: Any = None
        self.mig: str | None = None         # "instance", "parent" (a GPU in MIG mode) or None
        self.off: dict[str, str] = {}       # field -> why it is not read (for the whole run)
        self.last_error: dict[str, str] = {}
        self._warned: set[str] = set()

    def _all_off(self, why: str) -> bool:
        self.off = dict.fromkeys(FIELDS, why)
        return False

    def open(self) -> bool:
        """Start NVML for this device; False (with one warning) where NVML is missing or fails."""
        from .._device.probe import NVML_MISSING, nvml_handle, warn_once

        try:
            import pynvml  # nvidia-ml-py
        except ImportError:
            warn_once("nvml_missing", NVML_MISSING)
            return self._all_off("nvidia-ml-py is not installed (pip install nvidia-ml-py)")
        try:
            pynvml.nvmlInit()
        except Exception as exc:
            why = (f"nvidia-ml-py is installed but NVML did not start ({exc}): the NVIDIA "
                   "driver's libnvidia-ml is missing or failed")
            logger.warning("%s; memory/nvml_* readings are not logged", why)
            return self._all_off(why)
        try:
            self.handle = nvml_handle(pynvml, self.index)
        except Exception as exc:
            why = f"NVML is running but has no handle for CUDA device {self.index} ({exc})"
            logger.warning("%s; memory/nvml_* readings are not logged", why)
            self._shutdown(pynvml)
            return self._all_off(why)
        self.nvml = pynvml
        self.mig = self._mig_kind()
        return True

    def _mig_kind(self) -> str | None:
        n = self.nvml
        try:
            if n.nvmlDeviceIsMigDeviceHandle(self.handle):
                return "instance"
        except Exception:
            pass
        try:
            current, _pending = n.nvmlDeviceGetMigMode(self.handle)
            return "parent" if current == getattr(n, "NVML_DEVICE_MIG_ENABLE", 1) else None
        except Exception:   # NVML_ERROR_NOT_SUPPORTED on cards without MIG
            return None

    # -- the fields ----------------------------------------------------------------------------

    def _nvml_used(self) -> float:
        return float(self.nvml.nvmlDeviceGetMemoryInfo(self.handle).used)

    def _gpu_util(self) -> float:
        return float(self.nvml.nvmlDeviceGetUtilizationRates(self.handle).gpu)

    def _other_processes(self) -> float | None:
        held = processes(self.nvml, self.handle, raises=True)
        pid = os.getpid()
        if pid not in held:
            self._stop("other_processes", f"NVML's process list of this device does not show "
                                          f"this process (pid {pid}): a container with its own "
                                          f"PID namespace shows host pids, so which entry is "
                                          f"this process is unknown")
            return None
        self.process_used = held[pid]     # this process's own entry: what device_used predicts
        return float(sum(v or 0 for k, v in held.items() if k != pid))

    def read(self) -> dict[str, float]:
        """Each field NVML answers now, by metric name; a failing field never hides another."""
        out: dict[str, float] = {}
        self.process_used = None
        if self.nvml is None:
            return out
        for name in FIELDS:
            if name in self.off:
                continue
            try:
                value = getattr(self, "_" + name)()
            except Exception as exc:
                self._failed(name, exc)
                continue
            self.last_error.pop(name, None)
            if value is not None:
                out[name] = value
        if self.process_used is not None:
            out["process_used"] = float(self.process_used)
        return out

    def _failed(self, name: str, exc: Exception) -> None:
        code = _code(self.nvml, exc)
        what = WHAT[name]
        if code == "not_supported":
            why = f"NVML does not support {what} on this device ({exc})"
            if self.mig and name == "gpu_util":
                why += "; NVML reports no utilisation for MIG devices"
        elif code == "no_permission":
            why = f"NVML denied {what} to this user ({exc})"
            if self.mig == "parent":
                why += f"; {MIG_ROOT}"
        elif code == "no_function":
            why = f"this nvidia-ml-py or driver cannot read {what} ({exc})"
        else:
            self.last_error[name] = f"NVML failed to read {what}: {exc}"
            if name not in self._warned:
                self._warned.add(name)
                logger.warning("%s; skipped at this log, read again at the next",
                               self.last_error[name])
            return
        self._stop(name, why)

    def _stop(self, name: str, why: str) -> None:
        self.off[name] = why
        logger.warning("%s; it is not logged in this run (the other NVML readings go on)", why)

    def missing(self, name: str) -> str:
        """Why ``name`` has no reading now (``process_used`` comes with the process list)."""
        if name == "process_used":
            name = "other_processes"
        return self.off.get(name) or self.last_error.get(name) or "NVML gave no reading"

    @staticmethod
    def _shutdown(pynvml: Any) -> None:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass

    def close(self) -> None:
        if self.nvml is not None:
            self._shutdown(self.nvml)
            self.nvml = None
