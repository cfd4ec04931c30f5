"""DDP (the Trainer through accelerate): a full replica per rank, plus the reducer's gradient
buckets, which are separate memory of the gradients' size unless ``gradient_as_bucket_view=True``
(torch ``DistributedDataParallel``; accelerate's default leaves it False). The reducer's buckets
(``ddp_bucket_cap_mb`` each) together hold every gradient, whatever their size."""

from __future__ import annotations

from typing import Any

from .base import EmitContext, Engine, RankStates, Rung, Sharding, StateSizes, register
from .dims import ParallelDims

RUNG = Rung("ddp", "DDP", "ddp", replica=True)


class DDP(Engine):
    name = "ddp"
    replicates = True
    launch_flag = "--multi_gpu"
    accelerate_type = "MULTI_GPU"

    def from_args(self, get, world: int) -> Sharding:
        return Sharding("ddp", world, 0)

    def label(self, sh: Sharding) -> str:
        return f"DDP x{sh.world_size}"

    def rungs(self) -> list[Rung]:
        return [RUNG]

    def rank_states(self, sh: Sharding, sizes: StateSizes, facts: Any,
                    device_kind: str) -> RankStates:
        r = RankStates(sizes.weight_bytes, sizes.grad_bytes, sizes.optimizer_state,
                       sizes.optimizer_transient)
        if not sh.grad_as_bucket_view:
            r.buckets = sizes.grad_bytes
            r.notes.append(f"DDP gradient buckets: {sizes.grad_bytes / 2**30:.2f} GiB, a second "
                           "copy of the gradients (gradient_as_bucket_view=False, accelerate's "
                           "default)")
        return r

    def emit(self, rung: Rung, ctx: EmitContext) -> dict[str, Any]:
        return {"ddp_find_unused_parameters": False}

    def check_emitted(self, ta: dict[str, Any], sh: Sharding, dims: ParallelDims,
                      notes: list[str]) -> None:
        notes.append(f"DDP: every rank holds a full replica ({sh.world_size} ranks); it fits, "
                     "so no sharding (the fastest data-parallel engine)")

    def comm_bytes_per_step(self, sh: Sharding, *, n_params: int, n_trainable: int,
                            grad_accum: int, mixed_precision: bool) -> float:
        # one all-reduce of the gradients per step: the Trainer skips it on non-final micro-steps
        ring = (sh.world_size - 1) / sh.world_size
        return 2 * ring * n_trainable * (2 if mixed_precision else 4)


DDP_ENGINE = register(DDP())
