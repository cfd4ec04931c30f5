"""``MemoryCallback``'s readings across ranks: the maximum over every rank, and which rank has it.

Under DDP, FSDP or ZeRO each rank reads its own device; ranks differ (ZeRO's and FSDP's shards are
uneven, rank 0 often holds more). At a logging step every rank takes part in one
``all_reduce(MAX)`` of an int64 tensor, one entry per reading, each encoded as
``value * world_size + (world_size - 1 - rank)``: the maximum decodes to the largest value and,
among ranks that share it, the lowest rank holding it. A reading a rank does not have is ``-1``,
below every real one. The tensor lives where the backend reduces: the CPU for gloo (and a
``cpu:gloo,cuda:nccl`` pair), the rank's CUDA device for NCCL (reading the result back then
waits for the device: at logging steps only).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

logger = logging.getLogger(__name__)


def world() -> tuple[int, int] | None:
    """``(rank, world_size)`` when torch.distributed runs with more than one rank, else None."""
    dist = torch.distributed
    try:
        if not (dist.is_available() and dist.is_initialized()):
            return None
        size = dist.get_world_size()
        return (dist.get_rank(), size) if size > 1 else None
    except Exception:   # a backend that cannot answer: behave as one process
        return None


def collective_device(device: torch.device | None) -> torch.device:
    """Where the reduction's tensor must live for the default group's backend."""
    backend = str(torch.distributed.get_backend()).lower()
    if any(b in backend for b in ("gloo", "mpi", "ucc")):
        return torch.device("cpu")
    if device is not None and device.type != "cpu":
        return device
    return torch.device("cuda", torch.cuda.current_device())


def encode(values: dict[str, Any], keys: tuple[str, ...], rank: int, size: int) -> list[int]:
    return [-1 if values.get(k) is None else int(values[k]) * size + (size - 1 - rank)
            for k in keys]


def decode(encoded: list[int], keys: tuple[str, ...],
           size: int) -> tuple[dict[str, int | None], dict[str, int]]:
    values: dict[str, int | None] = {}
    ranks: dict[str, int] = {}
    for k, e in zip(keys, encoded, strict=True):
        if e < 0:
            values[k] = None
        else:
            values[k], ranks[k] = e // size, size - 1 - e % size
    return values, ranks


def reduce_max(values: dict[str, Any], keys: tuple[str, ...], rank_size: tuple[int, int],
               device: torch.device) -> tuple[dict[str, int | None], dict[str, int]]:
    """The maximum of each of ``keys`` over all ranks, and the (lowest) rank that holds it.

    A collective: every rank must call it, with the same ``keys``."""
    rank, size = rank_size
    t = torch.tensor(encode(values, keys, rank, size), dtype=torch.int64, device=device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return decode(t.tolist(), keys, size)
