"""What ``bench/gpu_truth.py`` records beside the peaks, as plain functions of what it read:

  * ``optimizer_step_facts``: which optimizer steps really ran. With fp16 the GradScaler skips a
    step whose gradients overflow (its scale falls, the optimizer does not step, so no optimizer
    state exists yet); a measuring window without a real step misses the optimizer state;
  * ``case_flags``: what makes a run's comparison with the estimate doubtful;
  * ``oom_facts``: what a run that ran out of memory had measured so far;
  * ``load_facts``: memory after ``from_pretrained(dir, device_map=...)``, whose
    ``caching_allocator_warmup`` (transformers' modeling_utils) first reserves one block of the
    model's size: the bytes of its state dict on the device, tied tensors once (quantized ones at
    the quantizer's element size), allocated as fp16 ``torch.empty`` and freed to the cache;
    less where the device already has unused reserved memory; at most total memory - 1.2 GiB.

No torch import at module level (``gpu_truth.py --list`` runs anywhere).
"""

from __future__ import annotations

import re
from typing import Any

WINDOW_FIRST_STEP = 2  # steps 2.. are measured; step 1 is warm-up


def inner_optimizer(optimizer: Any) -> Any:
    """An accelerate ``AcceleratedOptimizer`` looked through."""
    return getattr(optimizer, "optimizer", optimizer)


def optimizer_state_entries(optimizer: Any) -> int | None:
    """Parameters with optimizer state (``len(optimizer.state)``); None without an optimizer."""
    state = getattr(inner_optimizer(optimizer), "state", None) if optimizer is not None else None
    return None if state is None else len(state)


def step_record(step: int, optimizer: Any, scale: float | None) -> dict[str, Any]:
    """One optimizer step as the window logs it: the GradScaler's scale after it (None without
    fp16), accelerate's ``step_was_skipped``, how many parameters have optimizer state."""
    skipped = getattr(optimizer, "step_was_skipped", None) if optimizer is not None else None
    return {"step": step, "scale": scale, "step_was_skipped": skipped,
            "optimizer_state_entries": optimizer_state_entries(optimizer)}


def optimizer_step_facts(log: list[dict[str, Any]], scale_before: float | None,
                         window_first: int = WINDOW_FIRST_STEP) -> dict[str, Any]:
    """Which logged steps were skipped (the scale fell below the one before, or accelerate says
    so), the first real step, and whether a real step falls in the window (steps
    ``window_first``..): without one, no optimizer state was created or updated while peaks
    were read."""
    skipped, prev = [], scale_before
    for r in log:
        scale = r.get("scale")
        if (scale is not None and prev is not None and scale < prev) or r.get("step_was_skipped"):
            skipped.append(r["step"])
        prev = scale if scale is not None else prev
    real = [r["step"] for r in log if r["step"] not in skipped]
    entries = [r.get("optimizer_state_entries") for r in log]
    return {"scale_before": scale_before, "scales": [r.get("scale") for r in log],
            "skipped_steps": skipped, "fp16_skipped_steps": len(skipped),
            "first_real_step": real[0] if real else None,
            "window_has_optimizer_step": any(s >= window_first for s in real),
            "optimizer_state_entries": entries,
            "optimizer_state_at_window_end": entries[-1] if entries else None}


def case_flags(measured: dict[str, Any] | None) -> dict[str, Any]:
    """Why a run's measurement may not be what the estimate describes: fp16 steps skipped,
    a window without a real optimizer step (its figures miss the optimizer state), allocation
    retries (the allocator freed its cache and retried: reserved was capped by the device),
    more than one device seen by the Trainer (nn.DataParallel)."""
    m = measured or {}
    flags: dict[str, Any] = {}
    steps = m.get("optimizer_steps") or {}
    if steps.get("fp16_skipped_steps"):
        flags["fp16_skipped_steps"] = steps["fp16_skipped_steps"]
    if steps and not steps.get("window_has_optimizer_step"):
        flags["window_without_optimizer_step"] = True
    retries = ((m.get("steady") or m.get("peak_so_far") or {}).get("num_alloc_retries"))
    if retries:
        flags["num_alloc_retries"] = retries
    if (m.get("n_gpu") or 0) > 1:  # the Trainer wrapped the model in nn.DataParallel
        flags["n_gpu"] = m["n_gpu"]
    return flags


def oom_facts(exc: BaseException, *, snapshot: dict[str, Any] | None,
              window: dict[str, Any] | None, nvml_peak: int | None,
              baseline: int | None, during: str) -> dict[str, Any]:
    """What an out-of-memory run measured before it failed: the allocator's peaks since the
    last reset (after step 1 if it ended), step 1's, the NVML peak of the open window."""
    text = str(exc)
    tried = re.search(r"Tried to allocate ([\d.]+ [KMGT]?i?B)", text)
    w = dict(window or {})
    snap = snapshot or {}
    whole = {k: max(v for v in ((w.get("step1") or {}).get(k), snap.get(k)) if v is not None)
             for k in ("max_allocated", "max_reserved")
             if snap.get(k) is not None or (w.get("step1") or {}).get(k) is not None}
    return {"oom": {"exception": type(exc).__name__, "error": text.strip().splitlines()[0][:300]
                    if text.strip() else type(exc).__name__,
                    "tried_to_allocate": tried.group(1) if tried else None, "during": during},
            "peak_so_far": snap, "whole_run_so_far": whole, **w,
            "nvml_used_peak_so_far": nvml_peak,
            "device_used_so_far": (nvml_peak - baseline if nvml_peak is not None
                                   and baseline is not None else None)}


def is_oom(exc: BaseException) -> bool:
    """torch's OutOfMemoryError, or a CUDA error saying out of memory (cuBLAS, cudaMalloc)."""
    if type(exc).__name__ == "OutOfMemoryError":
        return True
    return isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()


def state_dict_bytes(model: Any) -> int:
    """Bytes of the model's state dict, each storage once (tied weights count once), as
    ``caching_allocator_warmup`` sizes its block for an unquantized model."""
    seen, total = set(), 0
    for t in model.state_dict().values():
        if not hasattr(t, "data_ptr"):
            continue
        key = (str(t.device), t.data_ptr(), t.numel())
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


def load_facts(how: str, model: Any, before: dict[str, Any], after: dict[str, Any],
               segments: list[dict[str, int]] | None) -> dict[str, Any]:
    """Memory around one ``from_pretrained``: allocated and reserved after it, the peaks during
    it, and the model's state-dict bytes (the warm-up block on a fresh device)."""
    sd = state_dict_bytes(model)
    return {"how": how, "state_dict_bytes": sd,
            "allocated_before": before.get("allocated"), "reserved_before": before.get("reserved"),
            "allocated_after_load": after.get("allocated"),
            "reserved_after_load": after.get("reserved"),
            "max_allocated_during_load": after.get("max_allocated"),
            "max_reserved_during_load": after.get("max_reserved"),
            "reserved_minus_allocated": (after["reserved"] - after["allocated"]
                                         if after.get("reserved") is not None
                                         and after.get("allocated") is not None else None),
            "largest_segments": segments}


def largest_segments(snapshot: list[dict[str, Any]], n: int = 5) -> list[dict[str, int]]:
    """The ``n`` largest segments of ``torch.cuda.memory_snapshot()``: total and allocated."""
    segs = sorted(snapshot, key=lambda s: -int(s.get("total_size", 0)))[:n]
    return [{"total_size": int(s.get("total_size", 0)),
             "allocated_size": int(s.get("allocated_size", 0)),
             "pool": str(s.get("segment_type", "?"))} for s in segs]
