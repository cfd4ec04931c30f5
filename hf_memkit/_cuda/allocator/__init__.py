"""PyTorch's CUDA caching allocator, modelled: ``config`` parses the allocator options as torch
does and decides the size rounding; ``caching`` replays allocation/free events through the
allocator's algorithm to predict ``torch.cuda.max_memory_reserved`` and
``max_memory_allocated``."""

from .caching import CachingAllocator, ReplayStats, replay
from .config import AllocatorConfig

__all__ = ["AllocatorConfig", "CachingAllocator", "ReplayStats", "replay"]
