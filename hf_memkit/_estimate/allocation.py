"""``peak_reserved`` on CUDA: replay the traced step's allocations and frees through the model of
the caching allocator (``_cuda.allocator``), the way a Trainer runs it:

1. the weights (and the step's inputs) are allocated;
2. step 1: the traced micro-steps (activations, temporaries, gradients created in the backward),
   with each thread's cuBLAS workspace allocated after its first matmul's output, where the trace
   marks it (``WORKSPACE_MARKS``): the forward's on the main thread, the backward's on autograd's
   (``CublasHandlePool.cpp`` allocates one per handle and stream on first use, through the caching
   allocator, and keeps it). The backward's lands in whatever the forward freed (the loss's
   freed logits): a block it splits stays split, and a block of that size in step 2 needs a new
   segment. A trace without the marks has them after the weights;
   then the optimizer step, which creates its state lazily (``torch.optim`` initialises
   ``exp_avg``/``exp_avg_sq`` at the first ``step()``) into space the freed activations left,
   then its transient buffers; then ``zero_grad(set_to_none=True)`` frees the gradients;
3. step 2, the steady state: the same micro-steps and optimizer transients again, now with the
   optimizer state in place. Reserved memory is never returned (no ``empty_cache``), so the peak
   over both steps is the steady state's.

A deep model is traced at 2 and 3 blocks; ``deepen`` builds its full-depth event stream by
repeating the events the third block adds (checked against the replay of a full-depth trace in
tests/unit/cuda/test_cuda_fidelity.py). Fragmentation is not extrapolated: which cached block a
request lands in is discrete, and neither a line through two shallow replays nor their ratio
transfers (off by 0.16x to 4x on bert-base, GPT-2 and an 8-block Llama when we tried). Optimizer
state is laid out per trainable parameter in the proportion ``_optimizers`` gives for the whole
model.
The allocator's release on a nearly full device is replayed too: with a ``capacity``
(``replay_step``) it frees its cached segments and retries before an OOM, as CUDA's does, which
``device`` uses for the smallest capacity a step completes in (``required``) and for the step at
the device's own memory. Not modelled here: sharded engines' own buffers (their states are
replayed unsharded).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from .._cuda.allocator import AllocatorConfig, ReplayStats, replay
from .._cuda.events import ALLOC, FREE, MARK, WORKSPACE_MARKS, EventLog

Event = tuple[str, Any, int]


def _split(events: list[Event], micro_steps: int) -> tuple[list[Event], list[Event]]:
    """(what exists before the step: weights, inputs; the first ``micro_steps`` micro-steps,
    with their workspace marks)."""
    first = next((i for i, e in enumerate(events) if e[0] == MARK), len(events))
    body, seen = [], 0
    for e in events[first:]:
        if e[0] != MARK or e[1] in WORKSPACE_MARKS:
            body.append(e)
            continue
        seen += 1
        if seen > micro_steps:
            break
    return events[:first], body


def _optimizer_events(step: int, trainable: tuple[int, ...], state_ratio: float,
                      transient_ratio: float) -> Iterator[Event]:
    """``optimizer.step()``: the state at the first step (two tensors per parameter for Adam's
    moments), then the step's transient buffers, freed at its end."""
    copies = 2 if state_ratio >= 1.5 else 1
    if step == 1 and state_ratio > 0:
        for i, nbytes in enumerate(trainable):
            for j in range(copies):
                yield ALLOC, ("state", i, j), int(nbytes * state_ratio / copies)
    if transient_ratio > 0:
        tmp = [("tmp", step, i) for i in range(len(trainable))]
        for key, nbytes in zip(tmp, trainable, strict=True):
            yield ALLOC, key, int(nbytes * transient_ratio)
        for key in tmp:
            yield FREE, key, 0


def step_events(events: list[Event], trainable: tuple[int, ...], *, state_ratio: float,
                transient_ratio: float, workspaces: tuple[int, ...] = (),
                optimizer: bool = True, micro_steps: int = 2) -> Iterator[Event]:
    """The event stream of two optimizer steps built from one traced step's ``events`` (its
    first ``micro_steps`` traced micro-steps: 1 without gradient accumulation). ``workspaces``:
    the forward thread's, then as many of autograd's; each thread's are allocated at its mark in
    step 1 (``WORKSPACE_MARKS``), after the prefix where the trace has no mark."""
    prefix, body = _split(events, micro_steps)
    kept = {h for op, h, _ in prefix if op == ALLOC}
    dropped: set = set()  # storages of the prefix the step frees (e.g. a replaced buffer)
    half = (len(workspaces) + 1) // 2
    at = {name: [(ALLOC, ("cublas", i), n) for i, n in enumerate(workspaces)
                 if (i >= half) == bool(t)] for t, name in enumerate(WORKSPACE_MARKS)}
    marked = {h for op, h, _ in body if op == MARK}
    yield from prefix
    for name in WORKSPACE_MARKS:
        if name not in marked:
            yield from at[name]
    for step in (1, 2):
        live: set = set()
        for op, h, nbytes in body:
            key = h if h in kept else (step, h)
            if op == MARK:
                if step == 1:
                    yield from at[h]
            elif op == ALLOC:
                live.add(key)
                yield ALLOC, key, nbytes
            elif key in live:
                live.discard(key)
                yield FREE, key, 0
            elif h in kept and h not in dropped:
                dropped.add(h)
                yield FREE, key, 0
        if optimizer:
            yield from _optimizer_events(step, trainable, state_ratio, transient_ratio)
        for key in sorted(live, key=repr):  # zero_grad(set_to_none=True): the gradients
            yield FREE, key, 0


