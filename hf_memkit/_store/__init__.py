"""Traces kept on disk between processes: ``<cache>/traces/<sha256>.trace`` (and, in the same
entry format, the CLI's kept answers: ``<cache>/answers``, ``commands/_answers``).

A trace of the model code on fake tensors (``activations.trace_excess``) is the slow part of an
estimate; the same question asked again, or a neighbouring one (another optimizer, another
accumulation length, another target batch whose micro-batches were traced before), reuses it.

The key is everything the trace's result depends on (``activations.trace_excess`` builds it):
the model (its class, with a digest of the file that defines it, and its whole config), the
setup's ``trace_key()``, the batch shape, the stage, the CUDA target, and the versions of
hf_memkit (with a digest of its own source, so an edited checkout misses too), Python, torch,
transformers, accelerate, peft, trl and bitsandbytes, each installed or not. A part that has no
stable text form (an object printed with its memory address, a class without a source file) makes
the trace uncacheable: it is traced, never stored.

Safety: the entries are zlib-compressed JSON (never pickle), so an entry holds data, not code.
Each entry stores its full key, compared on read; an entry that is corrupt, unreadable, not a
regular file, of another format or of another key is a miss and is removed. What an entry holds
is checked by its reader (``count``: bytes and counts in [0, ``MAX_COUNT``]); one that fails is a
miss, computed again and overwritten. On POSIX, a folder (or the cache root above it) that
belongs to another user or that group or others may write is not used at all (``trusted``, with
one warning saying how to fix it); the folders hf_memkit creates are 0o700. Writes go to a
temporary file in the same folder, then ``os.replace``, so several processes may share the
folder. The folder is kept under ``HF_MEMKIT_TRACE_CACHE_SIZE`` (default 512MiB) by removing the
entries read least recently (a hit refreshes its entry's time).

Switches: ``HF_MEMKIT_NO_CACHE=1`` (the CLI's ``--no-cache`` sets it; ``0``, ``false``, ``no``,
``off`` or empty leave the cache on, anything else is refused), ``hf-memkit cache info`` and
``hf-memkit cache clear`` (which removes a link in a folder's place, never what it points to).

Why it exists: a repeated question reuses the traces
(docs/quality-bars.md#speed-and-footprint). Imports the ground floor only.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import inspect
import json
import os
import platform
import re
import shlex
import stat
import sys
import tempfile
import time
import warnings
import zlib
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from .._errors import HfMemkitError, quoted
from .._units import format_bytes, parse_bytes
from .._version import __version__

FORMAT = 1
SUFFIX = ".trace"
NO_CACHE_ENV = "HF_MEMKIT_NO_CACHE"
SIZE_ENV = "HF_MEMKIT_TRACE_CACHE_SIZE"
DEFAULT_LIMIT = 512 * 2**20
MAX_INFLATED = 256 * 2**20  # an entry's JSON: a trace's is some 100 KiB
STALE_TEMP_S = 3600           # a temporary file older than this is a writer's leftover
LIBRARIES = ("torch", "transformers", "accelerate", "peft", "trl", "bitsandbytes")
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
_WARNED: set[str] = set()    # folders said to be unwritable or untrusted (once per process)
# the largest number an entry may hold: bytes (1 PiB, more than any machine has) or a count
MAX_COUNT = 2**50
SWITCH_ON = ("1", "true", "yes", "on")
SWITCH_OFF = ("", "0", "false", "no", "off")


class Unkeyable(Exception):
    """A key part without a stable text form: the trace is not cached."""


def cache_root() -> Path:
    """``$HF_MEMKIT_CACHE``, else ``${XDG_CACHE_HOME:-~/.cache}/hf_memkit``: where calibrations,
    traces and answers are kept."""
    root = os.environ.get("HF_MEMKIT_CACHE")
    if root:
        return Path(root).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "hf_memkit"


def enabled() -> bool:
    """Whether traces are read from and written to disk (off with ``HF_MEMKIT_NO_CACHE=1``);
    ``HfMemkitError`` for a value that is neither on nor off."""
    text = os.environ.get(NO_CACHE_ENV, "")
    if text.strip().lower() in SWITCH_OFF:
        return True
    if text.strip().lower() in SWITCH_ON:
        return False
    raise HfMemkitError(f"{NO_CACHE_ENV}={quoted(text)} is neither on nor off; allowed: "
                        f"{', '.join(SWITCH_ON)} (no cache) or {', '.join(SWITCH_OFF[1:])} "
                        "(the cache on, as when it is unset or empty)")


def traces_dir() -> Path:
    """``<cache root>/traces`` (the root: ``$HF_MEMKIT_CACHE``, else XDG, as for calibration)."""
    return cache_root() / "traces"


def answers_dir() -> Path:
    """``<cache>/answers``: what ``hf-memkit plan`` printed, kept (``commands/_answers``)."""
    return cache_root() / "answers"


def size_limit() -> int:
    """``HF_MEMKIT_TRACE_CACHE_SIZE`` in bytes (e.g. ``1GiB``; 0 keeps nothing), default 512MiB."""
    text = os.environ.get(SIZE_ENV, "").strip()
    if not text:
        return DEFAULT_LIMIT
    try:
        return parse_bytes(text)
    except HfMemkitError as exc:
        raise HfMemkitError(f"{SIZE_ENV}={text!r}: {exc}; or unset it for the default "
                            f"({format_bytes(DEFAULT_LIMIT)})") from None


def count(value: Any) -> int:
    """``value``, read from an entry, as bytes or a count: an integer in [0, ``MAX_COUNT``];
    ``ValueError`` for anything else (a broken or tampered entry)."""
    if type(value) is not int or not 0 <= value <= MAX_COUNT:
        raise ValueError("a count must be an integer in [0, 2**50]")
    return value


# ----------------------------------------------------------------------------------------------
# The folders
# ----------------------------------------------------------------------------------------------


def _checked(folder: Path) -> list[Path]:
    """``folder`` and, where it lies in the cache root, each folder up to the root."""
    root = cache_root()
    return [q for q in (folder, *folder.parents) if q == root or root in q.parents] \
        if folder == root or root in folder.parents else [folder]


def folder_problem(folder: Path) -> str | None:
    """Why ``folder`` must not be used: it, or the cache root above it, belongs to another user
    or is writable by group or others (POSIX only). None where it is safe or absent."""
    if not hasattr(os, "getuid"):
        return None
    for p in _checked(Path(folder)):
        try:
            st = os.stat(p)
        except OSError:
            continue
        own = "set HF_MEMKIT_CACHE to a folder you own"
        if st.st_uid != os.getuid():
            what, fix = f"belongs to uid {st.st_uid}, not to you (uid {os.getuid()})", own
        elif st.st_mode & 0o022:
            what = f"is writable by group or others (mode {stat.S_IMODE(st.st_mode):#o})"
            fix = f"run `chmod go-w {shlex.quote(str(p))}`, or {own}"
        else:
            continue
        return (f"the cache folder {p} {what}: whoever can write to it could plant what "
                f"hf_memkit reads back, so nothing there is used; {fix}")
    return None


def trusted(folder: Path) -> bool:
    """Whether ``folder`` may be read and written (``folder_problem``); warns once where not."""
    problem = folder_problem(folder)
    if problem is not None and problem not in _WARNED:
        _WARNED.add(problem)
        warnings.warn(problem, UserWarning, stacklevel=3)
    return problem is None


def make_folder(folder: Path) -> None:
    """Create ``folder`` and the missing folders above it, each 0o700 (this user's own)."""
    for p in reversed((folder, *folder.parents)):
        if not p.is_dir():
            p.mkdir(mode=0o700, exist_ok=True)


# ----------------------------------------------------------------------------------------------
# The key
# ----------------------------------------------------------------------------------------------


@functools.cache
def _file_digest(path: str) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]


