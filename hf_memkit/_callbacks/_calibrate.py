"""``MemoryCallback(calibrate=True)``: one residual of NVML used vs the estimate's ``device_used``
into the stored calibration of this GPU (``hf_memkit._device.calibration``)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from .._device.calibration import record_residual
from .._device.probe import probe_device
from ._readers import CudaReader, Reader

logger = logging.getLogger(__name__)

Warn = Callable[[str, str], None]   # (key, message): MemoryCallback's warn-once


def predicted_device_used(estimate: Any) -> int | None:
    """``device_used`` of a ``MemoryEstimate`` for a CUDA device (or of a ``Plan``'s), or None."""
    est = getattr(estimate, "estimate", estimate)
    used = getattr(est, "device_used", None)
    kind = getattr(getattr(est, "device", None), "kind", "cuda")
    return int(used) if used and kind == "cuda" else None


def can_calibrate(reader: Reader, estimate: Any, warn: Warn) -> bool:
    if not isinstance(reader, CudaReader):
        warn("calibrate", f"calibrate=True needs CUDA, this run is on {reader.kind}; no residual "
                          "is recorded")
        return False
    if predicted_device_used(estimate) is None:
        warn("calibrate", "calibrate=True needs an estimate (MemoryEstimate or Plan) for a CUDA "
                          "device; no residual is recorded")
        return False
    return True


def write_residual(reader: CudaReader, estimate: Any, rec: dict[str, Any], warn: Warn) -> None:
    """What this process holds (its NVML process entry) / predicted device_used - 1 into this
    GPU's calibration; never raises. The device-wide used is not a stand-in: it counts the
    driver's reservation and other processes, which ``device_used`` does not. Where NVML gave no
    entry the warning says why (missing, not started, refused, not listed: ``_nvml``)."""
    try:
        measured = rec.get("process_used")
        if measured is None:
            warn("calibrate", f"calibrate=True needs NVML's entry for this process (what "
                              f"device_used predicts), and {reader.nvml.missing('process_used')}"
                              "; no residual is recorded")
            return
        dev = probe_device(reader.index)
        path = record_residual(int(measured), predicted_device_used(estimate), gpu=dev.name,
                               cuda=torch.version.cuda, driver=dev.driver_version,
                               torch_version=torch.__version__)
        if path is None:
            warn("calibrate", f"no calibration stored for {dev.name} (driver "
                              f"{dev.driver_version}, torch {torch.__version__}, CUDA "
                              f"{torch.version.cuda}); run `hf-memkit calibrate` on this "
                              "machine first")
        else:
            logger.info("memory residual of step %d recorded in %s", rec["step"], path)
    except Exception as exc:  # a callback never stops training
        warn("calibrate", f"calibration residual not recorded: {exc}")
