"""The allocation and free events of a traced step, for the caching-allocator replay
(``_cuda.allocator``, ``_estimate.allocation``).

MemTracker (``_trace.step``) registers every tensor storage it sees and is called back when one dies.
Each micro-step has its own tracker, and a tracker registers the storages still alive from the
previous one (weights, inputs, gradients), so events are keyed by the storage itself: an
allocation is logged the first time a storage is seen, a free the first time one of the trackers
is called back for it.

Each event also records *where* it happened: the transformer block running at that moment
(``(stack, index)``; a stack is one ``ModuleList`` of blocks, e.g. a decoder's layers) or None
outside any block, and whether autograd's backward was running. Each allocation records its
*owner*: the block whose weights it is, else the block it was made in. ``_estimate.allocation``
builds a deep model's stream from these tags (a per-block periodic pattern with explicit
lifetimes).

Two marks besides the micro-steps' say where torch allocates the cuBLAS workspaces: at the first
matmul of each thread (``CublasHandlePool.cpp``: ``getCUDABlasWorkspace`` allocates one through
the caching allocator the first time a (handle, stream) pair is used, and each thread has its own
handle), the forward's on the main thread and the backward's on autograd's. ``EventLog.matmul``
logs ``WORKSPACE_MARKS[backward]`` after the first matmul's output in each direction.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

ALLOC, FREE, MARK = "alloc", "free", "mark"

Where = tuple[Any, bool]  # (block or None, in backward)
# where the forward thread's and autograd's cuBLAS workspaces are allocated (index: in backward)
WORKSPACE_MARKS = ("cublas:forward", "cublas:backward")


@dataclass
class EventLog:
    """``events``: (ALLOC, handle, bytes), (FREE, handle, 0) or (MARK, name, 0) in order;
    ``where[i]``: the block and direction of ``events[i]``; ``owner``: handle -> block."""

    events: list[tuple[str, Any, int]] = field(default_factory=list)
    where: list[Where] = field(default_factory=list)
    owner: dict[Any, Any] = field(default_factory=dict)
    blocks: int = 0  # blocks per stack (0: not tagged)
    _live: dict[int, int] = field(default_factory=dict)
    _ids: Any = field(default_factory=itertools.count)
    # set by the tracer: the block running now and whether backward runs, and the owning block
    # of a storage that belongs to a block's weights (by its key)
    context: Callable[[], Where] | None = field(default=None, repr=False)
    weight_owner: dict[Any, Any] = field(default_factory=dict, repr=False)
    _matmuls: set = field(default_factory=set, repr=False)  # directions whose mark is logged

    def _here(self) -> Where:
        return self.context() if self.context is not None else (None, False)

    def seen(self, storage: Any, nbytes: int) -> Any:
        """Log a storage's allocation (once); returns the key its free is logged under."""
        key = storage._cdata
        if key not in self._live and nbytes > 0:
            self._live[key] = h = next(self._ids)
            here = self._here()
            self.events.append((ALLOC, h, int(nbytes)))
            self.where.append(here)
            self.owner[h] = self.weight_owner.get(key, here[0])
        return key

    def gone(self, key: Any) -> None:
        h = self._live.pop(key, None)
        if h is not None:
            self.events.append((FREE, h, 0))
            self.where.append(self._here())

    def matmul(self) -> None:
        """A matmul ran (its output already logged): the first in each direction marks where
        that thread's cuBLAS workspace is allocated (``WORKSPACE_MARKS``)."""
        here = self._here()
        if here[1] not in self._matmuls:
            self._matmuls.add(here[1])
            self.events.append((MARK, WORKSPACE_MARKS[here[1]], 0))
            self.where.append(here)

    def mark(self, name: str) -> None:
        self.events.append((MARK, name, 0))
        self.where.append((None, False))

    def to_dict(self) -> dict[str, Any]:
        """What the replay reads (events, where, owner, blocks) as JSON data (the trace store,
        ``_store``); the tracer's own state is left out."""
        return {"events": [list(e) for e in self.events],
                "where": [[_listed(b), back] for b, back in self.where],
                "owner": [[h, _listed(b)] for h, b in self.owner.items()],
                "blocks": self.blocks}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EventLog:
        """``to_dict`` read back; malformed data raises ``ValueError`` or ``TypeError``."""
        events = [(str(op), h if op == MARK else int(h), int(n)) for op, h, n in d["events"]]
        if any(op not in (ALLOC, FREE, MARK) for op, _, _ in events):
            raise ValueError("unknown event")
        where = [(_block(b), bool(back)) for b, back in d["where"]]
        if len(where) != len(events):
            raise ValueError("events and where differ in length")
        return cls(events=events, where=where,
                   owner={int(h): _block(b) for h, b in d["owner"]}, blocks=int(d["blocks"]))


def _listed(block: Any) -> Any:
    return None if block is None else list(block)


def _block(b: Any) -> tuple[int, int] | None:
    if b is None:
        return None
    s, i = b
    return int(s), int(i)
