"""The host side of a CUDA device: pinned blocks from torch's ``CachingHostAllocator`` and the
host link they cross, shared by everything that offloads to host memory (checkpoint offload,
TRL's activation offloading)."""

from __future__ import annotations

from typing import Any


def pinned_block(nbytes: int) -> int:
    """CachingHostAllocator's block for a request: the next power of two."""
    return 1 << (nbytes - 1).bit_length() if nbytes > 0 else 0


def host_link_bandwidth(dev: Any) -> float:
    """Bytes/s one pinned copy moves between host and device: the PCIe generation of the
    card's host link from its architecture (Hopper and later: Gen5; Ampere/Ada: Gen4; older:
    Gen3), x16, at 80% of the link's 64/32/16 GB/s per direction (pinned ``cudaMemcpyAsync``
    reaches about that: NVIDIA's bandwidthTest on H100 PCIe Gen5 ~ 50-55 GB/s, A100 Gen4
    ~ 25 GB/s)."""
    cc = getattr(dev, "compute_capability", None) or (0, 0)
    per_direction = 64e9 if cc >= (9, 0) else 32e9 if cc >= (8, 0) else 16e9
    return 0.8 * per_direction
