"""One registry per concept that varies (optimizers, engines, techniques, methods, tasks).

Each entry lives in a file of its own and calls ``REGISTRY.register(entry)`` at import; the
package's ``__init__`` imports every entry file, so importing the package fills its registry.
Lookups of an unknown name raise ``HfMemkitError`` naming what is allowed (docs/style.md §2); a
name a registry refuses on purpose is recorded with why (``refuse`` / ``refusal``: an optimizer
whose memory is not modelled), for the registry's owner to say in its own words.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from ._errors import HfMemkitError, did_you_mean

T = TypeVar("T")


class Registry(Generic[T]):
    """Name -> entry, in registration order. ``kind`` names the concept in error messages;
    ``normalize`` maps a name or alias to its lookup key (default: as written; the GPU catalog
    ignores case, punctuation and vendor words)."""

    def __init__(self, kind: str, hint: str = "",
                 normalize: Callable[[str], str] | None = None) -> None:
        self.kind = kind
        self.hint = hint
        self._normalize = normalize or (lambda name: name)
        self._entries: dict[str, T] = {}
        self._aliases: dict[str, str] = {}     # alias as written -> entry name
        self._keys: dict[str, str] = {}        # lookup key of a name or alias -> entry name
        self._refused: dict[str, str] = {}     # lookup key -> why it is not modelled

    def register(self, entry: T, *aliases: str) -> T:
        name = entry.name  # type: ignore[attr-defined]
        if name in self._entries:
            raise ValueError(f"{self.kind} `{name}` is registered twice")
        for n in (name, *aliases):
            key = self._normalize(n)
            if self._keys.get(key, name) != name:   # spellings of one entry may coincide
                raise ValueError(f"{self.kind} `{n}` is registered twice")
            self._keys[key] = name
        self._entries[name] = entry
        self._aliases.update({a: name for a in aliases})
        return entry

    def unregister(self, name: str) -> None:
        """Remove an entry (tests register temporary ones)."""
        self._entries.pop(name, None)
        for a in [a for a, n in self._aliases.items() if n == name]:
            del self._aliases[a]
        for k in [k for k, n in self._keys.items() if n == name]:
            del self._keys[k]

    def refuse(self, name: str, why: str) -> None:
        """A name users may give whose entry is deliberately missing, and why (``refusal``)."""
        self._refused[self._normalize(name)] = why

    def refusal(self, name: str) -> str | None:
        return self._refused.get(self._normalize(str(getattr(name, "value", name))))

    def canonical(self, name: str) -> str | None:
        return self._keys.get(self._normalize(str(getattr(name, "value", name))))

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
