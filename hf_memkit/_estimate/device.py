"""What CUDA adds to a step's live tensor bytes: the cuBLAS workspaces, the caching allocator's
fragmentation (a replay of the traced step, ``allocation``), the context by CUDA version and
module loading, NCCL buffers; and the uncertainty band. A user calibration of this GPU
(``hf-memkit calibrate``) replaces the context and workspace figures and the band."""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field
from typing import Any

from .. import _store as store
from .._cuda.allocator import AllocatorConfig
from .._cuda.runtime import CALIBRATION, CudaRuntime, cublas_workspaces, nccl_buffers
from .._device.calibration import Calibration, find_calibration
from .._device.probe import DeviceInfo
from .._model.facts import layer_count
from .._model.spec import ModelSpec
from .._optimizers import OptimizerMemory
from .._units import MiB, format_bytes
from .activations import Excess
from .allocation import full_depth_events, replay_step
from .budget import cuda_capacity

# CPU estimates: relative 1-sigma of the residuals of bench/estimator_cpu.py (26 real Trainer runs:
# std 0.22%, worst 0.97%), rounded up to 0.5% for architectures the bench does not cover.
CPU_REL_SIGMA = CALIBRATION.traced_cpu_sigma
# the smallest-capacity search stops when its bracket is this narrow, or a sixteenth of what the
# allocator adds with nothing pressing (its sigma is a third of that share: finer changes no
# verdict), and answers the bracket's top: never below the smallest capacity
FIT_RESOLUTION = 16 * MiB
FIT_STEPS = 16
HOW = ("traced", "extended", "deepened")  # how a replayed stream is built (``allocation``)


@dataclass
class DeviceTerms:
    allocated: int
    reserved: int
    used: int
    rel_sigma: float
    notes: list[str]
    margin: int = 0     # 2 sigma in bytes: what a plan adds before comparing with the budget
    required: int = 0   # the smallest device memory the step runs in (see ``allocator_fit``)
    sigmas: dict[str, int] = field(default_factory=dict)  # 1-sigma bytes per term
    required_at_least: bool = False  # judged against a budget it misses: needs at least that


@dataclass(frozen=True)
class Replayed:
    """The replayed step: its peaks with nothing pressing, and the smallest allocator capacity
    at which it completes (the allocator frees cached blocks and retries before an OOM)."""

    peak_allocated: int
    peak_reserved: int   # with nothing pressing
    on_device: int       # peak reserved with the device's memory as the capacity
    how: str  # "traced", "extended" or "deepened" (``allocation.full_depth_events``)
    smallest: Any = field(default=None, repr=False, compare=False)  # () -> smallest capacity
    completes: Any = field(default=None, repr=False, compare=False)  # (capacity) -> bool


def user_calibration(dev: DeviceInfo, runtime: CudaRuntime) -> Calibration | None:
    """The stored calibration of this GPU and CUDA (probed devices only: a catalog entry names a
    model of GPU, not the card that was measured)."""
    if dev.source == "catalog":
        return None
    import torch

    return find_calibration(dev.name, runtime.version, driver=dev.driver_version,
                            torch_version=torch.__version__)


