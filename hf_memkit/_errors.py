"""Errors that tell the user what was wrong, what is allowed, and how to fix it; what they quote
of a user's input (``excerpt``), and how a file the user names is read (``read_user_file``,
``read_json_file``)."""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Iterable


class HfMemkitError(ValueError):
    """Bad input to hf_memkit. A ``ValueError``, so existing ``except ValueError`` keeps working."""


class TrainingFailed(RuntimeError):
    """The run itself failed (after planning and setup succeeded): exit code 1.

    Defined here, not in ``_run.train`` (which re-exports it), so the CLI root can catch it without
    importing torch."""


class ConfigError(HfMemkitError):
    """Several problems found at once in one configuration; each is listed on its own line."""

    def __init__(self, problems: Iterable[str], *, source: str | None = None):
        self.problems = list(problems)
        head = f"{len(self.problems)} problem(s) in {source}:" if source else (
            f"{len(self.problems)} problem(s):"
        )
        super().__init__("\n".join([head, *(f"  - {p}" for p in self.problems)]))


def did_you_mean(value: str, allowed: Iterable[str]) -> str:
    """`` (did you mean `x`?)`` when a close match exists, else an empty string."""
    close = difflib.get_close_matches(str(value), list(allowed), n=1, cutoff=0.6)
    return f" (did you mean `{close[0]}`?)" if close else ""


# what ``printable`` drops: CSI sequences (colours included); OSC, DCS, SOS, PM and APC strings up
# to their terminator; any other escape; C0 controls but \t and \n; DEL; C1
_CONTROL = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]?"
                      r"|\x1b[\]PX^_][^\x07\x1b\x9c]*(?:\x07|\x1b\\|\x9c)?|\x1b[\s\S]?"
                      r"|[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def printable(text: str) -> str:
    """``text`` without control characters and escape sequences: what a terminal shows of text
    hf_memkit did not write itself (a kept answer, a value quoted in an error) stays text."""
    return _CONTROL.sub("", text)


def visible(text: str) -> str:
    """``text`` with each control character but \\t and \\n written as its escape (``\\x1b``): an
    error quoting what a user typed shows it, and the terminal runs none of it."""
    return _CONTROL_CHAR.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


_CONTROL_CHAR = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
EXCERPT = 80  # characters of anything read from a file or given by a user that a message quotes


def excerpt(value: object, limit: int = EXCERPT) -> str:
    """``str(value)`` cut to ``limit`` characters with an ellipsis: what a message quotes of a
    value it did not write itself (a line of a file, a key, a long string)."""
    text = str(value)
    return text if len(text) <= limit else f"{text[:limit - 1]}…"


def quoted(value: object, limit: int = EXCERPT) -> str:
    """``repr(value)``, cut like ``excerpt`` (an enum member as the value it stands for)."""
    import enum

    return excerpt(repr(value.value if isinstance(value, enum.Enum) else value), limit)


def not_a_file(mode: int) -> str:
    """What a path of ``mode`` (``os.stat().st_mode``) is when it is not a regular file."""
    import stat

    kind = ("a FIFO (named pipe)" if stat.S_ISFIFO(mode) else "a device"
            if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "a socket"
            if stat.S_ISSOCK(mode) else None)
    return f"{kind}, not a regular file (reading it could wait forever or never end)" \
        if kind else ("a directory" if stat.S_ISDIR(mode) else "not a regular file")


def read_user_file(path: str | os.PathLike, *, what: str, cap: int,
                   name: str | None = None) -> bytes:
    """The bytes of the regular file a user named (``what``: what it should be, "a lengths
    file"; ``name``: how messages name it, default the path). ``HfMemkitError`` for anything
    else: a FIFO, a device or a socket (reading one
    waits for a writer, or never ends: /dev/zero), a directory, or more than ``cap`` bytes.
    Opened without blocking, so a FIFO with no writer is refused at once."""
    import stat

    size = f"{cap / 2**20:g} MiB" if cap >= 2**20 else f"{cap} bytes"
    name = name or excerpt(path)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as exc:
        raise HfMemkitError(f"{name}: cannot read it ({exc.strerror or exc}); give "
                            f"{what}") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise HfMemkitError(f"{name} is {not_a_file(mode)}; give {what}, saved as a regular file")
    with os.fdopen(fd, "rb") as f:
        data = f.read(cap + 1)
    if len(data) > cap:
        raise HfMemkitError(f"{name} is larger than {size}, the most hf_memkit reads "
                            f"here; give {what} of at most {size}")
    return data


def read_json_file(path: str | os.PathLike, *, name: str, what: str, cap: int, fix: str) -> object:
    """The JSON value of a file the user named (read by ``read_user_file``); ``HfMemkitError``
    saying ``name`` is not UTF-8, empty or not valid JSON (where, never what), then ``fix``."""
    import json

    data = read_user_file(path, what=what, cap=cap, name=name)
    try:
        return json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise HfMemkitError(f"{name} is not UTF-8 text (byte 0x{data[exc.start]:02x} at offset "
                            f"{exc.start}); {fix}") from None
    except ValueError as exc:  # JSONDecodeError, or an integer of over 4300 digits
        why = "empty" if not data.strip() else "not valid JSON" + (
            f" (line {exc.lineno}, column {exc.colno}: {exc.msg})"
            if isinstance(exc, json.JSONDecodeError) else f" ({excerpt(exc)})")
        raise HfMemkitError(f"{name} is {why}; {fix}") from None
    except RecursionError:  # arrays or objects nested thousands deep
        raise HfMemkitError(f"{name} nests too deep to read; {fix}") from None
