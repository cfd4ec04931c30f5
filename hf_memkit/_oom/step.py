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
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

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


def _host_buffer(t: torch.Tensor, old: torch.Tensor | None) -> torch.Tensor:
    if old is not None and old.shape == t.shape and old.dtype == t.dtype:
        return old
    return torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=t.is_cuda)


class StepWatch:
    """What one optimizer step may change, noted just before it runs (see the module docstring).

    ``notes[p]``: the parameter's version counter and its state (``None`` when it has none):
    for each entry the tensor object and its version, or the plain value. With ``buffers`` (a
    dict kept across steps, so the host memory is allocated once), a host copy of every parameter
    with a gradient and of its state tensors: copies onto pinned memory are queued on the
    current stream before the step's kernels, so they see the values before the step.
    """

    @classmethod
    def before_step(cls, opt, buffers: dict[int, torch.Tensor] | None) -> StepWatch | None:
        """The watch, or ``None`` for an optimizer whose state cannot be read this way (a
        wrapper such as DeepSpeed's): then a partial update cannot be ruled out."""
        try:
            return cls(opt, buffers)
        except (AttributeError, KeyError, TypeError, RuntimeError) as exc:
            logger.debug("OOM guard: cannot note %s's state (%s)", type(opt).__name__, exc)
            return None

    def __init__(self, opt: torch.optim.Optimizer, buffers: dict[int, torch.Tensor] | None):
        self.opt = opt
        self.params = [p for group in opt.param_groups for p in group["params"]]
        self.notes = {p: self._note(p) for p in self.params}
        self.copies: dict[int, torch.Tensor] | None = None
        if buffers is not None:
            self.copies = self._copy(buffers)

    def _note(self, p: torch.Tensor):
        state = self.opt.state.get(p)
        if not state:
            return p._version, None
        return p._version, {k: (v, v._version) if torch.is_tensor(v) else (None, v)
                            for k, v in state.items()}

    def _copy(self, buffers: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        old, copies = dict(buffers), {}
        for p in self.params:
            if p.grad is None:
                continue
            tensors = [p] + [v for v in (self.opt.state.get(p) or {}).values() if torch.is_tensor(v)]
            for t in tensors:
                buf = _host_buffer(t, old.get(id(t)))
                buf.copy_(t.detach(), non_blocking=buf.is_pinned())
                copies[id(t)] = buf
        buffers.clear()
        buffers.update(copies)
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
