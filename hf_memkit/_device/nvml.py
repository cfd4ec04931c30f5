"""NVML for CUDA device ``i``: which NVML device it is, and what NVML says about its memory.

The rules this follows (NVML's documentation, CUDA's, torch's ``_parse_visible_devices``):

- NVML numbers GPUs in PCI bus order and ignores ``CUDA_VISIBLE_DEVICES``. CUDA numbers them
  FASTEST_FIRST unless ``CUDA_DEVICE_ORDER=PCI_BUS_ID``; integer entries of
  ``CUDA_VISIBLE_DEVICES`` index CUDA's order, and ``GPU-``/``MIG-`` entries may be unique
  prefixes, which ``nvmlDeviceGetHandleByUUID`` does not accept (it wants the full UUID).
  So CUDA device ``i`` is found in NVML through the UUID torch reports for it
  (``get_device_properties(i).uuid``: ``GPU-<uuid>`` for a GPU, ``MIG-<uuid>`` for a MIG
  instance), else through its PCI bus id; never through an index.
- ``get_device_properties`` creates no CUDA context; ``torch.cuda.mem_get_info`` creates one
  (0.3-0.5 GiB) on the device it asks about. Where NVML answers, free memory is read from NVML.
- On a GPU in MIG mode the parent's memory info and process list need root
  (``NVML_ERROR_NO_PERMISSION``); the MIG instance's own handle answers for its slice.
  Utilisation is not supported on MIG.
- ``nvmlDeviceGetMemoryInfo`` (v1) ``used`` is total - free: the driver's own reservation
  and every process on the device included. What this process holds (its CUDA context and
  the caching allocator's segments) is its entry in the process list (``usedGpuMemory``).
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)


def _nvml_error(pynvml: Any, exc: BaseException, *codes: str) -> bool:
    """Whether ``exc`` is an ``NVMLError`` with one of the ``NVML_ERROR_*`` names ``codes``."""
    value = getattr(exc, "value", None)
    return isinstance(exc, getattr(pynvml, "NVMLError", ())) and any(
        value == getattr(pynvml, "NVML_ERROR_" + c, object()) for c in codes)


def cuda_uuid(index: int) -> str | None:
    """The UUID CUDA reports for device ``index`` (no ``GPU-``/``MIG-`` prefix), or None."""
    import torch

    try:
        uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    except Exception:
        return None
    text = str(uuid) if uuid is not None else ""
    return text or None


def _pci_bus_id(index: int) -> str | None:
    import torch

    try:
        p = torch.cuda.get_device_properties(index)
        return f"{int(p.pci_domain_id):08X}:{int(p.pci_bus_id):02X}:{int(p.pci_device_id):02X}.0"
    except Exception:
        return None


def nvml_lookup(pynvml: Any, index: int) -> tuple[Any, bool]:
    """``(handle, is_mig_instance)`` of CUDA device ``index``: by the UUID torch reports,
    else by its PCI bus id (the parent GPU, for a MIG instance). Raises what NVML raises, or
    ``LookupError`` when neither identifies the device."""
    uuid = cuda_uuid(index)
    if uuid:
        for prefix, mig in (("GPU-", False), ("MIG-", True)):
            try:
                return pynvml.nvmlDeviceGetHandleByUUID(prefix + uuid), mig
            except Exception as exc:
                if not _nvml_error(pynvml, exc, "NOT_FOUND", "INVALID_ARGUMENT"):
                    raise
    bus = _pci_bus_id(index)
    if bus:
        return pynvml.nvmlDeviceGetHandleByPciBusId(bus), False
    if index == 0 and pynvml.nvmlDeviceGetCount() == 1:   # one GPU: no order to get wrong
        return pynvml.nvmlDeviceGetHandleByIndex(0), False
    raise LookupError(f"NVML has no device with CUDA device {index}'s UUID "
                      f"({uuid or 'unknown'}) or PCI bus id")


def nvml_handle(pynvml: Any, index: int) -> Any:
    """The NVML handle of CUDA device ``index`` (a MIG instance's own handle on MIG)."""
    return nvml_lookup(pynvml, index)[0]


@dataclass(frozen=True)
class NvmlFacts:
    """What NVML says about one CUDA device (bytes)."""

    name: str
    total: int
    free: int
    mig: bool
    driver: str | None
    own: int | None            # what this process holds there (None: NVML would not say)
    others: int | None         # what other processes hold there (None: not listed)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def processes(pynvml: Any, handle: Any, *, raises: bool = False) -> dict[int, int | None] | None:
    """Bytes by pid of every compute and graphics process on the device (a process in both
    lists holds one amount: the larger). A list NVML refuses (the graphics list is
    ``NVMLError_NotSupported`` on some GPUs and containers) leaves out only its own entries.

    Args:
        pynvml: the ``pynvml`` module, NVML initialised.
        handle: the device's NVML handle.
        raises: when neither list is read, raise the compute query's NVML error.

    Returns:
        Bytes by pid (None: NVML would not say); None when neither list is read (MIG without
        root, some drivers) and ``raises`` is false.
    """
    held: dict[int, int | None] = {}
    errors: list[BaseException] = []
    for name in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses"):
        try:
            procs = getattr(pynvml, name)(handle)
        except Exception as exc:
            logger.debug("NVML %s failed: %s", name, exc)
            errors.append(exc)
            continue
        for p in procs:
            used = getattr(p, "usedGpuMemory", None)
            old = held.get(int(p.pid))
            held[int(p.pid)] = used if old is None else max(old, used or 0)
    if len(errors) == 2:
        if raises:
            raise errors[0]
        return None
    return held


def _has_context() -> bool:
    """Whether this process has initialised CUDA (and so may hold a context NVML lists)."""
    try:
        import torch

        return bool(torch.cuda.is_initialized())
    except Exception:
        return False


def split_processes(listed: dict[int, int | None] | None,
                    pid: int | None = None) -> tuple[int | None, int | None]:
    """``(this process's bytes, the other processes' bytes)`` from ``processes()``. A process
    with a CUDA context that NVML does not list under its pid (a container with its own PID
    namespace: NVML shows host pids) leaves both unknown: which entry is ours cannot be told."""
    if listed is None:
        return None, None
    pid = os.getpid() if pid is None else pid
    if listed and pid not in listed and _has_context():
        return None, None
    return listed.get(pid) or 0, sum(b or 0 for p, b in listed.items() if p != pid)


def query(pynvml: Any, index: int, cuda_name: str) -> NvmlFacts:
    """NVML facts of CUDA device ``index`` (NVML initialised by the caller). On a MIG instance
    the name is CUDA's (``... MIG 3g.40gb``) and the memory the slice's."""
    handle, mig = nvml_lookup(pynvml, index)
    name = cuda_name if mig else _text(pynvml.nvmlDeviceGetName(handle))
    mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
    try:
        driver: str | None = _text(pynvml.nvmlSystemGetDriverVersion())
    except Exception:
        driver = None
    own, others = split_processes(processes(pynvml, handle))
    return NvmlFacts(name=name, total=int(mem.total), free=int(mem.free), mig=mig,
                     driver=driver, own=own, others=others)


def own_used(pynvml: Any, handle: Any, baseline: int) -> int:
    """What this process holds on the device now: its entry in NVML's process list, else (MIG
    without root, drivers that list nothing) NVML v1 ``used`` less ``baseline``, the ``used``
    read before this process created its context (the driver's reservation and the other
    tenants then)."""
    own, _others = split_processes(processes(pynvml, handle))
    if own:
        return own
    return int(pynvml.nvmlDeviceGetMemoryInfo(handle).used) - int(baseline)


def visible_entries(value: str | None) -> list[str] | None:
    """The entries of a ``CUDA_VISIBLE_DEVICES`` value that name devices, read as torch's
    ``torch.cuda._parse_visible_devices`` reads them: the first entry's kind (``GPU-``,
    ``MIG-`` or an integer, ``strtoul``-style: ``1gpu`` is ``1``) is the list's; the first
    entry of another kind, or a negative or non-numeric one, ends the list; a repeated entry
    empties it. UUID entries are kept as written (torch does not strip them); whether a UUID
    prefix is unique or names a device is NVML's to say, not this function's.

    Args:
        value: the variable's value; None when it is unset.

    Returns:
        The entries in order (integers as ``str(int)``), or None when ``value`` is None (every
        device is visible).
    """
    if value is None:
        return None
    prefix = next((p for p in ("GPU-", "MIG-") if value.startswith(p)), None)
    entries: list[str] = []
    for elem in value.split(","):
        if prefix is None:
            digits = re.match(r"[+-]?\d+", elem.strip())
            elem = str(int(digits.group())) if digits else "-1"
        if elem in entries:
            return []
        if not elem.startswith(prefix or "") or elem.startswith("-"):
            break
        entries.append(elem)
    return entries


def pinned_entry(index: int) -> str:
    """A ``CUDA_VISIBLE_DEVICES`` value naming CUDA device ``index`` of this process and no
    other, for a child process: its full UUID (``GPU-...`` or, for a MIG instance, ``MIG-...``),
    which means the same device whatever the child's order; else the index in CUDA's order.
    Creates no CUDA context."""
    uuid = cuda_uuid(index)
    if uuid:
        prefix = "GPU-"
        try:
            import pynvml

            pynvml.nvmlInit()
            try:
                prefix = "MIG-" if nvml_lookup(pynvml, index)[1] else "GPU-"
            finally:
                pynvml.nvmlShutdown()
        except Exception:   # no NVML: a MIG instance is not told apart; its GPU- form fails
            pass
        return prefix + uuid
    entries = visible_entries(os.environ.get("CUDA_VISIBLE_DEVICES")) or []
    return entries[index] if index < len(entries) else str(index)