def replay_step(events: list[Event], trainable: tuple[int, ...], *, state_ratio: float,
                transient_ratio: float, workspaces: tuple[int, ...] = (), optimizer: bool = True,
                micro_steps: int = 2, config: AllocatorConfig | None = None,
                capacity: int | None = None) -> ReplayStats:
    """The two-step stream replayed; with a ``capacity`` the allocator frees its cached blocks
    and retries when a request does not fit, and counts an OOM when it still does not."""
    return replay(step_events(events, trainable, state_ratio=state_ratio,
                              transient_ratio=transient_ratio, workspaces=workspaces,
                              optimizer=optimizer, micro_steps=micro_steps),
                  config or AllocatorConfig.from_env(), capacity=capacity)


def canonical(events: list[Event]) -> list[Event]:
    """``events`` with each run of consecutive frees in handle order: storages that die together
    (a graph released at once) are called back in an order that varies between identical traces,
    and the allocator's merging and best fit would follow that noise."""
    out: list[Event] = []
    run: list[Event] = []
    for e in events:
        if e[0] == FREE:
            run.append(e)
            continue
        out.extend(sorted(run, key=lambda f: repr(f[1])))
        run = []
        out.append(e)
    out.extend(sorted(run, key=lambda f: repr(f[1])))
    return out


def _runs(log: EventLog) -> Iterator[tuple[Any, bool, list[Event]]]:
    """Maximal runs of events made in one place (block or None, direction)."""
    run: list[Event] = []
    here = None
    for e, w in zip(log.events, log.where, strict=True):
        if run and w != here:
            yield *here, run
            run = []
        here = w
        run.append(e)
    if run:
        yield *here, run


class NotPeriodic(Exception):
    """The traced blocks do not repeat one pattern (``extend`` cannot build the deep stream)."""


def extend(log: EventLog, full: int) -> list[Event]:
    """The event stream of the model ``full`` blocks deep, from a trace of ``log.blocks`` (>= 3)
    blocks whose events are tagged with the block they happened in (``_cuda.events``).

    The middle block ``m`` is the template: the blocks before and after it keep their boundary
    roles (the first block reads the embeddings, the last feeds the head). Each run of events the
    template made is emitted once per added block, each copy with its own handles, in order: the
    forward's copies ascending, the backward's descending. A free names its handle's owner
    relative to the block it happens in. When the template frees what the block before it made,
    a copy frees what the copy before it made: the same allocations, in the same order, that the
    block after the template frees of the template's own (and symmetrically for the block
    after). A free outside any block of what the template owns (a graph released at once) frees
    every copy. So every allocation of the deep stream is freed where the full-depth step frees
    it, and its live bytes at every point are the step's."""
    n = log.blocks
    m, added = n // 2, full - n + 1
    if n < 3:
        raise NotPeriodic(f"{n} blocks traced: a template needs a block on either side")
    runs = list(_runs(log))
    templates = {b for b in log.owner.values() if b is not None and b[1] == m}
    occurrence: dict[tuple, list[int]] = {}
    for i, (block, backward, _) in enumerate(runs):
        occurrence.setdefault((block, backward), []).append(i)

    def frees_of_template(block: tuple, backward: bool, k: int) -> list[Any]:
        """The template's allocations that the ``k``-th run of ``block`` frees, in order."""
        at = occurrence.get((block, backward), [])
        if k >= len(at):
            raise NotPeriodic(f"block {block} has no run {k} to pattern the template's on")
        t = (block[0], m)
        return [h for op, h, _ in runs[at[k]][2] if op == FREE and log.owner.get(h) == t]

    out: list[Event] = []
    seen: dict[tuple, int] = {}
    for block, backward, run in runs:
        if block is not None and block in templates:
            k = seen[(block, backward)] = seen.get((block, backward), -1) + 1
            # what the next block frees of the template's: a copy frees as much of its
            # predecessor's; what the previous block frees of it: a copy frees of its successor
            prev = frees_of_template((block[0], m + 1), backward, k)
            succ = frees_of_template((block[0], m - 1), backward, k)
            order = range(added - 1, -1, -1) if backward else range(added)
            for i, c in enumerate(order):
                out.extend(_template_copy(run, log.owner, block, c, added, prev, succ, i == 0))
        else:
            out.extend(_outside(run, log.owner, block, templates, m, added))
    return out


def _copy(h: Any, c: int) -> tuple:
    return ("block", c, h)


