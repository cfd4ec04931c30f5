"""What CUDA adds to a step's live tensor bytes: the cuBLAS workspaces, the caching allocator's
fragmentation (a replay of the traced step, ``allocation``), the context by CUDA version and
module loading, NCCL buffers; and the uncertainty band. A user calibration of this GPU
(``hf-memkit calibrate``) replaces the context and workspace figures and the band."""

from __future__ import annotations

from dataclasses import dataclass

from .._cuda.allocator import AllocatorConfig
from .._cuda.runtime import CALIBRATION, CudaRuntime, cublas_workspace, nccl_buffers
from .._device.calibration import Calibration, find_calibration
from .._device.probe import DeviceInfo
from .._model.facts import layer_count
from .._model.spec import ModelSpec
from .._optimizers import OptimizerMemory
from .._units import format_bytes
from .activations import Excess
from .allocation import canonical, deepen, replay_step

# CPU estimates: relative 1-sigma of the residuals of bench/estimator_cpu.py (26 real Trainer runs:
# std 0.22%, worst 0.97%), rounded up to 0.5% for architectures the bench does not cover.
CPU_REL_SIGMA = 0.005


@dataclass
class DeviceTerms:
    allocated: int
    reserved: int
    used: int
    rel_sigma: float
    notes: list[str]
    margin: int = 0     # 2 sigma in bytes: what a plan adds before comparing with the budget


def user_calibration(dev: DeviceInfo, runtime: CudaRuntime) -> Calibration | None:
    """The stored calibration of this GPU and CUDA (probed devices only: a catalog entry names a
    model of GPU, not the card that was measured)."""
    if dev.source == "catalog":
        return None
    import torch

    return find_calibration(dev.name, runtime.version, driver=dev.driver_version,
                            torch_version=torch.__version__)


def fragmentation(ex: Excess, spec: ModelSpec, om: OptimizerMemory, workspaces: tuple[int, ...],
                  stage: str, micro_steps: int = 1) -> int:
    """Peak reserved - peak allocated of the replayed step (0 for a lower bound, which has no
    events). A model traced at full depth replays its own events; a deep model traced at 2 and 3
    blocks replays the stream ``allocation.deepen`` builds for its full depth (which cached block
    a request lands in is discrete, so neither a line through the two shallow replays nor their
    ratio transfers to the deep model)."""
    if not ex.replays or ex.lower_bound:
        return 0
    states = spec.states()[1]
    trainable = sum(p.nbytes for p in states) or 1
    state, transient = om.state / trainable, om.transient / trainable
    config = AllocatorConfig.from_env()
    key = (round(state, 6), round(transient, 6), workspaces, config, stage, micro_steps)
    if key not in ex.replayed:
        full = layer_count(spec.config)
        reps = sorted(ex.replays, key=lambda r: r[0])
        (n1, ev1, _), (n2, ev2, params) = reps[0], reps[-1]
        if "events" not in ex.replayed:  # the same for every optimizer and stage
            ev1, ev2 = canonical(ev1), canonical(ev2)
            ex.replayed["events"] = ev2 if n2 == full or n1 == n2 else \
                deepen(ev1, ev2, full - n2)
        events = ex.replayed["events"]
        if n2 != full and n1 != n2:
            params = tuple(p.nbytes for p in states)
        s = replay_step(events, params, state_ratio=state, transient_ratio=transient,
                        workspaces=workspaces, optimizer=stage == "train",
                        micro_steps=micro_steps, config=config)
        ex.replayed[key] = s.peak_reserved - s.peak_allocated
    return max(0, ex.replayed[key])


def device_terms(dev: DeviceInfo, peak: int, parts: dict[str, int], om: OptimizerMemory,
                 runtime: CudaRuntime | None, ranks: int, *, ex: Excess, spec: ModelSpec,
                 stage: str, micro_steps: int = 1, model_states: int = 0,
                 weights: int = 0) -> DeviceTerms:
    """Adds fragmentation and context to ``parts`` (and the workspaces to temporaries). The
    margin: a user calibration's residuals are of device_used as a whole; the published-table
    sigma is of the part that is not model states (those are exact)."""
    if dev.kind != "cuda" or runtime is None:
        parts["fragmentation"] = parts["context"] = 0
        return DeviceTerms(peak, peak, peak, CPU_REL_SIGMA, [],
                           int(2 * CPU_REL_SIGMA * peak))
    cal = user_calibration(dev, runtime)
    per_thread = cublas_workspace(dev.compute_capability) // 2
    if cal is not None and cal.cublas_workspace > 0:
        per_thread = cal.cublas_workspace // 2
    workspaces = (per_thread, per_thread)
    allocated = peak + 2 * per_thread + CALIBRATION.alloc_const
    parts["temporaries"] += allocated - peak
    parts["fragmentation"] = frag = fragmentation(ex, spec, om, workspaces, stage, micro_steps)
    nccl = nccl_buffers(ranks, dev.interconnect)
    context = cal.context if cal is not None else runtime.context
    parts["context"] = context + nccl
    reserved = allocated + frag
    used = reserved + parts["context"] + om.paged_resident  # paged state: only its step pages
    rel = CALIBRATION.rel_sigma
    margin = int(2 * rel * max(0, used - model_states))
    notes = [runtime.note() if cal is None else
             f"CUDA {runtime.version}: context {format_bytes(cal.context)} and cuBLAS "
             f"workspaces measured on this GPU (calibration {cal.path})"]
    if cal is not None and cal.rel_sigma is not None:
        rel = cal.rel_sigma
        margin = int(2 * rel * used)
        notes.append(f"uncertainty from {len(cal.residuals)} measured residuals of this GPU")
    else:
        notes.append(f"margin {format_bytes(margin)}: 2 x {rel:.0%} of what is not model states "
                     "(published GPU tables; `hf-memkit calibrate` measures this GPU)")
    if frag:
        conf = AllocatorConfig.from_env()
        opts = ", ".join(o for o in (
            f"max_split_size_mb:{conf.max_split_size >> 20}" if conf.max_split_size else "",
            "expandable_segments:True" if conf.expandable_segments else "") if o) or "defaults"
        notes.append(f"fragmentation from a replay of the step through the caching-allocator "
                     f"model (PYTORCH_CUDA_ALLOC_CONF: {opts})")
    if nccl:
        notes.append(f"NCCL communicator buffers: {format_bytes(nccl)} per rank")
    return DeviceTerms(allocated, reserved, used, rel, notes, margin)
