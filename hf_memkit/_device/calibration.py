"""Per-GPU calibration: what the user's own GPU measures, stored so later estimates can use it.

Data flow: ``hf-memkit calibrate`` -> ``measure.measure_calibration()`` (a fresh process on a
CUDA GPU)
-> ``Calibration`` -> ``save_calibration()`` -> ``<cache>/calibration/<key>.json``;
``find_calibration(gpu, cuda)`` reads it back; ``hf-memkit calibrate --check`` and
``MemoryCallback(calibrate=True)`` append measured/predicted residuals (``add_residual``).

The store: one JSON file per (GPU, driver, torch, CUDA) under ``calibration_dir()``
(``$HF_MEMKIT_CACHE/calibration``, else ``${XDG_CACHE_HOME:-~/.cache}/hf_memkit/calibration``),
named by ``calibration_key``, written atomically (a temporary file, then ``os.replace``). Bytes
throughout. A file that does not parse raises ``HfMemkitError`` naming it.

NVML figures are device-wide (``nvmlDeviceGetMemoryInfo(handle).used``, what ``nvidia-smi``
shows): ``context`` is NVML used minus the allocator's reserved bytes, so that
``reserved + context`` predicts NVML used of a training process on an otherwise idle GPU, the
quantity ``MemoryEstimate.device_used`` stands for. It includes what the GPU shows with no
process on it (the driver's own reservation, a few MiB to a few hundred MiB by driver).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import re
import tempfile
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from .._errors import ConfigError, HfMemkitError

logger = logging.getLogger(__name__)

MAX_RESIDUALS = 50      # residuals kept per calibration, newest last
MIN_RESIDUALS = 3       # fewer give no rel_sigma
FORMAT = 1              # the JSON layout's version
RERUN = "delete it and re-run `hf-memkit calibrate`"

def _help(text: str) -> dict[str, str]:
    return {"help": text}


@dataclass(frozen=True)
class Calibration:
    """What one GPU (with its driver, torch and CUDA) measured. Bytes throughout."""

    gpu: str = field(metadata=_help("DeviceInfo.name as probed, e.g. 'NVIDIA H100 80GB HBM3'."))
    driver: str | None = field(metadata=_help("NVIDIA driver version; None when unknown."))
    torch: str = field(metadata=_help("torch.__version__ that measured."))
    cuda: str | None = field(metadata=_help("torch.version.cuda that measured."))
    context: int = field(metadata=_help(
        "NVML used minus the allocator's reserved after a reference training step: the CUDA "
        "context with the kernels a step loads lazily (device-wide, idle usage included)."))
    context_at_init: int = field(metadata=_help(
        "NVML used after CUDA init and one freed tiny tensor, reserved bytes excluded."))
    cublas_workspace: int = field(metadata=_help(
        "Allocator bytes the first matmuls keep for cuBLAS / cuBLASLt workspaces, forward "
        "thread plus the autograd thread."))
    reserved_over_allocated: float = field(metadata=_help(
        "max_memory_reserved / max_memory_allocated of the reference step (steps 2..3)."))
    residuals: tuple[float, ...] = field(default=(), metadata=_help(
        f"measured / predicted - 1 of device_used, newest last, at most {MAX_RESIDUALS}."))
    created: str = field(default="", metadata=_help("ISO 8601 time of the measurement."))
    path: Path | None = field(default=None, compare=False, repr=False, metadata=_help(
        "The file it was read from (find_calibration / load_calibration); not stored."))

    def __post_init__(self):
        problems = _problems(self)
        if problems:
            raise ConfigError(problems, source="Calibration")

    @property
    def rel_sigma(self) -> float | None:
        """RMS of the residuals (a relative 1-sigma of device_used) once there are enough."""
        if len(self.residuals) < MIN_RESIDUALS:
            return None
        return math.sqrt(sum(r * r for r in self.residuals) / len(self.residuals))

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "path"}
        d["residuals"] = list(self.residuals)
        return {"format": FORMAT, "units": "bytes", **d}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Calibration:
        """Inverse of ``to_dict``; every problem is listed in one ``ConfigError``."""
        if not isinstance(d, dict):
            raise ConfigError([f"expected a JSON object, got {type(d).__name__}"],
                              source="calibration")
        names = [f.name for f in dataclasses.fields(cls) if f.name != "path"]
        required = [f.name for f in dataclasses.fields(cls)
                    if f.default is dataclasses.MISSING]
        missing = [n for n in required if n not in d]
        if missing:
            raise ConfigError([f"missing field(s): {', '.join(missing)}"], source="calibration")
        if d.get("format", FORMAT) != FORMAT:
            raise ConfigError([f"format {d.get('format')!r} is not {FORMAT}"],
                              source="calibration")
        kw = {n: d[n] for n in names if n in d}
        if isinstance(kw.get("residuals"), list):
            kw["residuals"] = tuple(kw["residuals"])
        return cls(**kw)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


def _problems(c: Calibration) -> list[str]:
    out = []
    for name in ("gpu", "torch"):
        if not isinstance(getattr(c, name), str) or not getattr(c, name):
            out.append(f"`{name}` must be a non-empty string, got {getattr(c, name)!r}")
    for name in ("driver", "cuda"):
        if getattr(c, name) is not None and not isinstance(getattr(c, name), str):
            out.append(f"`{name}` must be a string or null, got {getattr(c, name)!r}")
    for name in ("context", "context_at_init", "cublas_workspace"):
        v = getattr(c, name)
        if not _is_int(v) or v < 0:
            out.append(f"`{name}` must be a non-negative integer of bytes, got {v!r}")
    if not _is_number(c.reserved_over_allocated) or c.reserved_over_allocated <= 0:
        out.append("`reserved_over_allocated` must be a positive number, got "
                   f"{c.reserved_over_allocated!r}")
    if not isinstance(c.residuals, tuple) or not all(_is_number(r) for r in c.residuals):
        out.append(f"`residuals` must be a list of finite numbers, got {c.residuals!r}")
    if not isinstance(c.created, str):
        out.append(f"`created` must be an ISO 8601 string, got {c.created!r}")
    elif c.created and _timestamp(c.created) is None:
        out.append(f"`created` is not an ISO 8601 time: {c.created!r}")
    return out


def _timestamp(created: str) -> float | None:
    try:
        t = datetime.fromisoformat(created)
    except ValueError:
        return None
    return (t if t.tzinfo else t.replace(tzinfo=timezone.utc)).timestamp()


# ----------------------------------------------------------------------------------------------
# The store
# ----------------------------------------------------------------------------------------------


def cache_root() -> Path:
    """``$HF_MEMKIT_CACHE``, else ``${XDG_CACHE_HOME:-~/.cache}/hf_memkit``: where calibrations
    and traces (``_estimate.store``) are kept."""
    root = os.environ.get("HF_MEMKIT_CACHE")
    if root:
        return Path(root).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "hf_memkit"


def calibration_dir() -> Path:
    """``$HF_MEMKIT_CACHE/calibration``, else ``${XDG_CACHE_HOME:-~/.cache}/hf_memkit/calibration``."""
    return cache_root() / "calibration"


def _slug(text: str | None, missing: str) -> str:
    s = re.sub(r"[^a-z0-9.]+", "-", (text or missing).strip().lower()).strip("-.")
    return s or missing


def _prefix(gpu: str, cuda: str | None) -> str:
    return f"{_slug(gpu, 'gpu')}__cuda-{_slug(cuda, 'none')}__"


def calibration_key(gpu: str, driver: str | None, torch_version: str, cuda: str | None) -> str:
    """A file-name-safe key, e.g. ``nvidia-h100-80gb-hbm3__cuda-12.4__driver-550.54.15__torch-2.5.1-cu124``."""
    return (f"{_prefix(gpu, cuda)}driver-{_slug(driver, 'unknown')}"
            f"__torch-{_slug(torch_version, 'unknown')}")


def save_calibration(cal: Calibration) -> Path:
    """Write ``cal`` (with ``created`` set to now if empty) atomically; returns its path."""
    if not cal.created:
        cal = dataclasses.replace(cal, created=datetime.now(timezone.utc).isoformat(
            timespec="seconds"))
    folder = calibration_dir()
    folder.mkdir(parents=True, exist_ok=True)
    key = calibration_key(cal.gpu, cal.driver, cal.torch, cal.cuda)
    path = folder / f"{key}.json"
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{key}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(cal.to_dict(), f, indent=2)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def load_calibration(path: str | os.PathLike) -> Calibration:
    """One stored calibration; ``HfMemkitError`` naming the file when it is corrupt."""
    path = Path(path)
    try:
        cal = Calibration.from_dict(json.loads(path.read_text()))
    except (ValueError, TypeError, UnicodeDecodeError) as exc:  # JSONDecodeError, ConfigError
        raise HfMemkitError(f"calibration file `{path}` is corrupt ({exc}); {RERUN}") from exc
    return dataclasses.replace(cal, path=path)


def find_calibration(gpu: str, cuda: str | None, *, driver: str | None = None,
                     torch_version: str | None = None) -> Calibration | None:
    """The newest stored calibration of ``gpu`` (exact name, case-insensitive) under ``cuda``,
    and of ``driver`` / ``torch_version`` when given; None when there is none.

    The file it came from is ``result.path``. Only files named for this GPU and CUDA are read;
    a corrupt one raises ``HfMemkitError`` naming it.
    """
    folder = calibration_dir()
    if not folder.is_dir():
        return None
    found = []
    for p in sorted(folder.glob(_prefix(gpu, cuda) + "*.json")):
        cal = load_calibration(p)
        if (cal.gpu.casefold() != gpu.casefold() or cal.cuda != cuda
                or (driver is not None and cal.driver != driver)
                or (torch_version is not None and cal.torch != torch_version)):
            continue
        found.append((_timestamp(cal.created) or 0.0, p.stat().st_mtime, cal))
    if not found:
        return None
    return max(found, key=lambda t: t[:2])[2]


def add_residual(cal: Calibration, measured: int, predicted: int) -> Calibration:
    """A copy of ``cal`` with ``measured / predicted - 1`` appended (keeping the newest 50)."""
    if not _is_number(predicted) or predicted <= 0:
        raise HfMemkitError(f"predicted device_used must be a positive number of bytes, "
                            f"got {predicted!r}")
    if not _is_number(measured) or measured < 0:
        raise HfMemkitError(f"measured device_used must be a non-negative number of bytes, "
                            f"got {measured!r}")
    residuals = (*cal.residuals, measured / predicted - 1.0)[-MAX_RESIDUALS:]
    return dataclasses.replace(cal, residuals=residuals)


def record_residual(measured: int, predicted: int, *, gpu: str, cuda: str | None,
                    driver: str | None = None, torch_version: str | None = None) -> Path | None:
    """Append one residual to the stored calibration of this GPU; its path, or None when no
    calibration matches (run ``hf-memkit calibrate`` first). Concurrent writers: last wins."""
    cal = find_calibration(gpu, cuda, driver=driver, torch_version=torch_version)
    if cal is None:
        return None
    return save_calibration(add_residual(cal, measured, predicted))
