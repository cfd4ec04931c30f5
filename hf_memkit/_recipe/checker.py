"""``Checker``: the problems of a recipe, gathered as ``WHERE: KEY: message`` and raised together
(docs/style.md §7), shared by the section validators (``validate``) and the pins
(``validate_pins``)."""

from __future__ import annotations

from typing import Any

from .._errors import excerpt, quoted


def describe(v: Any) -> str:
    """A value as a problem quotes it (at most an excerpt): numbers written as strings and
    booleans say so."""
    if isinstance(v, str):
        number = v[:100].strip().lstrip("-").replace(".", "", 1).isdigit() and len(v) < 100
        return f"{quoted(v)} (a string)" if number else quoted(v)
    if isinstance(v, bool):
        return f"{v!r} (a boolean)"
    return quoted(v)


class Checker:
    """Collects problems as ``WHERE: KEY: message``; the typed getters add one when a value has
    the wrong type and return None."""

    def __init__(self, where: str):
        self.where = where
        self.problems: list[str] = []

    def add(self, key: str, msg: str) -> None:
        """``key``: where in the recipe (a key read from the file is quoted as an excerpt)."""
        self.problems.append(f"{self.where}: {excerpt(key)}: {msg}")

    def positive_int(self, key: str, v: Any) -> int | None:
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
        self.add(key, f"expected a positive integer, got {describe(v)}")
        return None

    def string(self, key: str, v: Any) -> str | None:
        if isinstance(v, str) and v:
            return v
        self.add(key, f"expected a non-empty string, got {describe(v)}")
        return None

    def mapping(self, key: str, v: Any) -> dict | None:
        if isinstance(v, dict):
            return v
        self.add(key, f"expected a mapping (key: value lines), got {describe(v)}")
        return None
