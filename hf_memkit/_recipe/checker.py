"""``Checker``: the problems of a recipe, gathered as ``WHERE: KEY: message`` and raised together
(STYLE.md §7), shared by the section validators (``validate``) and the pins (``validate_pins``)."""

from __future__ import annotations

from typing import Any


def describe(v: Any) -> str:
    """A value as a problem quotes it: numbers written as strings and booleans say so."""
    if isinstance(v, str):
        return f"{v!r} (a string)" if v.strip().lstrip("-").replace(".", "", 1).isdigit() else repr(v)
    if isinstance(v, bool):
        return f"{v!r} (a boolean)"
    return repr(v)


class Checker:
    """Collects problems as ``WHERE: KEY: message``; the typed getters add one when a value has
    the wrong type and return None."""

    def __init__(self, where: str):
        self.where = where
        self.problems: list[str] = []

    def add(self, key: str, msg: str) -> None:
        self.problems.append(f"{self.where}: {key}: {msg}")

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
