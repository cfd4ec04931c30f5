"""The memory a setup may use on a device: one rule for ``estimate_memory`` and the planner.

DESIGN.md, fitting rules: budget = ``max_memory`` if given; else ``total_memory x (1 -
headroom)``, and no more than ``free_memory`` when the device is the one this process runs on.
What must fit is ``MemoryEstimate.upper``: what the step needs (``required``: the caching
allocator frees its cached blocks and retries before an OOM) plus the margin of its uncertain
terms.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from .._device.probe import DeviceInfo
from .._units import format_bytes, parse_bytes

# The fraction of device memory kept for other tenants of the GPU (a desktop session's
# display server and browser take 0.3-1.5 GiB of a consumer card; a monitoring agent or a
# second job on a shared card), and nothing else: the estimate's own uncertainty is in its
# margin (``MemoryEstimate.margin``, 2 sigma of each term), so headroom is not a second safety
# factor. 5% keeps 1.2 GiB of a 24 GiB card and 4 GiB of an 80 GiB one. On this machine's own
# device the budget is also capped at the free memory, which other tenants already left.
DEFAULT_HEADROOM = 0.05


class Budget(NamedTuple):
    bytes: int
    basis: str  # how it was derived, for a person: "max_memory", "90% of 24.00 GiB", ...


def resolve_headroom(headroom: float | None, max_memory: Any, source: str, *,
                     stacklevel: int = 3) -> float:
    """``headroom`` or the default; a headroom given beside ``max_memory`` is ignored (the
    maximum is the whole budget), and a warning says so."""
    if headroom is not None and max_memory is not None:
        import warnings

        warnings.warn(f"{source}: headroom={headroom!r} is ignored because max_memory="
                      f"{max_memory!r} is given (max_memory is the whole budget); drop one of "
                      "them", UserWarning, stacklevel=stacklevel)
    return DEFAULT_HEADROOM if headroom is None else headroom


def headroom_problem(headroom: Any) -> str | None:
    """The sentence that says why ``headroom`` is not usable, or None."""
    if isinstance(headroom, bool) or not isinstance(headroom, (int, float)) \
            or not 0 <= headroom < 1:
        return (f"headroom must be in [0, 1): the fraction of device memory kept free (0.05 "
                f"keeps 5% free for other tenants of the GPU); got {headroom!r}")
    return None


def memory_budget(dev: DeviceInfo, *, headroom: float = DEFAULT_HEADROOM,
                  max_memory: int | str | None = None, this_machine: bool = False) -> Budget:
    """The budget on ``dev`` (``this_machine``: the device was probed, so its free memory now
    bounds the budget too)."""
    if max_memory is not None:
        return Budget(parse_bytes(max_memory), "max_memory")
    total = dev.total_memory * (1 - headroom)
    budget = Budget(int(total), f"{1 - headroom:.0%} of {format_bytes(dev.total_memory)} "
                                f"(headroom {headroom:g})")
    if this_machine and dev.free_memory is not None and dev.free_memory < budget.bytes:
        budget = Budget(int(dev.free_memory), "free memory on this machine now")
    return budget