def _template_copy(run: list[Event], owner: dict, block: tuple, c: int, added: int,
                   prev: list, succ: list, first: bool) -> Iterator[Event]:
    """Copy ``c`` of a run of the template ``block``: its own allocations renamed; a free of a
    neighbour's by the same offset from this copy (``prev``/``succ``: the template's own that
    the blocks after/before it free, in order); anything else once (``first``)."""
    s, m = block
    p = q = 0
    for op, h, nbytes in run:
        o = owner.get(h) if op != MARK else None
        if o == block:
            yield op, _copy(h, c), nbytes
        elif op == FREE and o is not None and o[0] == s and o[1] == m - 1:  # the previous's
            if p >= len(prev):
                raise NotPeriodic("the template frees more of its predecessor's than its "
                                  "successor frees of its own")
            yield op, h if c == 0 else _copy(prev[p], c - 1), nbytes
            p += 1
        elif op == FREE and o is not None and o[0] == s and o[1] == m + 1:  # the next's
            if q >= len(succ):
                raise NotPeriodic("the template frees more of its successor's than its "
                                  "predecessor frees of its own")
            yield op, h if c == added - 1 else _copy(succ[q], c + 1), nbytes
            q += 1
        elif op == FREE and o is not None and o[0] == s:
            raise NotPeriodic(f"block {m} frees block {o[1]}'s allocations")
        elif first:  # not the template's own (a global, another stack's): once
            yield op, h, nbytes


def _outside(run: list[Event], owner: dict, block: tuple | None, templates: set, m: int,
             added: int) -> Iterator[Event]:
    """A run outside the template: as traced, except the template's own events in it. Its
    weights (or a graph released at once) for every copy, block by block; a neighbour's free of
    the template's for the adjacent copy."""
    group: list[Event] = []
    for op, h, nbytes in run:
        o = owner.get(h) if op != MARK else None
        if o is not None and o in templates and (
                op == ALLOC or block is None or block[0] != o[0]):
            group.append((op, h, nbytes))
            continue
        yield from ((g, _copy(x, c), nb) for c in range(added) for g, x, nb in group)
        group = []
        if o is None or o not in templates:
            yield op, h, nbytes
        elif abs(block[1] - m) != 1:
            raise NotPeriodic(f"block {block[1]} frees block {m}'s allocations")
        else:
            yield op, _copy(h, 0 if block[1] < m else added - 1), nbytes
    yield from ((g, _copy(x, c), nb) for c in range(added) for g, x, nb in group)


def _keys(events: list[Event]) -> list[tuple]:
    """What aligns two traces: an allocation by its size, a free by the size it frees."""
    sizes: dict = {}
    out = []
    for op, h, nbytes in events:
        if op == ALLOC:
            sizes[h] = nbytes
            out.append((ALLOC, nbytes))
        elif op == FREE:
            out.append((FREE, sizes.get(h, 0)))
        else:
            out.append((MARK, h))
    return out


def deepen(shallow: list[Event], deeper: list[Event], extra: int) -> list[Event]:
    """The event stream of a model ``extra`` blocks deeper than ``deeper``, from traces one block
    apart: the events ``deeper`` has and ``shallow`` lacks (one block's weights, its forward
    activations, its backward temporaries and gradients, aligned with difflib on sizes) are
    repeated ``extra`` more times where they occur, each copy with its own handles; a copy frees
    only what a copy allocated."""
    from difflib import SequenceMatcher

    ops = SequenceMatcher(None, _keys(shallow), _keys(deeper), autojunk=False).get_opcodes()
    inserted = {h for tag, _, _, j1, j2 in ops if tag == "insert"
                for op, h, _ in deeper[j1:j2] if op == ALLOC}
    out: list[Event] = []
    for tag, _, _, j1, j2 in ops:
        block = deeper[j1:j2]
        out.extend(block)
        if tag != "insert":
            continue
        for c in range(1, extra + 1):
            for op, h, nbytes in block:
                if op == MARK or (op == FREE and h not in inserted):
                    continue
                out.append((op, (c, h) if h in inserted else h, nbytes))
    return out


def full_depth_events(replays: tuple[tuple[int, EventLog, tuple[int, ...]], ...],
                      full: int) -> tuple[list[Event], str]:
    """The full-depth step's event stream from the traces of ``replays`` (blocks traced, log,
    trainable bytes), and how it was made: "traced" (the model traced at full depth),
    "extended" (``extend``: exact) or "deepened" (``deepen``, for blocks that do not repeat one
    pattern: approximate)."""
    reps = sorted(replays, key=lambda r: r[0])
    n2, log2 = reps[-1][0], reps[-1][1]
    if n2 == full:
        return canonical(log2.events), "traced"
    try:
        return canonical(extend(log2, full)), "extended"
    except NotPeriodic:
        n1, log1 = reps[0][0], reps[0][1]
        if n1 == n2:
            return canonical(log2.events), "traced"
        return deepen(canonical(log1.events), canonical(log2.events), full - n2), "deepened"

