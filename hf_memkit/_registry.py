"""One registry per concept that varies (optimizers, engines, techniques, methods, tasks).

Each entry lives in a file of its own and calls ``REGISTRY.register(entry)`` at import; the
package's ``__init__`` imports every entry file, so importing the package fills its registry.
Lookups of an unknown name raise ``HfMemkitError`` naming what is allowed (STYLE.md §2).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Generic, TypeVar

from ._errors import HfMemkitError, did_you_mean

T = TypeVar("T")


class Registry(Generic[T]):
    """Name -> entry, in registration order. ``kind`` names the concept in error messages."""

    def __init__(self, kind: str, hint: str = "") -> None:
        self.kind = kind
        self.hint = hint
        self._entries: dict[str, T] = {}
        self._aliases: dict[str, str] = {}

    def register(self, entry: T, *aliases: str) -> T:
        name = entry.name  # type: ignore[attr-defined]
        if name in self._entries or name in self._aliases:
            raise ValueError(f"{self.kind} `{name}` is registered twice")
        self._entries[name] = entry
        for a in aliases:
            self._aliases[a] = name
        return entry

    def unregister(self, name: str) -> None:
        """Remove an entry (tests register temporary ones)."""
        self._entries.pop(name, None)
        for a in [a for a, n in self._aliases.items() if n == name]:
            del self._aliases[a]

    def canonical(self, name: str) -> str | None:
        key = str(getattr(name, "value", name))
        if key in self._entries:
            return key
        return self._aliases.get(key)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self.canonical(name) is not None

    def get(self, name: str) -> T:
        key = self.canonical(name)
        if key is None:
            raw = str(getattr(name, "value", name))
            raise HfMemkitError(
                f"unknown {self.kind} `{raw}`{did_you_mean(raw, self.names(aliases=True))}; "
                f"allowed: {', '.join(self.names())}{self.hint}")
        return self._entries[key]

    def names(self, *, aliases: bool = False) -> list[str]:
        out = list(self._entries)
        return out + list(self._aliases) if aliases else out

    def __iter__(self) -> Iterator[T]:
        return iter(list(self._entries.values()))

    def __len__(self) -> int:
        return len(self._entries)
