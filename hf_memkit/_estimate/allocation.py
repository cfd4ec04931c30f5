"""``peak_reserved`` on CUDA: replay the traced step's allocations and frees through the model of
the caching allocator (``_cuda.allocator``), the way a Trainer runs it:

1. the weights (and the step's inputs) are allocated, then the two cuBLAS workspaces at the
   first matmul;
2. step 1: the traced micro-steps (activations, temporaries, gradients created in the backward);
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
Not modelled here: sharded engines' own buffers (their states are replayed unsharded) and the
allocator's memory release when the device is nearly full (it then frees cached segments and
retries, so reserved can stay below this figure instead of failing).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from .._cuda.allocator import AllocatorConfig, ReplayStats, replay
from .._cuda.events import ALLOC, FREE, MARK

Event = tuple[str, Any, int]


def _split(events: list[Event], micro_steps: int) -> tuple[list[Event], list[Event]]:
    """(what exists before the step: weights, inputs; the first ``micro_steps`` micro-steps)."""
    first = next((i for i, e in enumerate(events) if e[0] == MARK), len(events))
    body, seen = [], 0
    for e in events[first:]:
        if e[0] == MARK:
            seen += 1
            if seen > micro_steps:
                break
        else:
            body.append(e)
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
    first ``micro_steps`` traced micro-steps: 1 without gradient accumulation)."""
    prefix, body = _split(events, micro_steps)
    kept = {h for op, h, _ in prefix if op == ALLOC}
    dropped: set = set()  # storages of the prefix the step frees (e.g. a replaced buffer)
    yield from prefix
    for i, nbytes in enumerate(workspaces):
        yield ALLOC, ("cublas", i), nbytes
    for step in (1, 2):
        live: set = set()
        for op, h, nbytes in body:
            key = h if h in kept else (step, h)
            if op == ALLOC:
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
                micro_steps: int = 2, config: AllocatorConfig | None = None) -> ReplayStats:
    return replay(step_events(events, trainable, state_ratio=state_ratio,
                              transient_ratio=transient_ratio, workspaces=workspaces,
                              optimizer=optimizer, micro_steps=micro_steps),
                  config or AllocatorConfig.from_env())


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
