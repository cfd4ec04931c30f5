"""Per-GPU calibration: what the user's own GPU measures, stored so later estimates can use it.

Data flow: ``hf-memkit calibrate`` -> ``measure.measure_calibration()`` (a fresh process on a
CUDA GPU)
-> ``Calibration`` -> ``save_calibration()`` -> ``<cache>/calibration/<key>.json``;
``find_calibration(gpu, cuda)`` reads it back; ``hf-memkit calibrate --check`` and
``MemoryCallback(calibrate=True)`` append measured/predicted residuals (``add_residual``).

The store: one JSON file per (GPU, driver, torch, CUDA) under ``calibration_dir()``
(``$HF_MEMKIT_CACHE/calibration``, else ``${XDG_CACHE_HOME:-~/.cache}/hf_memkit/calibration``),
named by ``calibration_key``, written atomically (a temporary file, then ``os.replace``). Bytes
throughout. What the store reads is checked as ``hf-memkit calibrate`` writes it: regular files
of at most ``MAX_FILE_BYTES`` only (a FIFO or ``/dev/zero`` in its place is refused without a
read), byte counts in [0, ``MAX_BYTES``], residuals in [``RESIDUAL_MIN``, ``RESIDUAL_MAX``], a
``created`` time no more than ``CLOCK_SKEW_S`` ahead of this machine's clock (the newest
calibration wins: a future date would win forever). A store folder that another user owns or
that group or others may write is not read (``_store.trusted``).
``load_calibration(path)`` (a file the caller names) raises ``HfMemkitError`` naming the file
and what is wrong; ``find_calibration`` (what estimates call) skips such a file with a warning
saying how to remove it, so a broken cache file never stops an estimate: it falls back to the
uncalibrated band.

The band of a calibrated estimate is ``Calibration.rel_sigma``: never narrower than the
residuals support (``band_factor``), never below ``SIGMA_FLOOR``.

``device_used`` is what this process holds on its GPU: its CUDA context plus the caching
allocator's segments (NVML's ``usedGpuMemory`` of the process; on an otherwise idle GPU, what
``nvidia-smi``'s used rises by when the process starts). It never includes the driver's own
reservation or another process. ``context`` is measured that way (this process's NVML entry,
else NVML used less the used read before CUDA init) minus the allocator's reserved bytes, so
that ``reserved + context`` predicts it. Residuals compare the same quantity.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import re
import stat
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from .._cuda.runtime import CALIBRATION
from .._errors import ConfigError, HfMemkitError, quoted
from .._store import cache_root, folder_problem, make_folder, trusted
from .._units import GiB

logger = logging.getLogger(__name__)

MAX_RESIDUALS = 50      # residuals kept per calibration, newest last
MIN_RESIDUALS = 3       # fewer give no rel_sigma
FORMAT = 1              # the JSON layout's version
RERUN = "delete it and re-run `hf-memkit calibrate`"
# What a calibration file may hold. A file holds a few hundred bytes plus ~20 per residual; the
# byte counts are parts of one GPU's memory (the largest today: 288 GB); a residual is
# measured / predicted - 1 of device_used, so at least -1 (nothing measured) and, at 10, an
# estimate eleven times too low: a broken measurement, not a spread to widen the band with.
MAX_FILE_BYTES = 64 * 1024
MAX_BYTES = 1024 * GiB
RESIDUAL_MIN, RESIDUAL_MAX = -1.0, 10.0
# The calibrated band's relative 1-sigma never goes below the traced step's own (CPU-measured)
# 1-sigma: a GPU's residuals on its reference model do not make another model's trace exact.
SIGMA_FLOOR = CALIBRATION.traced_cpu_sigma
SIGMA_CONFIDENCE_Z = 1.6449   # the band's one-sided confidence: 95%
CLOCK_SKEW_S = 24 * 3600      # how far ahead of this machine's clock `created` may be

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
        "What this process holds (its NVML entry) minus the allocator's reserved after a "
        "reference training step: the CUDA context with the kernels a step loads lazily; "
        "neither the driver's reservation nor other processes."))
    context_at_init: int = field(metadata=_help(
        "What this process holds after CUDA init and one freed tiny tensor, reserved bytes "
        "excluded."))
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
    def residual_rms(self) -> float | None:
        """RMS of the residuals once there are ``MIN_RESIDUALS`` (None before)."""
        if len(self.residuals) < MIN_RESIDUALS:
            return None
        return math.sqrt(sum(r * r for r in self.residuals) / len(self.residuals))

    @property
    def rel_sigma(self) -> float | None:
        """The band's relative 1-sigma of device_used once there are ``MIN_RESIDUALS``
        residuals: their RMS widened to what they support (``band_factor``), never below
        ``SIGMA_FLOOR``."""
        rms = self.residual_rms
        if rms is None:
            return None
        return max(SIGMA_FLOOR, rms * band_factor(len(self.residuals)))

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
            raise ConfigError([f"format {quoted(d.get('format'))} is not {FORMAT}"],
                              source="calibration")
        kw = {n: d[n] for n in names if n in d}
        if isinstance(kw.get("residuals"), list):
            kw["residuals"] = tuple(kw["residuals"])
        return cls(**kw)


def band_factor(n: int) -> float:
    """How far the RMS of ``n`` residuals is widened for the band: sqrt(n / chi2_0.05(n)), the
    one-sided 95% upper confidence bound of sigma when n errors about zero (n degrees of freedom)
    give that RMS. 2.9 at n = 3 (what ``hf-memkit calibrate --check`` leaves), 1.6 at 10, 1.2 at
    50. The chi-square quantile is Wilson and Hilferty's approximation, n (1 - 2/(9n) - z
    sqrt(2/(9n)))^3, a little low at small n: the factor is 3.5% wide of the exact one at n = 3,
    0.1% at n = 10."""
    k = 2.0 / (9.0 * n)
    quantile = n * (1.0 - k - SIGMA_CONFIDENCE_Z * math.sqrt(k)) ** 3
    return math.sqrt(n / quantile)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


def _problems(c: Calibration) -> list[str]:
    out = []
    for name in ("gpu", "torch"):
        if not isinstance(getattr(c, name), str) or not getattr(c, name):
            out.append(f"`{name}` must be a non-empty string, got {quoted(getattr(c, name))}")
    for name in ("driver", "cuda"):
        if getattr(c, name) is not None and not isinstance(getattr(c, name), str):
            out.append(f"`{name}` must be a string or null, got {quoted(getattr(c, name))}")
    for name in ("context", "context_at_init", "cublas_workspace"):
        v = getattr(c, name)
        if not _is_int(v) or not 0 <= v <= MAX_BYTES:
            out.append(f"`{name}` must be a non-negative integer of bytes, got {quoted(v)} "
                       f"(at most {MAX_BYTES}, 1 TiB: more than any GPU holds)")
    if not _is_number(c.reserved_over_allocated) or c.reserved_over_allocated <= 0:
        out.append("`reserved_over_allocated` must be a positive number, got "
                   f"{quoted(c.reserved_over_allocated)}")
    out += _residual_problems(c.residuals)
    if not isinstance(c.created, str):
        out.append(f"`created` must be an ISO 8601 string, got {quoted(c.created)}")
    elif c.created and _timestamp(c.created) is None:
        out.append(f"`created` is not an ISO 8601 time: {quoted(c.created)}")
    elif c.created and _timestamp(c.created) > time.time() + CLOCK_SKEW_S:
        now = datetime.now(timezone.utc).isoformat(timespec="seconds")
        out.append(f"`created` {quoted(c.created)} is more than a day ahead of this machine's "
                   f"clock ({now}); a calibration is dated when it is measured")
    return out


def _residual_problems(residuals: Any) -> list[str]:
    if not isinstance(residuals, tuple) or not all(_is_number(r) for r in residuals):
        return [f"`residuals` must be a list of finite numbers, got {quoted(residuals)}"]
    if len(residuals) > MAX_RESIDUALS:
        return [f"`residuals` holds {len(residuals)}; a calibration keeps at most "
                f"{MAX_RESIDUALS}"]
    bad = [r for r in residuals if not RESIDUAL_MIN <= r <= RESIDUAL_MAX]
    if bad:
        return [f"`residuals` must each be measured / predicted - 1, in [{RESIDUAL_MIN:g}, "
                f"{RESIDUAL_MAX:g}], got {quoted(bad[0])}"]
    return []


def _timestamp(created: str) -> float | None:
    try:
        t = datetime.fromisoformat(created)
    except ValueError:
        return None
    return (t if t.tzinfo else t.replace(tzinfo=timezone.utc)).timestamp()


# ----------------------------------------------------------------------------------------------
# The store
# ----------------------------------------------------------------------------------------------


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
    key = calibration_key(cal.gpu, cal.driver, cal.torch, cal.cuda)
    path = folder / f"{key}.json"
    if path.exists() and not path.is_file():
        raise HfMemkitError(f"calibration file `{path}` is not a regular file; remove it "
                            "and re-run `hf-memkit calibrate`")
    try:
        make_folder(folder)
        problem = folder_problem(folder)
        if problem is not None:
            raise HfMemkitError(f"the calibration is not saved: {problem}")
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{key}.", suffix=".tmp")
    except OSError as exc:
        why = exc.strerror or exc
        raise HfMemkitError(f"cannot write the calibration store `{folder}` ({why}); set "
                            "HF_MEMKIT_CACHE to a directory you can write to") from None
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
    """One stored calibration; ``HfMemkitError`` naming the file when it is not a regular file,
    cannot be read, is larger than ``MAX_FILE_BYTES`` or holds what ``calibrate`` never writes."""
    path = Path(path)
    text = _read_small_file(path)
    try:
        cal = Calibration.from_dict(json.loads(text))
    except (ValueError, TypeError, RecursionError) as exc:  # JSONDecodeError, ConfigError
        raise HfMemkitError(f"calibration file `{path}` is corrupt ({exc}); {RERUN}") from exc
    return dataclasses.replace(cal, path=path)


def _read_small_file(path: Path) -> str:
    """The text of ``path``: opened without blocking (a FIFO is refused, never waited on), a
    regular file only, at most ``MAX_FILE_BYTES`` read."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as exc:
        raise HfMemkitError(f"calibration file `{path}` cannot be read ({exc.strerror or exc}); "
                            f"{RERUN}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise HfMemkitError(f"calibration file `{path}` is not a regular file (a "
                                f"directory, FIFO or device); {RERUN}")
        data = b""
        while len(data) <= MAX_FILE_BYTES:
            chunk = os.read(fd, MAX_FILE_BYTES + 1 - len(data))
            if not chunk:
                break
            data += chunk
    except OSError as exc:
        raise HfMemkitError(f"calibration file `{path}` cannot be read "
                            f"({exc.strerror or exc}); {RERUN}") from None
    finally:
        os.close(fd)
    if len(data) > MAX_FILE_BYTES:
        raise HfMemkitError(f"calibration file `{path}` is larger than {MAX_FILE_BYTES} bytes "
                            f"(a calibration holds about 2 KiB); {RERUN}")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise HfMemkitError(f"calibration file `{path}` is not UTF-8 text ({exc.reason} at "
                            f"byte {exc.start}); {RERUN}") from None


def find_calibration(gpu: str, cuda: str | None, *, driver: str | None = None,
                     torch_version: str | None = None) -> Calibration | None:
    """The newest stored calibration of ``gpu`` (exact name, case-insensitive) under ``cuda``,
    and of ``driver`` / ``torch_version`` when given; None when there is none.

    The file it came from is ``result.path``. Only files named for this GPU and CUDA are read;
    one that ``load_calibration`` refuses is skipped with a warning naming it and how to remove
    it (a broken cache file never stops an estimate).
    """
    folder = calibration_dir()
    if not folder.is_dir() or not trusted(folder):
        return None
    found = []
    for p in sorted(folder.glob(_prefix(gpu, cuda) + "*.json")):
        try:
            cal = load_calibration(p)
        except HfMemkitError as exc:
            warnings.warn(f"{exc} (ignored: until then, estimates for {gpu} use the "
                          "uncalibrated band)", UserWarning, stacklevel=2)
            continue
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
