"""Plans that split each sequence over several ranks: context parallelism (torch ring attention
over FSDP2, accelerate's ``ParallelismConfig(cp_size=...)``).

Tried when the ranks cannot each hold whole sequences: no setup fits with them, or the target
batch has fewer sequences than there are ranks (one million-token sequence per step on 8 GPUs).
The degree grows from the smallest that divides the ranks (the rest stay data-parallel, and
FSDP shards over ``dp_shard x cp`` all the same); for each, allgather (one collective, the whole
key/value held during attention) before alltoall (a ring: two chunks in flight), as the
planner takes memory savers: the fastest setup that fits. Within a degree the usual search
chooses the method, precision, checkpointing and its offload, and the loss head.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from .._engines.dims import CP_STRATEGIES
from .._errors import ConfigError, HfMemkitError
from .request import PlanRequest


def degrees(req: PlanRequest) -> list[int]:
    """Context-parallel degrees to try: divisors of the ranks above 1 that leave a data-parallel
    degree dividing the target batch."""
    return [cp for cp in range(2, req.ranks + 1)
            if req.ranks % cp == 0 and req.target_batch_size % (req.ranks // cp) == 0]


def plan_split(req: PlanRequest, plan: Callable[[PlanRequest], Any],
               why: HfMemkitError | None) -> Any:
    """The fastest plan that splits sequences (``plan`` runs one request's search); ``why``:
    the error of the search with whole sequences per rank (None: it was not possible)."""
    last: HfMemkitError | None = None
    for cp in degrees(req):
        for comm in CP_STRATEGIES:
            sub = dataclasses.replace(req, cp=cp, cp_comm=comm)
            sub.__dict__["dev"] = req.dev   # probed once (a cached_property)
            try:
                out = plan(sub)
            except ConfigError:
                raise
            except HfMemkitError as exc:
                last = exc
                continue
            out.notes.insert(0, _why_split(req, cp, comm, why))
            return out
    if last is None:
        raise why or HfMemkitError("no context-parallel degree divides the ranks")
    lead = f"{why}\n" if why is not None else ""
    raise HfMemkitError(f"{lead}with each sequence split over up to {req.ranks} ranks (context "
                        f"parallelism) it does not fit either: {last}") from last


def _why_split(req: PlanRequest, cp: int, comm: str, why: HfMemkitError | None) -> str:
    reason = (f"no setup holds whole {req.seq_len}-token sequences on one rank"
              if why is not None else
              f"{req.target_batch_size} sequence(s) per step on {req.ranks} ranks")
    return (f"context parallelism x{cp}: {reason}, so each sequence is split over {cp} ranks "
            f"(torch ring attention, cp_comm_strategy={comm!r}; {req.ranks // cp} data-parallel "
            f"group(s)); attention runs on SDPA, sequences are padded to a multiple of {2 * cp} "
            "tokens, and TRL refuses packing with it")
