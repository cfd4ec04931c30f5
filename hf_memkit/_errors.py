"""Errors that tell the user what was wrong, what is allowed, and how to fix it."""

from __future__ import annotations

import difflib
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


def excerpt(value: object, limit: int = 60) -> str:
    """``repr(value)`` as a message quotes it: at most ``limit`` characters (what was read may be
    a tampered file's megabytes)."""
    text = repr(getattr(value, "value", value))  # an enum member as the value it stands for
    return text if len(text) <= limit else text[:limit - 3] + "..."
