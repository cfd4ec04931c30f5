"""Data-parallel engines, one registered ``Engine`` per file (see ``base``): single device, DDP,
FSDP2 and DeepSpeed ZeRO-1/2/3 (+ CPU offload)."""

from __future__ import annotations

from typing import Any

from .._errors import HfMemkitError

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
)
from .deepspeed import deepspeed_config_for, validate_deepspeed_config
from .fsdp import FSDP_CONFIG_KEYS, fsdp_config_for, fsdp_plugin_args, validate_fsdp_config
from .launch import comm_bytes_per_step, comm_seconds, launch_commands


def sharding_from_args(get, num_gpus: int | None) -> tuple[Sharding, list[str]]:
    """``get(field)`` reads a TrainingArguments field. Returns the sharding and notes."""
    notes: list[str] = []
    world = int(num_gpus or 1)
    chosen = [e for e in ENGINES if e.selected(get)]
    if len(chosen) > 1:
        raise HfMemkitError(f"both {' and '.join(f'`{e.name}`' for e in chosen)} are set; "
                            "choose one engine")
    if chosen and num_gpus is None:
        notes.append(f"{'/'.join(e.name for e in ENGINES if e.sharded)} given without num_gpus: "
                     "estimated for 1 rank; pass num_gpus=N for the per-rank memory of N ranks")
    if chosen:
        return chosen[0].from_args(get, world), notes
    return ENGINES.get("ddp" if world > 1 else "none").from_args(get, world), notes


def rank_states(sh: Sharding, sizes: StateSizes, *, facts: Any, device_kind: str) -> RankStates:
    """Per-rank model states of ``sh`` for a replica of ``sizes``."""
    engine = ENGINES.get(sh.engine)
    if engine.sharded and facts is None:
        raise HfMemkitError(f"{sh.label()} needs the model's layer structure")
    return engine.rank_states(sh, sizes, facts, device_kind)


__all__ = ["ENGINES", "EmitContext", "Engine", "FSDP_CONFIG_KEYS", "RankStates",
           "ReferenceSizes", "Rung",
           "Sharding", "StateSizes", "all_rungs", "comm_bytes_per_step", "comm_seconds",
           "deepspeed_config_for", "engine_choices", "fsdp_config_for", "fsdp_plugin_args",
           "launch_commands", "rank_states", "sharding_from_args", "validate_deepspeed_config",
           "validate_fsdp_config"]
