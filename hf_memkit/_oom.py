"""Recovery from out-of-memory errors that keeps the run whole, and allocator snapshots on OOM.

Why a Trainer mixin: a ``TrainerCallback`` cannot catch an exception, and a wrapper around
``trainer.train()`` could only restart the loop (as ``auto_find_batch_size`` does, changing the
effective batch). ``OOMGuardMixin`` overrides the one method every micro-batch goes through,
``Trainer.training_step``, plus the optimizer's ``step``, so it can retry *inside* the loop:

* an OOM in forward or backward: the gradients of the current optimizer step are dropped
  (``zero_grad(set_to_none=True)``; a backward that failed half-way leaves some of them partial),
  memory is freed (``gc.collect``, ``empty_cache``), the chunk size halves (``oom_next_chunk_size``,
  the hook where a ``Plan`` can supply its next rung), and every micro-batch of this optimizer step
  seen so far (the Trainer prefetches them, so they are still in memory) is replayed in chunks of
  the new size. Each micro-batch of ``b`` samples becomes ``ceil(b / chunk)`` forward/backward
  passes, so the run continues as micro-batch ``chunk`` × accumulation ``GA·b/chunk``: same
  optimizer step, same samples, same effective batch, same learning-rate schedule. Later steps
  keep the smaller chunk.
* an OOM in ``optimizer.step()``: the gradients are kept, memory is freed, foreach kernels are
  switched off (they allocate a copy of the state per op) and the step is retried. This is exact
  when the OOM happened before the optimizer changed any state: the usual case, the first step's
  state allocation (``_init_group`` makes the state before any math).

Loss scaling: when the Trainer passes ``num_items_in_batch`` (transformers 5, models that accept
loss kwargs), each chunk's loss is already ``sum of its token losses / items in the whole
accumulated batch``, so the chunks' gradients add up to the micro-batch's exactly. Otherwise the
loss is a mean over the micro-batch, and each chunk's loss is weighted by its share of the
micro-batch's items (label tokens that are not -100, after the causal shift; samples for
sequence-level labels).

Bounded: after ``max_oom_recoveries`` recoveries, or when a micro-batch of one sample runs out of
memory, it raises ``OOMRecoveryError`` naming every setup tried and the snapshot path, if any.
Single process only: in DDP/FSDP the other ranks would not replay.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from transformers import Trainer

from ._errors import HfMemkitError

logger = logging.getLogger(__name__)

# The wording accelerate's batch-size finder (and so auto_find_batch_size) also keys on.
OOM_MESSAGES = ("CUDA out of memory", "MPS backend out of memory",
                "DefaultCPUAllocator: can't allocate memory")
MEMORY_VIZ = "https://pytorch.org/memory_viz"


def is_oom_error(exc: BaseException) -> bool:
    """``torch.OutOfMemoryError``, or a ``RuntimeError`` carrying CUDA's (MPS's) OOM wording."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc) for m in OOM_MESSAGES)


# ----------------------------------------------------------------------------------------------
# allocator history and snapshots (CUDA)
# ----------------------------------------------------------------------------------------------

_recording = False
_snapshots: list[str] = []


def start_memory_history(max_entries: int = 100_000) -> bool:
    """Record the CUDA caching allocator's history (for a snapshot on OOM); call on CUDA only."""
    global _recording
    try:
        torch.cuda.memory._record_memory_history(max_entries=max_entries)
    except Exception as exc:  # private API (STYLE.md §11): say which feature is lost
        logger.warning("cannot record CUDA memory history (%s); no snapshot on OOM", exc)
        return False
    _recording = True
    return True


def stop_memory_history() -> None:
    global _recording
    if _recording:
        try:
            torch.cuda.memory._record_memory_history(enabled=None)
        except Exception:
            pass
    _recording = False


def recording_memory_history() -> bool:
    return _recording


def dump_snapshot(directory: str, name: str) -> str | None:
    """Write ``<directory>/<name>.pickle`` (pytorch.org/memory_viz format) if history is on."""
    if not _recording:
        return None
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"{name}.pickle")
    try:
        torch.cuda.memory._dump_snapshot(path)
    except Exception as exc:
        logger.warning("could not dump the CUDA memory snapshot (%s)", exc)
        return None
    _snapshots.append(path)
    logger.warning("CUDA memory snapshot written to %s (open it at %s)", path, MEMORY_VIZ)
    return path


def snapshot_paths() -> tuple[str, ...]:
    return tuple(_snapshots)


# ----------------------------------------------------------------------------------------------
# the guard
# ----------------------------------------------------------------------------------------------


@dataclass
class OOMRecovery:
    """One recovery: where it happened, why, and the setup the run continued with."""

    step: int = field(metadata={"help": "Optimizer step (global_step + 1) that ran out of memory."})
    where: str = field(metadata={"help": "'forward/backward' or 'optimizer step'."})
    cause: str = field(metadata={"help": "The error's first line."})
    micro_batch_size: int = field(metadata={"help": "Samples per forward/backward from now on."})
    gradient_accumulation_steps: int = field(
        metadata={"help": "Forward/backward passes per optimizer step from now on."})
    effective_batch_size: int = field(metadata={"help": "Unchanged: per device, per step."})
    snapshot: str | None = field(default=None, metadata={"help": "Allocator snapshot, if any."})

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class OOMRecoveryError(HfMemkitError, RuntimeError):
    """Raised when the OOM guard has run out of recoveries."""


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


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


