"""Redoing one optimizer step after an OOM: split a micro-batch into chunks, and put the
optimizer's parameters and state back as they were before a step that failed.

An OOM in ``optimizer.step()``: before each step the guard notes what the step may change: the
version counter of every parameter and state tensor (bumped by every in-place op) and the
state's plain values (``step`` counts), host-side reads with no copy and no device sync. Fused
kernels leave their tensors' counters alone but bump the ``step`` tensor before they run. After
an OOM: if nothing changed (the usual case: the first step's state allocation, or a temporary
before any update), state made during the failed call is dropped; if something changed and
``oom_step_backup=True`` kept a host copy of the parameters and optimizer state, the changed
ones are copied back. Either way the step is then exactly as before.

The host copy (``HostBackup``) is pinned for tensors on CUDA, so that the copies are queued on
the stream without waiting. When torch cannot pin it (cudaHostAlloc fails: pinned memory ran
out), the guard says so and keeps the copy in pageable memory from then on (each copy then
waits for the device; the undo stays exact). When the host has no memory for the copy at all,
the guard says so and that step has none: an OOM after a partial update then stops the run.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

from .detect import first_line

logger = logging.getLogger("hf_memkit._oom.guard")


def batch_size_of(inputs: Mapping[str, Any]) -> int | None:
    for key in ("input_ids", "inputs_embeds", "pixel_values", "input_values", "labels"):
        v = inputs.get(key)
        if torch.is_tensor(v) and v.dim() >= 1:
            return int(v.shape[0])
    for v in inputs.values():
        if torch.is_tensor(v) and v.dim() >= 1:
            return int(v.shape[0])
    return None


def split_batch(inputs: Mapping[str, Any], chunk: int | None) -> list[dict[str, Any]]:
    """Split every tensor whose first dimension is the batch into chunks of ``chunk`` samples."""
    b = batch_size_of(inputs)
    if chunk is None or b is None or b <= chunk:
        return [inputs]
    out = []
    for start in range(0, b, chunk):
        out.append({k: v[start:start + chunk] if torch.is_tensor(v) and v.dim() >= 1
                    and v.shape[0] == b else v for k, v in inputs.items()})
    return out


class HostBackup:
    """The host copies of parameters and optimizer state (``oom_step_backup=True``), kept across
    steps so that host memory is allocated once; pinned for tensors on CUDA until torch cannot
    pin any more, pageable from then on."""

    def __init__(self):
        self.buffers: dict[int, torch.Tensor] = {}
        self.pinned = True          # pin copies of CUDA tensors (until pinning fails once)
        self.warned_none = False

    def buffer(self, t: torch.Tensor, old: torch.Tensor | None) -> torch.Tensor | None:
        """A host tensor for ``t``'s copy (``old`` when it still fits), or ``None`` when the host
        has no memory for it."""
        if old is not None and old.shape == t.shape and old.dtype == t.dtype:
            return old
        if self.pinned and t.is_cuda:
            try:
                return torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
            except RuntimeError as exc:     # cudaHostAlloc failed: "CUDA error: out of memory"
                self.pinned = False
                logger.warning(
                    "OOM guard: the optimizer-step backup (oom_step_backup=True) could not get "
                    "pinned (page-locked) host memory (%s); it uses pageable host memory from now "
                    "on: each step's copy to the host waits for the GPU (slower), and an OOM after "
                    "a partial update is still undone exactly. To keep it pinned, free host RAM "
                    "or pin less elsewhere (dataloader_pin_memory=False, less offload to the host)",
                    first_line(exc))
        try:
            return torch.empty(t.shape, dtype=t.dtype, device="cpu")
        except RuntimeError as exc:         # "DefaultCPUAllocator: can't allocate memory"
            if not self.warned_none:
                self.warned_none = True
                logger.warning(
                    "OOM guard: no host memory for the optimizer-step backup (oom_step_backup="
                    "True) (%s); a step without it cannot undo a partial update: an OOM after one "
                    "stops the run (OOMRecoveryError) instead. Free host RAM to keep the backup",
                    first_line(exc))
            return None


class StepWatch:
    """What one optimizer step may change, noted just before it runs (see the module docstring).

    ``notes[p]``: the parameter's version counter and its state (``None`` when it has none):
    for each entry the tensor object and its version, or the plain value. With ``backup``, a
    host copy of every parameter with a gradient and of its state tensors (``copies``; ``None``
    when the host had no memory for them): copies onto pinned memory are queued on the current
    stream before the step's kernels, so they see the values before the step.
    """

    @classmethod
    def before_step(cls, opt, backup: HostBackup | None) -> StepWatch | None:
        """The watch, or ``None`` for an optimizer whose state cannot be read this way (a
        wrapper such as DeepSpeed's): then a partial update cannot be ruled out."""
        try:
            return cls(opt, backup)
        except (AttributeError, KeyError, TypeError, RuntimeError) as exc:
            logger.debug("OOM guard: cannot note %s's state (%s)", type(opt).__name__, exc)
            return None

    def __init__(self, opt: torch.optim.Optimizer, backup: HostBackup | None):
        self.opt = opt
        self.params = [p for group in opt.param_groups for p in group["params"]]
        self.notes = {p: self._note(p) for p in self.params}
        self.copies: dict[int, torch.Tensor] | None = None
        if backup is not None:
            self.copies = self._copy(backup)

    def _note(self, p: torch.Tensor):
        state = self.opt.state.get(p)
        if not state:
            return p._version, None
        return p._version, {k: (v, v._version) if torch.is_tensor(v) else (None, v)
                            for k, v in state.items()}

    def _copy(self, backup: HostBackup) -> dict[int, torch.Tensor] | None:
        old, copies = backup.buffers, {}
        for p in self.params:
            if p.grad is None:
                continue
            tensors = [p] + [v for v in (self.opt.state.get(p) or {}).values() if torch.is_tensor(v)]
            for t in tensors:
                buf = backup.buffer(t, old.get(id(t)))
                if buf is None:
                    return None         # all or nothing: ``undo`` restores every state tensor
                buf.copy_(t.detach(), non_blocking=buf.is_pinned())
                copies[id(t)] = buf
        backup.buffers = copies
        return copies

    def _changed(self, p: torch.Tensor) -> bool:
        version, before = self.notes[p]
        if p._version != version:
            return True
        if before is None:
            return False            # state made in the failed call is fresh: dropped, made again
        now = self.opt.state.get(p) or {}
        if now.keys() != before.keys():
            return True
        for k, (t, v) in before.items():
            if t is not None and (now[k] is not t or t._version != v):
                return True
            if t is None and (torch.is_tensor(now[k]) or now[k] != v):
                return True
        return False

    def undo(self) -> tuple[bool, int]:
        """Put every parameter and its state back as before the step; ``(done, changed)``."""
        changed = [p for p in self.params if self._changed(p)]
        if changed and (self.copies is None or any(id(p) not in self.copies for p in changed)):
            return False, len(changed)
        changed_ids = {id(p) for p in changed}
        with torch.no_grad():
            for p in self.params:
                self._restore(p, id(p) in changed_ids)
        return True, len(changed)

    def _restore(self, p: torch.Tensor, changed: bool) -> None:
        _, before = self.notes[p]
        if before is None:
            self.opt.state.pop(p, None)
            if changed:
                p.copy_(self.copies[id(p)], non_blocking=True)
            return
        if not changed:
            return
        p.copy_(self.copies[id(p)], non_blocking=True)
        state = self.opt.state[p]
        state.clear()
        for k, (t, v) in before.items():
            if t is not None:
                t.copy_(self.copies[id(t)], non_blocking=True)
            state[k] = t if t is not None else v


def single_tensor_kernels(opt: torch.optim.Optimizer) -> bool:
    """Switch multi-tensor (foreach) kernels off; fused kernels stay. Whether any were on:
    ``foreach=None`` leaves it to torch, which picks them when every tensor is on an
    accelerator (not on the CPU)."""
    was_on = False
    for group in opt.param_groups:
        if "foreach" not in group or group["foreach"] is False or group.get("fused"):
            continue
        was_on = was_on or bool(group["foreach"]) or all(
            p.device.type != "cpu" for p in group["params"])
        group["foreach"] = False
    return was_on