def smallest_capacity(events: list, params: tuple[int, ...], lo: int, hi: int,
                      **kw: Any) -> int:
    """The smallest capacity (to ``FIT_RESOLUTION`` or a ``FIT_STEPS``th of ``hi - lo``) in
    [``lo``, ``hi``] at which the step's replay completes without an OOM; ``hi`` (the
    unconstrained peak reserved, or the peak reserved at a capacity that completed) always
    does."""
    def completes(cap: int) -> bool:
        return replay_step(events, params, capacity=cap, **kw).ooms == 0

    if completes(lo):
        return lo
    resolution = max(FIT_RESOLUTION, (hi - lo) // FIT_STEPS)
    while hi - lo > resolution:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if completes(mid) else (mid, hi)
    return hi


def allocator_fit(ex: Excess, spec: ModelSpec, om: OptimizerMemory,
                  workspaces: tuple[int, ...], stage: str, micro_steps: int = 1,
                  device_capacity: int | None = None,
                  config: AllocatorConfig | None = None, live: int | None = None
                  ) -> Replayed | None:
    """The step replayed through the caching-allocator model (None for a lower bound, which has
    no events). A model traced at full depth replays its own events; a deep model traced at 2
    and 3 blocks replays the stream ``allocation.full_depth_events`` builds for its full depth
    (which cached block a request lands in is discrete, so neither a line through two shallow
    replays nor their ratio transfers to the deep model). ``device_capacity``: what the
    allocator may reserve on the device (its memory less the context): reserved cannot grow past
    it, the allocator frees its cache and retries first. ``config``: the allocator options
    (default: the environment's). ``live``: the rank's own live bytes at its peak, where a
    sharded engine's stream (states unsharded) holds more than the device: the replay on the
    device then keeps the same headroom over its own live bytes."""
    if not ex.replays or ex.lower_bound:
        return None
    states = spec.states()[1]
    trainable = sum(p.nbytes for p in states) or 1
    state, transient = om.state / trainable, om.transient / trainable
    config = AllocatorConfig.from_env() if config is None else config
    # the parameters' own sizes too: specs that share a trace (pure bf16 and FSDP's bf16
    # gathers of fp32 masters) replay their own gradients and optimizer steps
    sizes = tuple(p.nbytes for p in states)
    key = (round(state, 6), round(transient, 6), workspaces, config, stage, micro_steps,
           device_capacity, sizes, live)
    if key not in ex.replayed:
        full = layer_count(spec.config)
        kw = dict(state_ratio=state, transient_ratio=transient, workspaces=workspaces,
                  optimizer=stage == "train", micro_steps=micro_steps, config=config)
        run = _Replay(ex, full, sizes, kw, device_capacity, live)
        ex.replayed[key] = run.stored() or run.replayed()
    return ex.replayed[key]


@dataclass
class _Replay:
    """One replay of a traced step, kept on disk beside its trace (``store``) where the trace
    is: its figures, and the smallest capacity once searched."""

    ex: Excess
    full: int
    states: tuple[int, ...]      # bytes of each trainable parameter at full depth
    kw: dict[str, Any]
    device_capacity: int | None
    live: int | None = None
    key: str | None = None

    def __post_init__(self) -> None:
        if self.ex.stored_as is not None and store.enabled():
            self.key = store.make_key({"trace": self.ex.stored_as, "full": self.full,
                                       "states": self.states, "kw": self.kw,
                                       "device_capacity": self.device_capacity,
                                       "live": self.live})

    def _events(self) -> tuple[list, tuple[int, ...], str]:
        if "events" not in self.ex.replayed:  # the same for every optimizer and stage
            self.ex.replayed["events"] = full_depth_events(self.ex.replays, self.full)
        events, how = self.ex.replayed["events"]
        params = max(self.ex.replays, key=lambda r: r[0])[2] if how == "traced" else \
            self.states
        return events, params, how

    def replayed(self) -> Replayed:
        events, params, how = self._events()
        s = replay_step(events, params, **self.kw)
        on_device, cap = s.peak_reserved, self.device_capacity
        if cap is not None and self.live is not None and s.peak_allocated > cap:
            # the stream holds more than the rank (a sharded engine's states unsharded): the
            # same headroom over its own live bytes, as ``required`` carries its smallest
            # capacity over; none where the rank's live bytes exceed the device
            cap = cap + s.peak_allocated - self.live if self.live < cap else None
        # no replay where the step's live bytes alone exceed the capacity: it cannot complete
        if cap is not None and s.peak_allocated <= cap < s.peak_reserved:
            r = replay_step(events, params, capacity=cap, **self.kw)
            on_device = r.peak_reserved if not r.ooms else s.peak_reserved
        return self._result(s.peak_allocated, s.peak_reserved, on_device, how)

    def stored(self) -> Replayed | None:
        d = store.TraceStore().get(self.key) if self.key is not None else None
        try:
            smallest = d.get("smallest")
            if d["how"] not in HOW:
                raise ValueError("not a way of building the replayed stream")
            r = self._result(store.count(d["peak_allocated"]), store.count(d["peak_reserved"]),
                             store.count(d["on_device"]), d["how"],
                             None if smallest is None else store.count(smallest), keep=False)
        except (TypeError, KeyError, ValueError, AttributeError):
            return None
        return r

    def _result(self, allocated: int, reserved: int, on_device: int, how: str,
                smallest: int | None = None, keep: bool = True) -> Replayed:
        memo: list[int] = [] if smallest is None else [int(smallest)]
        figures = {"peak_allocated": allocated, "peak_reserved": reserved,
                   "on_device": on_device, "how": how}

        def search() -> int:
            if not memo:
                events, params, _ = self._events()
                memo.append(smallest_capacity(events, params, allocated,
                                              min(reserved, on_device), **self.kw))
                self._keep({**figures, "smallest": memo[0]})
            return memo[0]

        def completes(capacity: int) -> bool:
            if memo:
                return memo[0] <= capacity
            events, params, _ = self._events()
            return replay_step(events, params, capacity=capacity, **self.kw).ooms == 0

        if keep:
            self._keep(figures)
        return Replayed(allocated, reserved, on_device, how, search, completes)

    def _keep(self, figures: dict[str, Any]) -> None:
        if self.key is not None:
            store.TraceStore().put(self.key, figures)


def _calibration_notes(runtime: CudaRuntime, cal: Calibration | None, sigmas: dict[str, int],
                       margin: int, emulated: bool) -> list[str]:
    """Where the context and workspaces come from, and which band the margin is."""
    notes = [runtime.note() if cal is None else
             f"CUDA {runtime.version}: context {format_bytes(cal.context)} and cuBLAS "
             f"workspaces measured on this GPU (calibration {cal.path})"]
    if "calibration residuals" in sigmas:
        return notes + [
            f"uncertainty from {len(cal.residuals)} measured residuals of this GPU: 1 sigma "
            f"{cal.rel_sigma:.1%} of device_used (their RMS {cal.residual_rms:.1%} widened to "
            f"what {len(cal.residuals)} residuals support), wider than the per-term band, "
            "which it replaces"]
    notes.append(_margin_note(margin, emulated))
    if cal is not None and cal.rel_sigma is not None:
        notes.append(f"{len(cal.residuals)} measured residuals of this GPU (1 sigma "
                     f"{cal.rel_sigma:.1%}) fall within the per-term band: residuals of other "
                     "models and shapes never narrow this one's")
    return notes


def widened(cal: Any, used: int, margin: int) -> bool:
    """Whether a calibration's residuals give a wider margin than the per-term band. They
    never narrow it: ``calibrate --check`` residuals are the reference model's own, in sample,
    and residuals of other runs say little of another model's terms (issue 25)."""
    return (cal is not None and cal.rel_sigma is not None
            and int(2 * cal.rel_sigma * used) > margin)


def _band(parts: dict[str, int], runtime: CudaRuntime, frag_at_fit: int,
          nccl: int, emulated: bool, pool: int = 0) -> dict[str, int]:
    """1-sigma bytes of each uncertain term (``CudaCalibration`` says where each comes from).
    ``emulated``: the CUDA emulation acts on the step (``phases.emulation_acts``); where it does
    not, the CUDA trace is the CPU-measured one but for CUDA kernels' private buffers.
    ``pool``: backend:cudaMallocAsync's pool, whose overhead is not modelled (1 sigma: what the
    caching allocator would add on the step)."""
    c = CALIBRATION
    traced = parts.get("activations", 0) + parts.get("_traced_temporaries", 0)
    cuda = c.traced_cuda_sigma if emulated else c.traced_cuda_floor_sigma
    return {
        "activations (traced)": int(traced * math.hypot(c.traced_cpu_sigma, cuda)),
        "CUDA context": c.context_sigma if runtime.lazy_loading else c.context_eager_sigma,
        "allocator": int(c.allocator_sigma * frag_at_fit),
        "NCCL buffers": int(c.nccl_sigma * nccl),
        **({"cudaMallocAsync pool": pool} if pool else {}),
    }


def _margin_note(margin: int, emulated: bool) -> str:
    return (f"margin {format_bytes(margin)}: 2 sigma of the uncertain terms combined as "
            "independent errors (model states are exact; `hf-memkit calibrate` measures this "
            "GPU)" + ("" if emulated else
                      "; nothing in this step runs differently on CUDA than the traced CPU ops "
                      "(no autocast, SDPA kernel or fused dropout), so the traced term carries "
                      f"{CALIBRATION.traced_cuda_floor_sigma:.0%} for CUDA kernels' own buffers"))


def _allocator_notes(fit: Replayed | None, dev: DeviceInfo, required: int,
                     allocated: int, conf: AllocatorConfig, pool: int) -> list[str]:
    """What the replay says, in words, and what of the allocator options it follows."""
    notes: list[str] = []
    opts = conf.modelled()
    given = (f"{conf.source}: {', '.join(opts)}" if opts else
             f"{conf.source}: none of its options changes the model" if conf.source else
             "no allocator options set")
    if conf.backend == "cudaMallocAsync":
        notes.append(_async_note(conf, pool))
    elif fit:
        pressed = fit.on_device < fit.peak_reserved
        notes.append(f"fragmentation from a replay of the step through the caching-allocator "
                     f"model ({given}); the step runs in "
                     f"{format_bytes(required)}: the allocator frees its cached blocks and "
                     f"retries before an OOM" + (
                         f"; on {dev.name} it does (with more memory reserved would reach "
                         f"{format_bytes(fit.peak_reserved + allocated - fit.peak_allocated)})"
                         if pressed else ""))
        if fit.how == "deepened":
            notes.append("this model's blocks do not repeat one allocation pattern: its "
                         "full-depth allocation stream is an approximation")
    if conf.unmodelled_note():
        notes.append(conf.unmodelled_note())
    return notes


def _async_note(conf: AllocatorConfig, pool: int) -> str:
    """backend:cudaMallocAsync: what the estimate does instead of the caching-allocator model."""
    native = [o for o in conf.modelled() if not o.startswith(("backend", "per_process"))]
    return ("backend:cudaMallocAsync (" + (conf.source or "the allocator config") + "): CUDA's "
            "stream-ordered allocator serves every tensor (c10/cuda/CUDAMallocAsyncAllocator."
            "cpp; its pool keeps freed memory, release threshold UINT64_MAX), so none of the "
            "caching allocator's block rules apply and no fragmentation is claimed: "
            "peak_reserved is taken as peak_allocated, a lower bound. The pool's own "
            "granularity and reuse are NOT modelled; the margin carries what the caching "
            f"allocator would add on this step ({format_bytes(pool)}) as 1 sigma" + (
                f". Under this backend torch ignores {', '.join(native)} (it warns so)"
                if native else ""))


def _workspaces(dev: DeviceInfo, cal: Calibration | None) -> tuple[tuple[int, ...], list[str]]:
    """The workspaces one matmul thread allocates (forward and autograd's each hold them):
    ``CUBLAS_WORKSPACE_CONFIG`` when set, else this GPU's calibration, else torch's default
    (``cublas_workspaces``), and their notes."""
    ws = cublas_workspaces(dev.compute_capability)
    per_thread = ws.per_thread
    if cal is not None and cal.cublas_workspace > 0 and not ws.configured:
        per_thread = (cal.cublas_workspace // 2, *per_thread[1:])
    return per_thread, list(ws.notes)


def _capacity(dev: DeviceInfo, conf: AllocatorConfig, outside: int) -> int | None:
    """What the allocator may reserve for the replayed step: the device's memory less what lies
    outside the replay, and no more than ``per_process_memory_fraction`` of the device (torch's
    limit on the allocator's own reserve, less the allocated bytes the replay leaves out)."""
    total = cuda_capacity(dev)[0]  # what CUDA hands out: the driver's reserve is not there
    capacity = max(1, total - outside) if total else None
    limit = conf.limit(total)
    if limit is not None:
        capacity = max(1, min(capacity or limit, limit - CALIBRATION.alloc_const))
    return capacity


def _fit(ex: Excess, spec: ModelSpec, om: OptimizerMemory, workspaces: tuple[int, ...],
         stage: str, micro_steps: int, capacity: int | None,
         conf: AllocatorConfig, live: int) -> tuple[Replayed | None, int, int]:
    """(the replay, 0, what ``roundup_power2_divisions`` adds to its peak allocated over 512 B
    rounding); under backend:cudaMallocAsync (None, what the caching allocator with torch's
    defaults would add on the step, 0): that backend is not the caching allocator, so nothing
    of its replay is claimed, and its scale sizes the band instead."""
    replay = functools.partial(allocator_fit, ex, spec, om, workspaces, stage, micro_steps)
    if conf.backend == "cudaMallocAsync":
        scale = replay(None, AllocatorConfig())
        return None, max(0, scale.peak_reserved - scale.peak_allocated) if scale else 0, 0
    fit = replay(capacity, conf, live)
    if fit is None or not conf.roundup_power2_divisions:
        return fit, 0, 0
    plain = replay(capacity, dataclasses.replace(conf, roundup_power2_divisions=()), live)
    return fit, 0, max(0, fit.peak_allocated - plain.peak_allocated)


def _judged(fit: Replayed | None, at: Any, budget: int | None,
            frag_on_device: int) -> tuple[Replayed | None, tuple, bool]:
    """(the replay, ``at(frag)`` of what the step needs, whether that is only a lower bound):
    see ``device_terms``' ``fit_budget``."""
    need = at(frag_on_device)
    if fit and budget is not None and need[0] + need[1] > budget:
        low = at(0)
        if low[0] + low[1] > budget:  # does not fit even with no fragmentation
            return dataclasses.replace(fit, smallest=None), low, True
        # one replay settles the verdict: at the most fragmentation that still fits
        most = _most_fragmentation(at, budget, frag_on_device)
        if not fit.completes(fit.peak_allocated + most):
            # it needs more: ``required`` says at least the next byte, which misses
            return dataclasses.replace(fit, smallest=None), at(most + 1), True
    if fit and fit.smallest is not None and (budget is None or need[0] + need[1] > budget):
        need = at(max(0, fit.smallest() - fit.peak_allocated))
    return fit, need, False


def _most_fragmentation(at: Any, budget: int, hi: int) -> int:
    """The most fragmentation over the live bytes with which ``at(frag)``'s required plus
    margin (both grow with it) stays within ``budget``, to the byte (``at(it + 1)`` misses):
    0 <= it < ``hi`` where ``at(0)`` fits and ``at(hi)`` does not (arithmetic, no replay)."""
    lo = 0
    while hi - lo > 1:
        mid = (lo + hi) // 2
        required, margin, _ = at(mid)
        lo, hi = (mid, hi) if required + margin <= budget else (lo, mid)
    return lo


def device_terms(dev: DeviceInfo, peak: int, parts: dict[str, int], om: OptimizerMemory,
                 runtime: CudaRuntime | None, ranks: int, *, ex: Excess, spec: ModelSpec,
                 stage: str, micro_steps: int = 1, model_states: int = 0,
                 weights: int = 0, fit_budget: int | None = None,
                 emulated: bool = True, allocator: AllocatorConfig | None = None) -> DeviceTerms:
    """Adds fragmentation and context to ``parts`` (and the workspaces to temporaries), the
    smallest device memory the step runs in (``required``) and the band. The margin: a user
    calibration's residuals are of device_used as a whole; otherwise each term's own sigma,
    combined as independent errors (model states are exact).

    ``allocator``: the allocator options to replay with (default: the environment's; the
    planner's expandable-segments rung passes its own). ``fit_budget`` (the planner's): the
    smallest capacity is searched only where the verdict
    against it depends on it. A step that fits with what the device shows needs no cache freed
    (``required`` = ``device_used``); one that misses it even with no fragmentation needs at
    least its live bytes and context (``required`` says that much); between the two, one
    replay at the most fragmentation that would still fit settles a step that does not complete
    there (``required`` says at least that much), and only a step that does is searched (the
    same search, and so the same figure, as without a budget)."""
    if dev.kind != "cuda" or runtime is None:
        parts["fragmentation"] = parts["context"] = 0
        margin = int(2 * CPU_REL_SIGMA * peak)
        return DeviceTerms(peak, peak, peak, CPU_REL_SIGMA, [], margin, peak,
                           {"activations (traced)": margin // 2})
    cal = user_calibration(dev, runtime)
    per_thread, ws_notes = _workspaces(dev, cal)
    workspaces = per_thread * 2  # the forward thread's, then the autograd thread's
    nccl = nccl_buffers(ranks, dev.interconnect)
    context = cal.context if cal is not None else runtime.context
    resident = om.paged_resident  # paged state: only the pages its step needs at once
    outside = context + nccl + resident + CALIBRATION.alloc_const  # not in the replay
    conf = allocator or AllocatorConfig.from_env()
    fit, pool, rounding = _fit(ex, spec, om, workspaces, stage, micro_steps,
                               _capacity(dev, conf, outside), conf, peak + sum(workspaces))
    traced_temporaries = parts["temporaries"]
    allocated = peak + sum(workspaces) + CALIBRATION.alloc_const + rounding
    parts["temporaries"] += allocated - peak
    # peak reserved: what reserved reaches when nothing presses; on this device the allocator
    # frees its cache and retries instead of growing past the device's memory (device_used)
    frag = max(0, fit.peak_reserved - fit.peak_allocated) if fit else 0
    frag_on_device = max(0, fit.on_device - fit.peak_allocated) if fit else 0
    parts["fragmentation"] = frag
    parts["context"] = context + nccl
    reserved = allocated + frag
    used = allocated + frag_on_device + parts["context"] + resident
    band_parts = {**parts, "_traced_temporaries": traced_temporaries}

    def at(frag_at_fit: int) -> tuple[int, int, dict[str, int]]:
        """(required, margin, sigmas) when the step needs ``frag_at_fit`` over its live bytes."""
        # (the smallest capacity is found to a resolution: never above what the device shows)
        required = min(used, allocated + frag_at_fit + parts["context"] + resident)
        sigmas = _band(band_parts, runtime, frag_at_fit, nccl, emulated, pool)
        margin = int(2 * math.sqrt(sum(v * v for v in sigmas.values())))
        if widened(cal, used, margin):   # residuals only ever widen the per-term band
            margin = int(2 * cal.rel_sigma * used)
            return required, margin, {"calibration residuals": margin // 2}
        return required, margin, sigmas

    fit, (required, margin, sigmas), at_least = _judged(fit, at, fit_budget, frag_on_device)
    notes = _calibration_notes(runtime, cal, sigmas, margin, emulated)
    notes += ws_notes + _allocator_notes(fit, dev, required, allocated, conf, pool)
    if rounding:
        notes.append(f"roundup_power2_divisions: the replay's requests, rounded as torch rounds "
                     f"them, hold {format_bytes(rounding)} more at the peak than 512 B blocks "
                     "would (in temporaries)")
    if nccl:
        notes.append(f"NCCL communicator buffers: {format_bytes(nccl)} per rank")
    return DeviceTerms(allocated, reserved, used, margin / 2 / used if used else 0.0, notes,
                       margin, required, sigmas, at_least)
