"""Data-parallel engines, one registered ``Engine`` per file (see ``base``): single device, DDP,
FSDP2 and DeepSpeed ZeRO-1/2/3 (+ CPU offload); ``dims``: the run's parallel degrees
(``ParallelDims``); ``launch``: launch command lines and communication per step.

What a new engine or parallel dimension touches: docs/extending.md. The libraries' behaviour
the engines follow: docs/stack-facts.md (#fsdp2-and-deepspeed-offload, #fsdp-argument-form,
#deepspeed-zero-buffers). Imports the ground floor only (``_errors``, ``_units``,
``_registry``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .._errors import ConfigError, HfMemkitError

# isort: off
from . import single, ddp, fsdp, deepspeed  # noqa: F401  (registers, in this order)
# isort: on
from .base import (
    ENGINES,
    EmitContext,
    Engine,
    RankStates,
    ReferenceSizes,
    Rung,
    Sharding,
    StateSizes,
    all_rungs,
    engine_choices,
    engine_stage,
)
from .deepspeed import deepspeed_config_for, validate_deepspeed_config
from .dims import (
    ParallelDims,
    all_ones,
    dims_problems,
    engine_problems,
    read_dims,
    settled,
)
from .fsdp import FSDP_CONFIG_KEYS, fsdp_config_for, fsdp_plugin_args, validate_fsdp_config
from .launch import comm_bytes_per_step, comm_seconds, launch_commands


def sharding_from_args(get, num_gpus: int | None) -> tuple[Sharding, ParallelDims, list[str]]:
    """``get(field)`` reads a TrainingArguments field. Returns the sharding, the run's parallel
    dimensions (``parallelism_config``; without it every rank is a data-parallel rank) and
    notes. ``Sharding.world_size`` is the ranks the engine shares one replica's states over:
    FSDP's ``dp_shard x cp`` mesh (HSDP replicates it ``dp_replicate`` times), every rank for
    ZeRO (DeepSpeed's SP overlays its data parallelism), the replicas for DDP."""
    notes: list[str] = []
    given = read_dims(get("parallelism_config"))
    world = int(num_gpus or (given.total if given is not None else 1))
    chosen = [e for e in ENGINES if e.selected(get)]
    if len(chosen) > 1:
        raise HfMemkitError(f"both {' and '.join(f'`{e.name}`' for e in chosen)} are set; "
                            "choose one engine")
    if chosen and num_gpus is None and given is None:
        notes.append(f"{'/'.join(e.name for e in ENGINES if e.sharded)} given without num_gpus: "
                     "estimated for 1 rank; pass num_gpus=N for the per-rank memory of N ranks")
    name = chosen[0].name if chosen else "ddp" if world > 1 else "none"
    if all_ones(given, world):
        notes.append(f"parallelism_config of all ones on {world} processes: accelerate builds "
                     "no device mesh for it and runs plain data parallelism over every process "
                     f"(ParallelismConfig._validate_accelerator; under DDP dp_replicate_size="
                     f"{world})")
        given = None
    if given is not None:
        problems = dims_problems(given, processes=world, engine=name)
        if problems:
            raise ConfigError(problems, source="parallelism_config")
    dims = settled(given, world, name)
    if name == "ddp" and dims.data_parallel == 1:
        name = "none"   # tensor parallelism alone: no data-parallel engine
    shard = {"fsdp": dims.shard_group, "deepspeed": world, "ddp": dims.data_parallel}.get(name, 1)
    sh = ENGINES.get(name).from_args(get, shard)
    return dataclasses.replace(sh, replicas=dims.dp_replicate if name == "fsdp" else 1), dims, \
        notes


def rank_states(sh: Sharding, sizes: StateSizes, *, facts: Any, device_kind: str) -> RankStates:
    """Per-rank model states of ``sh`` for a replica of ``sizes``."""
    engine = ENGINES.get(sh.engine)
    if engine.sharded and facts is None:
        raise HfMemkitError(f"{sh.label()} needs the model's layer structure")
    return engine.rank_states(sh, sizes, facts, device_kind)


__all__ = ["ENGINES", "ParallelDims", "EmitContext", "Engine", "FSDP_CONFIG_KEYS", "RankStates",
           "ReferenceSizes", "Rung",
           "Sharding", "StateSizes", "all_rungs", "comm_bytes_per_step", "comm_seconds",
           "deepspeed_config_for", "engine_choices", "engine_stage", "engine_problems", "fsdp_config_for", "fsdp_plugin_args",
           "launch_commands", "rank_states", "sharding_from_args", "validate_deepspeed_config",
           "validate_fsdp_config"]
