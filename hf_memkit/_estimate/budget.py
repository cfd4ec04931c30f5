"""The memory a setup may use on a device: one rule for ``estimate_memory`` and the planner.

docs/fitting.md, the budget: budget = ``max_memory`` if given; else what CUDA hands out
(``cuda_capacity``: NVML's total less the driver's reserve) ``x (1 - headroom)``, and no more
than ``free_memory + own_memory`` (what is free plus what this process already holds there)
when the device is the one this process runs on; on CUDA, no more than
``per_process_memory_fraction`` of what CUDA hands out (``allocator_limit``).
What must fit is ``MemoryEstimate.upper``: what the step needs (``required``: the caching
allocator frees its cached blocks and retries before an OOM) plus the margin of its uncertain
terms.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from .._cuda.allocator import AllocatorConfig
from .._device.catalog import catalog
from .._device.probe import DeviceInfo
from .._errors import HfMemkitError, quoted
from .._units import GiB, format_bytes, parse_bytes

# The fraction of device memory kept for other tenants of the GPU, and nothing else: the
# estimate's own uncertainty is in its margin (``MemoryEstimate.margin``), and what the driver
# keeps is taken off before (``cuda_capacity``). On this machine's device the budget is capped at
# what is free now, which other tenants already left, so they cost nothing twice; a catalog card
# is planned as a training node's is run, headless (the published runs at 96-98% of a 24 GB card
# were), so the default keeps nothing. A card that drives a display gives its desktop 0.3-1.5
# GiB: plan on that machine (its free memory is read), or pass ``headroom``.
DEFAULT_HEADROOM = 0.0
# What the driver and firmware keep of NVML's total where the catalog has no measurement of the
# card (``GpuSpec.cuda_memory``: torch's "total capacity" in published OOM messages). Measured
# reserves on 16 catalog cards run from ~0 (V100) through 210-460 MiB (T4, A10G, L4, RTX 3090 /
# 4090) to 450-880 MiB (80 GB and larger cards; A100-80GB's 881 MiB is the largest) and vary by up
# to ~460 MiB with the driver: an unmeasured card is given the largest, rounded up, so that it is
# never planned in memory CUDA does not hand out.
DRIVER_RESERVE = GiB


def cuda_capacity(dev: DeviceInfo) -> tuple[int, str]:
    """(bytes CUDA hands to a process on ``dev``, how that is known): torch's total_memory
    (``DeviceInfo.cuda_memory``: probed, or the catalog's published figure), else NVML's total
    less ``DRIVER_RESERVE``. Off NVIDIA's CUDA, the device's total."""
    if dev.kind != "cuda":
        return dev.total_memory, format_bytes(dev.total_memory)
    if dev.cuda_memory and dev.cuda_memory <= dev.total_memory:
        shown = dev.cuda_memory < dev.total_memory
        how = "torch's total in published OOM messages" if dev.source == "catalog" else \
            "torch's total_memory, probed"
        return dev.cuda_memory, (f"{format_bytes(dev.cuda_memory)} CUDA hands out" + (
            f" of {format_bytes(dev.total_memory)}" if shown else "") + f" ({how})")
    if dev.vendor == "amd":
        return dev.total_memory, format_bytes(dev.total_memory)
    spec = catalog().get(dev.catalog_name or "")
    if spec is not None and spec.cuda_memory and spec.memory == dev.total_memory:
        # probed before the probe read it: the card's published figure
        return spec.cuda_memory, (f"{format_bytes(spec.cuda_memory)} CUDA hands out of "
                                  f"{format_bytes(dev.total_memory)} ({spec.name}, published)")
    n = max(1, dev.total_memory - DRIVER_RESERVE)
    return n, (f"{format_bytes(n)}: {format_bytes(dev.total_memory)} less the driver's reserve "
               f"({format_bytes(DRIVER_RESERVE)} assumed: not measured on this card)")


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
        return (f"headroom must be in [0, 1): the fraction of device memory kept free for "
                f"other tenants of the GPU (0.05 keeps 5%; default 0); got {headroom!r}")
    return None


def max_memory_problem(max_memory: Any, name: str = "max_memory") -> str | None:
    """The sentence that says why ``max_memory`` is not a budget, or None: a size that does not
    read (nan, inf, negative, "lots"), or 0 bytes (nothing fits: the value given, not the
    device, is at fault)."""
    if max_memory is None:
        return None
    try:
        n = parse_bytes(max_memory)
    except HfMemkitError as exc:
        return f"{name}={quoted(max_memory)}: {exc}"
    if n <= 0:
        return (f"{name}={max_memory!r} is a budget of 0 bytes, in which nothing fits; give the "
                f"memory the run may use (bytes, or e.g. '20GiB'), or leave {name} out to use "
                "the device's")
    return None


def memory_budget(dev: DeviceInfo, *, headroom: float = DEFAULT_HEADROOM,
                  max_memory: int | str | None = None, this_machine: bool = False) -> Budget:
    """The budget on ``dev`` (``this_machine``: the device was probed, so its free memory now
    bounds the budget too)."""
    if max_memory is not None:
        return allocator_limit(dev, Budget(parse_bytes(max_memory), "max_memory"))
    capacity, basis = cuda_capacity(dev)
    kept = (f"headroom {headroom:g} for other tenants" if headroom else
            "no other tenant assumed (a card that drives a display: pass headroom)")
    budget = Budget(int(capacity * (1 - headroom)), f"{basis}; {kept}")
    usable = usable_now(dev) if this_machine else None
    if usable is not None and usable < budget.bytes:
        own = f" + {format_bytes(dev.own_memory)} this process holds" if dev.own_memory else ""
        others = (f"; other processes hold {format_bytes(dev.others_memory)}"
                  if dev.others_memory else "")
        budget = Budget(usable, f"free memory on this machine now{own}{others}")
    return allocator_limit(dev, budget)


def allocator_limit(dev: DeviceInfo, budget: Budget) -> Budget:
    """``budget``, no more than ``per_process_memory_fraction`` (an allocator option of
    PYTORCH_CUDA_ALLOC_CONF, as ``torch.cuda.set_per_process_memory_fraction``) of a CUDA
    device's memory: past it torch's allocator raises an OOM whatever the device has free.
    torch's limit covers what the allocator reserves, the budget what device_used counts (the
    CUDA context too): the cap is conservative by the context."""
    if dev.kind != "cuda":
        return budget
    conf = AllocatorConfig.from_env()
    capacity = cuda_capacity(dev)[0]  # torch's fraction is of what CUDA hands out
    cap = conf.limit(capacity)
    if cap is None or cap >= budget.bytes:
        return budget
    return Budget(cap, f"per_process_memory_fraction:{conf.memory_fraction:g} of "
                       f"{format_bytes(capacity)} ({conf.source}), below "
                       f"{budget.basis}")


def usable_now(dev: DeviceInfo) -> int | None:
    """What this process's run may use on its probed device: the free memory plus what the
    process already holds there (its context, a model already moved to the GPU), which the
    estimate counts again. Without the second term a rank that loaded its model before planning
    would plan a smaller setup than one that had not."""
    if dev.free_memory is None:
        return None
    return int(dev.free_memory) + int(dev.own_memory or 0)


# A ROCm GPU is torch's ``cuda`` device: c10/hip/HIPCachingAllocator is c10/cuda's caching
# allocator hipified (same size classes, rounding and segment reuse), so the CUDA model applies.
ROCM_NOTE = ("ROCm target: the CUDA caching-allocator model is applied as is (HIP's caching "
             "allocator is torch's CUDA allocator ported by hipify: the same block rounding and "
             "segment reuse); the context and workspace figures are CUDA's, not measured on "
             "ROCm: `hf-memkit calibrate` on this GPU measures its own")
MPS_NOTE = ("MPS target: no model of the MPS allocator exists here, so device_used is the step's "
            "peak of live tensors (what torch.mps.current_allocated_memory counts): a lower "
            "bound. The MPS allocator's heaps, Metal's own memory (torch.mps.driver_allocated_"
            "memory shows both) and MPS kernels' private buffers come on top; the budget is "
            "torch.mps.recommended_max_memory()")


def backend_notes(dev: DeviceInfo) -> list[str]:
    """What the estimate applies to a GPU that is not NVIDIA's (``DeviceInfo.vendor``)."""
    if dev.kind == "mps":
        return [MPS_NOTE]
    return [ROCM_NOTE] if dev.vendor == "amd" else []


def unplannable(dev: DeviceInfo) -> str | None:
    """Why plans and reverse queries (largest batch, longest sequence) refuse ``dev``: on MPS
    the estimate is a lower bound, and a plan must never exceed the memory it is given."""
    if dev.kind != "mps":
        return None
    return (f"{dev.name} is an MPS (Apple silicon) device: hf-memkit has no model of the MPS "
            "allocator (its heaps, Metal's own memory, MPS kernels' buffers), so it cannot "
            "promise that a plan or a largest batch fits; estimate_memory (hf-memkit estimate) "
            "gives the step's live tensor peak, a lower bound on MPS. To plan, name a CUDA GPU "
            "(device='H100-80GB', --gpu H100-80GB) or device='cpu'")
