"""Trainer callbacks: memory in every ``report_to`` backend, a memory timeline, throughput."""

from .memory import MemoryCallback
from .throughput import ThroughputCallback

__all__ = ["MemoryCallback", "ThroughputCallback"]
