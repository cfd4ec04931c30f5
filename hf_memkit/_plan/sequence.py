"""Plans that split each sequence over several ranks, as the sharding engine runs it
(``Engine.sequence_splits``): context parallelism on FSDP2 (torch ring attention, accelerate's
``ParallelismConfig(cp_size=...)``), sequence parallelism on DeepSpeed (Ulysses, ``sp_size``).

Tried when the ranks cannot each hold whole sequences: no setup fits with them, or the target
batch has fewer sequences than there are ranks (one million-token sequence per step on 8 GPUs).
The degree grows from the smallest that divides the ranks (the rest stay data-parallel; FSDP
shards over ``dp_shard x cp`` and ZeRO over every rank all the same); within a degree the
engine's splits come in its order (for context parallelism allgather, one collective with the
whole key/value held during attention, before alltoall, a ring with two chunks in flight), as
the planner takes memory savers: the fastest setup that fits.
The most split (the most ranks, the ring) is tried first: where it does not fit, no split does,
and the plan says so after one search instead of one per degree and strategy.
Within a split the usual search chooses the method, precision, checkpointing and its offload,
and the loss head.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator
from typing import Any

from .._errors import ConfigError, HfMemkitError
from .._model.spec import resolve_model
from .request import PlanRequest


def degrees(req: PlanRequest) -> list[int]:
    """Degrees to try: divisors of the ranks above 1 that leave a data-parallel degree dividing
    the target batch."""
    return [d for d in range(2, req.ranks + 1)
            if req.ranks % d == 0 and req.target_batch_size % (req.ranks // d) == 0]


def _heads(req: PlanRequest) -> Callable[[], int]:
    """The model's attention heads, read on first use (only an engine that splits heads asks)."""
    @functools.cache
    def heads() -> int:
        text = resolve_model(req.model, task=req.task).config.get_text_config()
        return int(getattr(text, "num_attention_heads", 0) or 0)
    return heads


def _splits(req: PlanRequest) -> Iterator[tuple[PlanRequest, str]]:
    """Each split request in the order tried, with the note that explains it."""
    engine, heads = req.sharding_engine, _heads(req)
    for degree in degrees(req):
        for dims in engine.sequence_splits(degree, heads):
            yield dataclasses.replace(req, split=dims), engine.split_note(dims, req.ranks)


def plan_split(req: PlanRequest, plan: Callable[[PlanRequest], Any],
               why: HfMemkitError | None) -> Any:
    """The fastest plan that splits sequences (``plan`` runs one request's search); ``why``:
    the error of the search with whole sequences per rank (None: it was not possible)."""
    last: HfMemkitError | None = None
    splits = list(_splits(req))
    for sub, _ in splits:
        sub.__dict__["dev"] = req.dev   # probed once (a cached_property)
    most_split = None  # the last split holds the least per rank (the most ranks; for CP the
    # ring, whose buffers shrink with the degree): where it does not fit, no other does
    if len(splits) > 1:
        try:
            most_split = plan(splits[-1][0])
        except ConfigError:
            raise
        except HfMemkitError as exc:
            splits, last = [], exc
    for i, (sub, what) in enumerate(splits):
        try:
            out = most_split if i == len(splits) - 1 and most_split is not None else plan(sub)
        except ConfigError:
            raise
        except HfMemkitError as exc:
            last = exc
            continue
        reason = (f"no setup holds whole {req.seq_len}-token sequences on one rank"
                  if why is not None else
                  f"{req.target_batch_size} sequence(s) per step on {req.ranks} ranks")
        out.notes.insert(0, f"{what}; chosen because {reason}")
        return out
    kind = req.sharding_engine.split_kind
    if last is None:
        raise why or HfMemkitError(f"no {kind}-parallel degree divides the {req.ranks} ranks "
                                   "(and, for Ulysses, the attention heads)")
    lead = f"{why}\n" if why is not None else ""
    raise HfMemkitError(f"{lead}with each sequence split over up to {req.ranks} ranks ({kind} "
                        f"parallelism) it does not fit either: {last}") from last