def _package_digest(suffixes: tuple[str, ...]) -> str:
    """A digest of hf_memkit's files with these suffixes, names and contents."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for p in sorted(q for q in root.rglob("*") if q.suffix in suffixes):
        h.update(str(p.relative_to(root)).encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()[:16]


@functools.cache
def _source_digest() -> str:
    """A digest of hf_memkit's own source files: an edited checkout changes its key."""
    return _package_digest((".py",))


@functools.cache
def data_digest() -> str:
    """A digest of hf_memkit's data files (the GPU and model catalogs, the bundled recipes): what
    an answer, not a trace, also depends on."""
    return _package_digest((".json", ".yaml", ".yml"))


def installed(name: str) -> str | None:
    """The installed version of the distribution ``name``, None where it is not installed."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


@functools.cache
def versions() -> dict[str, Any]:
    """What of the environment changes a trace: the libraries whose code it runs."""
    return {"hf_memkit": [__version__, _source_digest()],
            "python": list(sys.version_info[:2]), "machine": platform.machine(),
            **{name: installed(name) for name in LIBRARIES}}


def stable(value: Any) -> Any:
    """``value`` as JSON data that is the same in every process (no ``id()``, no address, sets
    sorted); raises ``Unkeyable`` where it cannot be."""
    if isinstance(value, str) and _ADDRESS.search(value):
        raise Unkeyable("a text holding a memory address")
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, enum.Enum):
        return stable(value.value)
    if isinstance(value, dict):
        items = [(json.dumps(stable(k), sort_keys=True), stable(v)) for k, v in value.items()]
        return {"dict": sorted(items)}
    if isinstance(value, (set, frozenset)):
        return {"set": sorted(json.dumps(stable(v), sort_keys=True) for v in value)}
    if isinstance(value, (list, tuple)):
        return [stable(v) for v in value]
    if isinstance(value, type):
        try:
            source = inspect.getsourcefile(value)
        except TypeError:
            source = None
        if not source or not os.path.isfile(source):
            raise Unkeyable(f"class {value.__qualname__} has no source file")
        return {"class": f"{value.__module__}.{value.__qualname__}",
                "source": _file_digest(source)}
    if dataclasses.is_dataclass(value):
        return {"dataclass": stable(type(value)),
                "fields": {f.name: stable(getattr(value, f.name))
                           for f in dataclasses.fields(value)}}
    text = repr(value)  # torch.dtype and other plain values
    if _ADDRESS.search(text):
        raise Unkeyable(f"{type(value).__name__} has no stable text form")
    return {type(value).__name__: text}


def make_key(parts: dict[str, Any]) -> str | None:
    """The entry key of a trace (canonical JSON of ``parts`` and ``versions()``), or None when a
    part cannot be keyed (the trace is then not cached)."""
    try:
        return json.dumps({"parts": stable(parts), "versions": versions()}, sort_keys=True,
                          separators=(",", ":"))
    except Unkeyable:
        return None


def digest(key: str) -> str:
    """The name of ``key``'s entry."""
    return hashlib.sha256(key.encode()).hexdigest()


