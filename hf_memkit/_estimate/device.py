"""What CUDA adds to a step's live tensor bytes: the cuBLAS workspaces, the caching allocator's
fragmentation (a replay of the traced step, ``allocation``), the context by CUDA version and
module loading, NCCL buffers; and the uncertainty band. A user calibration of this GPU
(``hf-memkit calibrate``) replaces the context and workspace figures and the band."""

from __future__ import annotations

from dataclasses import dataclass

from .._allocator import AllocatorConfig
from .._calibration import Calibration, find_calibration
from .._cuda import CALIBRATION, CudaRuntime, cublas_workspace, nccl_buffers
from .._device import DeviceInfo
from .._model.spec import ModelSpec
from .._optimizers import OptimizerMemory
from .._trace import layer_count
from .._units import format_bytes
from .activations import Excess
from .allocation import replay_step

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
                  stage: str, micro_steps: int = 1, allocated: int = 0, weights: int = 0) -> int:
    """Peak reserved - peak allocated of the replayed step, scaled to the model (0 for a lower
    bound, which has no events). A model traced at full depth takes its replay's figure. A deep
    model traced at 2 and 3 blocks takes the deeper replay's fragmentation relative to what it
    allocates beyond its weights (the weights are allocated once, first, and never move), times
    the same for the model: which cached block a request lands in is discrete, so the difference
    between two shallow replays is noise that a linear extrapolation in depth would multiply by
    the layer count, and a 2-3 block model is mostly embedding and head, so a ratio of its whole
    allocation would misweigh a deep model's weights."""
    if not ex.replays or ex.lower_bound:
        return 0
    trainable = sum(p.nbytes for p in spec.states()[1]) or 1
    state, transient = om.state / trainable, om.transient / trainable
    config = AllocatorConfig.from_env()
    key = (round(state, 6), round(transient, 6), workspaces, config, stage, micro_steps)
    if key not in ex.replayed:
        ex.replayed[key] = {
            n: (s.peak_reserved - s.peak_allocated, s.peak_allocated - w)
            for n, events, params, w in ex.replays
            for s in [replay_step(events, params, state_ratio=state, transient_ratio=transient,
                                  workspaces=workspaces, optimizer=stage == "train",
                                  micro_steps=micro_steps, config=config)]}
    frag = ex.replayed[key]
    if len(frag) == 1 and next(iter(frag)) == layer_count(spec.config):
        return max(0, next(iter(frag.values()))[0])
    f, a = frag[max(frag)]
    return max(0, int(f / a * max(0, allocated - weights))) if a > 0 else 0


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
    parts["fragmentation"] = frag = fragmentation(ex, spec, om, workspaces, stage, micro_steps,
                                                  allocated, weights)
    nccl = nccl_buffers(ranks, dev.interconnect)
    context = cal.context if cal is not None else runtime.context
    parts["context"] = context + nccl
    reserved = allocated + frag
    used = reserved + parts["context"] + om.paged
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
        notes.append(f"fragmentation from a replay of the step through the caching-allocator "
                     f"model ({AllocatorConfig.from_env()})")
    if nccl:
        notes.append(f"NCCL communicator buffers: {format_bytes(nccl)} per rank")
    return DeviceTerms(allocated, reserved, used, rel, notes, margin)