class OOMGuardMixin:
    """Mix into a ``transformers.Trainer`` (before it) to survive OOMs without changing the run.

    ``class MyTrainer(OOMGuardMixin, Trainer)`` or use ``OOMGuardTrainer``. Extra keyword
    arguments: ``max_oom_recoveries`` (3), ``oom_snapshot_dir`` (``output_dir``),
    ``oom_next_chunk_size`` (``chunk -> smaller chunk``; default halves it).
    ``trainer.oom_recoveries`` lists what happened; each recovery is also logged (``oom/*`` keys).
    """

    def __init__(self, *args, max_oom_recoveries: int = 3, oom_snapshot_dir: str | None = None,
                 oom_next_chunk_size: Callable[[int], int] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        if max_oom_recoveries < 0:
            raise HfMemkitError(f"max_oom_recoveries must be >= 0, got {max_oom_recoveries}")
        self.max_oom_recoveries = max_oom_recoveries
        self.oom_snapshot_dir = oom_snapshot_dir
        self.oom_next_chunk_size = oom_next_chunk_size or (lambda chunk: chunk // 2)
        self.oom_recoveries: list[OOMRecovery] = []
        self.oom_chunk_size: int | None = None      # samples per forward; None = whole micro-batch
        self._oom_loss_weight: Any = None
        self._oom_step = -1
        self._oom_pending: list[tuple[Any, Any]] = []
        self._oom_replay = False

    # -- the micro-batch path -------------------------------------------------------------------

    def training_step(self, model, inputs, num_items_in_batch=None):
        self._oom_guard_optimizer()
        if self.state.global_step != self._oom_step:    # a new optimizer step begins
            self._oom_step, self._oom_pending, self._oom_replay = self.state.global_step, [], False
        self._oom_pending.append((inputs, num_items_in_batch))
        while True:
            try:
                if self._oom_replay:
                    for prev, prev_n in self._oom_pending[:-1]:
                        with self.accelerator.no_sync(model):
                            self._oom_forward_backward(model, prev, prev_n)
                    self._oom_replay = False
                return self._oom_forward_backward(model, inputs, num_items_in_batch)
            except Exception as exc:
                if not is_oom_error(exc):
                    raise
                cause, snapshot = self._oom_note(exc)
            # Outside the except block: the traceback (and the activations its frames hold) is gone.
            self._oom_free(model, drop_grads=True)
            self._oom_replan("forward/backward", cause, snapshot, batch_size_of(inputs))
            self._oom_replay = len(self._oom_pending) > 1

    def _oom_forward_backward(self, model, inputs, num_items_in_batch):
        chunks = split_batch(inputs, self.oom_chunk_size)
        if len(chunks) == 1:
            return super().training_step(model, inputs, num_items_in_batch)
        weights = None if self._oom_loss_scaled(num_items_in_batch) else self._oom_weights(chunks)
        total = None
        for i, chunk in enumerate(chunks):
            last = i == len(chunks) - 1
            self._oom_loss_weight = None if weights is None else weights[i]
            try:
                with contextlib.nullcontext() if last else self.accelerator.no_sync(model):
                    loss = super().training_step(model, chunk, num_items_in_batch)
            finally:
                self._oom_loss_weight = None
            total = loss if total is None else total + loss
        return total

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        out = super().compute_loss(model, inputs, return_outputs=return_outputs,
                                   num_items_in_batch=num_items_in_batch)
        w = self._oom_loss_weight
        if w is None:
            return out
        loss = out[0] if return_outputs else out
        if torch.is_tensor(w):
            w = w.to(loss.dtype)
        if return_outputs:
            return out[0] * w, out[1]
        return out * w

    def _oom_loss_scaled(self, num_items_in_batch) -> bool:
        """Whether the loss is already normalised over the whole accumulated batch (as Trainer)."""
        scaled = getattr(self, "loss_is_scaled_for_ga", None)
        if scaled is not None:
            return bool(scaled)
        return bool((self.model_accepts_loss_kwargs and num_items_in_batch is not None)
                    or self.compute_loss_func is not None)

    def _oom_weights(self, chunks: list[dict[str, Any]]) -> list[Any]:
        """Each chunk's share of the micro-batch's loss items (no host sync)."""
        counts = []
        for c in chunks:
            labels = c.get("labels")
            if torch.is_tensor(labels) and labels.dim() >= 2:
                if getattr(self, "_loss_shifts_labels", False):
                    labels = labels[..., 1:]
                counts.append(labels.ne(-100).sum().double())
            else:
                counts.append(float(batch_size_of(c) or 1))
        total = sum(counts)
        return [n / total for n in counts]

    # -- the optimizer path ---------------------------------------------------------------------

    def _oom_guard_optimizer(self) -> None:
        opt = self.optimizer
        if opt is None or getattr(opt, "_hf_memkit_oom_guard", False):
            return
        inner_step = opt.step

        @functools.wraps(inner_step)  # keeps torch's LR-scheduler mark on the step
        def step(*args, **kwargs):
            while True:
                try:
                    return inner_step(*args, **kwargs)
                except Exception as exc:
                    if not is_oom_error(exc):
                        raise
                    cause, snapshot = self._oom_note(exc)
                self._oom_free(None, drop_grads=False)
                for group in opt.param_groups:
                    if group.get("foreach"):
                        group["foreach"] = False
                self._oom_replan("optimizer step", cause, snapshot,
                                 self.oom_chunk_size or self.args.per_device_train_batch_size)

        opt.step = step
        opt._hf_memkit_oom_guard = True

    # -- shared ---------------------------------------------------------------------------------

    def _oom_note(self, exc: BaseException) -> tuple[str, str | None]:
        """The cause, and a snapshot taken while the failed step's memory is still held."""
        if self.args.world_size > 1:
            raise OOMRecoveryError(
                f"out of memory on one of {self.args.world_size} processes; the OOM guard "
                "recovers single-process runs only (other ranks would not replay the step). "
                "Lower per_device_train_batch_size or plan with hf_memkit.plan_training") from exc
        directory = self.oom_snapshot_dir or self.args.output_dir or "."
        name = f"oom_snapshot_step{self.state.global_step + 1}_{len(self.oom_recoveries) + 1}"
        return _first_line(exc), dump_snapshot(directory, name)

    def _oom_free(self, model, *, drop_grads: bool) -> None:
        if drop_grads:
            if model is not None:
                model.zero_grad(set_to_none=True)
            if self.optimizer is not None:
                self.optimizer.zero_grad(set_to_none=True)
        gc.collect()
        kind = self.args.device.type
        if kind == "cuda":
            torch.cuda.empty_cache()
        elif kind == "mps":
            torch.mps.empty_cache()

    def _setups(self) -> list[str]:
        mbs, ga = self.args.per_device_train_batch_size, self.args.gradient_accumulation_steps
        out = [f"micro-batch {mbs} x accumulation {ga}"]
        out += [f"micro-batch {r.micro_batch_size} x accumulation {r.gradient_accumulation_steps}"
                for r in self.oom_recoveries]
        return out

    def _oom_replan(self, where: str, cause: str, snapshot: str | None,
                    batch: int | None) -> None:
        mbs, ga = self.args.per_device_train_batch_size, self.args.gradient_accumulation_steps
        current = min(self.oom_chunk_size or mbs, batch or mbs)
        new = int(self.oom_next_chunk_size(current))
        snaps = [r.snapshot for r in self.oom_recoveries if r.snapshot] + ([snapshot] if snapshot else [])
        where_snap = (f"; allocator snapshot: {snaps[-1]} (open at {MEMORY_VIZ})" if snaps else
                      "; no allocator snapshot (MemoryCallback(record_history=True) keeps one on CUDA)")
        problem = None
        if len(self.oom_recoveries) >= self.max_oom_recoveries:
            problem = f"out of memory again after {len(self.oom_recoveries)} recoveries " \
                      f"(max_oom_recoveries={self.max_oom_recoveries})"
        elif not 1 <= new < current:
            problem = (f"out of memory with {current} sample(s) per forward/backward, which cannot "
                       "be split further")
        if problem:
            raise OOMRecoveryError(
                f"{problem} at optimizer step {self.state.global_step + 1} ({where}): {cause}. "
                f"Setups tried: {' -> '.join(self._setups())}{where_snap}. To fix: lower "
                "per_device_train_batch_size, turn on gradient checkpointing or a lighter "
                "optimizer, or let hf_memkit.plan_training choose a setup that fits")
        self.oom_chunk_size = new
        rec = OOMRecovery(step=self.state.global_step + 1, where=where, cause=cause,
                          micro_batch_size=new, gradient_accumulation_steps=ga * math.ceil(mbs / new),
                          effective_batch_size=mbs * ga, snapshot=snapshot)
        self.oom_recoveries.append(rec)
        logger.warning("OOM at optimizer step %d (%s): %s. Continuing with micro-batch %d x "
                       "accumulation %d (effective batch %d unchanged)%s", rec.step, where, cause,
                       new, rec.gradient_accumulation_steps, rec.effective_batch_size,
                       f"; snapshot {snapshot}" if snapshot else "")
        self.log({"oom/recoveries": float(len(self.oom_recoveries)),
                  "oom/micro_batch_size": float(new),
                  "oom/gradient_accumulation_steps": float(rec.gradient_accumulation_steps)})


class OOMGuardTrainer(OOMGuardMixin, Trainer):
    """``transformers.Trainer`` with ``OOMGuardMixin``: recovers from OOM inside the loop."""