# ----------------------------------------------------------------------------------------------
# The store
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StoreInfo:
    """What ``hf-memkit cache info`` shows."""

    path: Path
    entries: int
    size: int
    limit: int
    enabled: bool
    problem: str | None = None   # why the folder is not used (``folder_problem``)


class TraceStore:
    """One folder of entries, each ``{"format", "key", "value"}`` as zlib-compressed JSON."""

    def __init__(self, root: Path | None = None, limit: int | None = None) -> None:
        self.root = traces_dir() if root is None else Path(root)
        self.limit = size_limit() if limit is None else limit

    def path(self, key: str) -> Path:
        return self.root / (digest(key) + SUFFIX)

    def get(self, key: str) -> Any | None:
        """The value stored under ``key``, or None (a miss: absent, corrupt or another key's;
        a bad entry is removed)."""
        p = self.path(key)
        if not trusted(self.root):
            return None
        try:
            st = os.stat(p, follow_symlinks=False)
        except OSError:
            return None
        if not stat.S_ISREG(st.st_mode) or st.st_size > max(self.limit, 1):
            _remove(p)
            return None
        try:
            with open(p, "rb") as f:
                entry = json.loads(_inflate(f.read(st.st_size + 1)))
            if entry.get("format") != FORMAT or entry.get("key") != key:
                raise ValueError("another format or key")
            value = entry["value"]
        except (OSError, ValueError, KeyError, TypeError, AttributeError, zlib.error,
                RecursionError):
            _remove(p)
            return None
        try:
            os.utime(p)  # least recently used goes first
        except OSError:
            pass
        return value

    def discard(self, key: str) -> None:
        """Remove the entry of ``key`` (one whose value did not read back)."""
        _remove(self.path(key))

    def put(self, key: str, value: Any) -> None:
        """Store ``value`` (JSON data) under ``key`` atomically, then keep the folder under its
        limit. A folder that cannot be written warns once per process and is skipped."""
        data = zlib.compress(json.dumps({"format": FORMAT, "key": key, "value": value},
                                        separators=(",", ":")).encode(), 6)
        if len(data) > self.limit:
            return
        try:
            make_folder(self.root)
            if not trusted(self.root):
                return
            fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".tmp-", suffix=SUFFIX)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                os.replace(tmp, self.path(key))
            except BaseException:
                _remove(Path(tmp))
                raise
        except OSError as exc:
            self._warn(exc)
            return
        self.evict()

    def _warn(self, exc: OSError) -> None:
        if str(self.root) not in _WARNED:
            _WARNED.add(str(self.root))
            warnings.warn(f"traces are not kept on disk: cannot write {self.root} "
                          f"({exc.strerror or exc}); set HF_MEMKIT_CACHE to a writable folder, "
                          f"or {NO_CACHE_ENV}=1 to stop trying", UserWarning, stacklevel=3)

    def _entries(self) -> list[tuple[float, int, Path]]:
        """(last used, bytes, path) of each entry; leftover temporary files are removed."""
        out = []
        try:
            names = os.listdir(self.root)
        except OSError:
            return []
        now = time.time()
        for name in names:
            p = self.root / name
            try:
                st = os.stat(p, follow_symlinks=False)
            except OSError:
                continue
            if name.startswith(".tmp-"):
                if now - st.st_mtime > STALE_TEMP_S:
                    _remove(p)
            elif name.endswith(SUFFIX) and stat.S_ISREG(st.st_mode):
                out.append((st.st_mtime, st.st_size, p))
        return out

    def evict(self) -> int:
        """Remove the least recently used entries until the folder fits the limit; returns how
        many were removed."""
        entries = sorted(self._entries())
        total, removed = sum(size for _, size, _ in entries), 0
        for _, size, p in entries:
            if total <= self.limit:
                break
            _remove(p)
            total -= size
            removed += 1
        return removed

    def clear(self) -> int:
        """Remove every entry; returns how many. Links are never followed: a link in the
        folder's place is removed itself (with a warning), links among the entries likewise."""
        if self.root.is_symlink():
            target = os.readlink(self.root)
            _remove(self.root)
            warnings.warn(f"{self.root} was a link (to {target}), not a folder hf_memkit "
                          "made: removed the link itself, nothing it points to", UserWarning,
                          stacklevel=2)
            return 0
        if not trusted(self.root):
            return 0
        entries = self._entries()
        for _, _, p in entries:
            _remove(p)
        for p in self.root.glob("*" + SUFFIX):
            if p.is_symlink():
                _remove(p)
        return len(entries)

    def info(self) -> StoreInfo:
        entries = self._entries()
        return StoreInfo(self.root, len(entries), sum(size for _, size, _ in entries),
                         self.limit, enabled(), folder_problem(self.root))


def _inflate(data: bytes) -> bytes:
    """An entry's JSON, refused (``ValueError``) past ``MAX_INFLATED`` bytes."""
    z = zlib.decompressobj()
    out = z.decompress(data, MAX_INFLATED)
    if z.unconsumed_tail or not z.eof:
        raise ValueError("not a whole entry, or one too large")
    return out


def _remove(p: Path) -> None:
    try:
        p.unlink()
    except OSError:  # gone already (another process), or not ours to remove
        pass
