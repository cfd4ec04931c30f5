"""Trainer callbacks: memory in every ``report_to`` backend, a memory timeline, throughput.

* ``memory``: ``MemoryCallback``, with its readers per device kind (``_readers``, ``_nvml``),
  the phases of a logged step (``_phases``), the reduce across ranks (``_ranks``) and the
  calibration it may write (``_calibrate``); ``plot`` draws its timeline;
* ``throughput``: ``ThroughputCallback``;
* ``_order``: getting a callback's keys to the reporters and ``log_history``.

Users import them from ``hf_memkit`` (``hf_memkit.callbacks``). Why they stay light:
docs/style.md §8; the Trainer's callback order they work around:
docs/stack-facts.md#callback-order-and-logs; their cost: docs/quality-bars.md#callbacks.
"""

from .memory import MemoryCallback
from .throughput import ThroughputCallback

__all__ = ["MemoryCallback", "ThroughputCallback"]
