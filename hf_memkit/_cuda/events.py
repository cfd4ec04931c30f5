"""The allocation and free events of a traced step, for the caching-allocator replay
(``_cuda.allocator``, ``_estimate.allocation``).

MemTracker (``_trace.step``) registers every tensor storage it sees and is called back when one dies.
Each micro-step has its own tracker, and a tracker registers the storages still alive from the
previous one (weights, inputs, gradients), so events are keyed by the storage itself: an
allocation is logged the first time a storage is seen, a free the first time one of the trackers
is called back for it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

ALLOC, FREE, MARK = "alloc", "free", "mark"


@dataclass
class EventLog:
    """``events``: (ALLOC, handle, bytes), (FREE, handle, 0) or (MARK, name, 0) in order."""

    events: list[tuple[str, Any, int]] = field(default_factory=list)
    _live: dict[int, int] = field(default_factory=dict)
    _ids: Any = field(default_factory=itertools.count)

    def seen(self, storage: Any, nbytes: int) -> Any:
        """Log a storage's allocation (once); returns the key its free is logged under."""
        key = storage._cdata
        if key not in self._live and nbytes > 0:
            self._live[key] = h = next(self._ids)
            self.events.append((ALLOC, h, int(nbytes)))
        return key

    def gone(self, key: Any) -> None:
        h = self._live.pop(key, None)
        if h is not None:
            self.events.append((FREE, h, 0))

    def mark(self, name: str) -> None:
        self.events.append((MARK, name, 0))
