"""Recovery from out-of-memory errors that keeps the run whole, and allocator snapshots on OOM.

Why a Trainer mixin: a ``TrainerCallback`` cannot catch an exception, and a wrapper around
``trainer.train()`` could only restart the loop (as ``auto_find_batch_size`` does, changing the
effective batch). ``OOMGuardMixin`` overrides the one method every micro-batch goes through,
``Trainer.training_step``, plus the optimizer's ``step`` and ``Trainer.evaluate`` / ``predict``,
so it can retry *inside* the loop:

* an OOM in forward or backward: the gradients of the current optimizer step are dropped
  (``zero_grad(set_to_none=True)``; a backward that failed half-way leaves some of them partial),
  memory is freed (``gc.collect``, ``empty_cache``), the chunk size halves (``oom_next_chunk_size``,
  the hook where a ``Plan`` can supply its next rung), and every micro-batch of this optimizer step
  seen so far (the Trainer prefetches them, so they are still in memory) is replayed in chunks of
  the new size. Each micro-batch of ``b`` samples becomes ``ceil(b / chunk)`` forward/backward
  passes, so the run continues as micro-batch ``chunk`` × accumulation ``GA·b/chunk``: same
  optimizer step, same samples, same effective batch, same learning-rate schedule. Later steps
  keep the smaller chunk.
* an OOM in ``optimizer.step()``: the micro-batch does not change what the step needs (the
  activations are freed by then), so it is not halved. The step is put back exactly as before
  (``step.StepWatch``: version counters, or a host copy with ``oom_step_backup=True``;
  ``step.HostBackup``: pinned while torch can pin it, pageable after, with a warning),
  memory is freed, foreach kernels are switched off and the step is retried once with the same
  gradients. A partial update without a copy, or a second OOM in the same step, raises
  ``OOMRecoveryError`` rather than continue from a half-applied step.
* an OOM in evaluation (``evaluate`` / ``predict``, standalone or inside ``train``): the eval
  batch (``args.per_device_eval_batch_size``) halves for the rest of the run and the evaluation
  starts again; the train batch is untouched. The metrics are those of a run with the smaller
  eval batch (a loss averaged per batch, with padding, can differ in the last digits from the
  larger batch's).

Loss scaling: when the Trainer passes ``num_items_in_batch`` (transformers 5, models that accept
loss kwargs), each chunk's loss is already ``sum of its token losses / items in the whole
accumulated batch``, so the chunks' gradients add up to the micro-batch's exactly. Otherwise the
loss is a mean over the micro-batch, and each chunk's loss is weighted by its share of the
micro-batch's items (label tokens that are not -100, after the causal shift; samples for
sequence-level labels).

Dropout: a replayed step draws new dropout masks (and chunks draw them per chunk), so with
dropout the weights match an uninterrupted run only statistically.

Host memory: pinned memory running out (``cudaHostAlloc``: the DataLoader's ``pin_memory``,
host offload) reads "CUDA error: out of memory", but a smaller batch does not free it
(``detect.host_memory_error``): ``OOMRecoveryError`` at once, naming it and what to change.

Bounded: after ``max_oom_recoveries`` recoveries (forward/backward, optimizer and evaluation
together), when a micro-batch (or an eval batch) of one sample runs out of memory, or when an
optimizer step runs out of memory twice, it raises ``OOMRecoveryError`` naming the optimizer step,
the phase, every setup tried, the snapshot path, if any, and what to change.
Single process only: in DDP/FSDP the other ranks would not replay.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, NoReturn

import torch
from transformers import Trainer

from .._errors import HfMemkitError
from .detect import (  # noqa: F401  (re-exported: hf_memkit.callbacks, MemoryCallback)
    HOST_FIX,
    MEMORY_VIZ,
    OOM_MESSAGES,
    dump_snapshot,
    first_line,
    host_memory_error,
    is_oom_error,
    recording_memory_history,
    snapshot_paths,
    start_memory_history,
    stop_memory_history,
)
from .step import HostBackup, StepWatch, batch_size_of, single_tensor_kernels, split_batch

logger = logging.getLogger(__name__)

# ----------------------------------------------------------------------------------------------
# the guard
# ----------------------------------------------------------------------------------------------


@dataclass
class OOMRecovery:
    """One recovery: where it happened, why, and the setup the run continued with."""

    step: int = field(metadata={"help": "Optimizer step (global_step + 1) that ran out of memory; "
                                        "for 'evaluation', the optimizer steps done before it."})
    where: str = field(metadata={"help": "'forward/backward', 'optimizer step' or 'evaluation'."})
    cause: str = field(metadata={"help": "The error's first line."})
    micro_batch_size: int = field(
        metadata={"help": "Training samples per forward/backward from now on (only a "
                          "forward/backward recovery changes it)."})
    gradient_accumulation_steps: int = field(
        metadata={"help": "Forward/backward passes per optimizer step from now on."})
    effective_batch_size: int = field(metadata={"help": "Unchanged: per device, per step."})
    snapshot: str | None = field(default=None, metadata={"help": "Allocator snapshot, if any."})
    eval_batch_size: int | None = field(
        default=None, metadata={"help": "per_device_eval_batch_size from now on (only an "
                                        "evaluation recovery changes it)."})
    action: str = field(default="", metadata={"help": "What the guard changed, in words."})

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class OOMRecoveryError(HfMemkitError, RuntimeError):
    """Raised when the OOM guard has run out of recoveries, or when host memory ran out (which a
    smaller batch does not free)."""


_PLAN = "or run `hf-memkit plan` (hf_memkit.plan_training) for a setup that fits this GPU"
# What to change when the guard has nothing left to try, by phase (docs/style.md §7).
_FIX = {
    "forward/backward": (
        "turn on gradient checkpointing (activation_checkpointing=True), train in bf16, shorten "
        "the max length (fewer tokens per sample), train LoRA adapters instead of every weight "
        f"(method='lora'), {_PLAN}"),
    "optimizer step": (
        "the micro-batch does not change the optimizer step's memory (weights, gradients, "
        "optimizer state): use an 8-bit optimizer (optim='adamw_bnb_8bit') or Adafactor "
        "(optim='adafactor'), LoRA or QLoRA, shard or offload the optimizer state (FSDP, "
        f"DeepSpeed ZeRO), {_PLAN}"),
    "evaluation": (
        "set eval_accumulation_steps (gathered predictions move to the CPU), keep only what the "
        "metric needs (prediction_loss_only=True or preprocess_logits_for_metrics), evaluate in "
        f"bf16 (bf16_full_eval=True), shorten the max length, {_PLAN}"),
}


class OOMGuardMixin:
    """Mix into a `transformers.Trainer` (before it) to survive OOMs without changing the run.

    `class MyTrainer(OOMGuardMixin, Trainer)`, or use `OOMGuardTrainer`. What each recovery
    does, and when it gives up, is in this module's docstring. `trainer.oom_recoveries` lists
    what happened (`OOMRecovery`); each recovery is also logged (`oom/*` keys).

    Args:
        *args, **kwargs:
            The Trainer's own arguments.
        max_oom_recoveries (`int`, *optional*, defaults to 3):
            Recoveries allowed in the run (forward/backward, optimizer and evaluation together).
        oom_snapshot_dir (`str`, *optional*):
            Where allocator snapshots are written (when history is recorded:
            `MemoryCallback(record_history=True)`); defaults to `args.output_dir`, else `.`.
        oom_next_chunk_size (`Callable[[int], int]`, *optional*):
            `chunk -> smaller chunk` after a forward/backward OOM; default halves it.
        oom_step_backup (`bool`, *optional*, defaults to `False`):
            `True` keeps a host copy of the parameters and optimizer state before each
            optimizer step, so that an OOM after a partial update is undone exactly: host
            memory of their size and one device-to-host copy per step.

    Raises:
        HfMemkitError: At construction, when `max_oom_recoveries` is negative.
        OOMRecoveryError: In training or evaluation, when no recovery is left, when host
            memory runs out, or on an OOM in a run of several processes.
    """

    def __init__(self, *args, max_oom_recoveries: int = 3, oom_snapshot_dir: str | None = None,
                 oom_next_chunk_size: Callable[[int], int] | None = None,
                 oom_step_backup: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        if max_oom_recoveries < 0:
            raise HfMemkitError(f"max_oom_recoveries must be >= 0, got {max_oom_recoveries}")
        self.max_oom_recoveries = max_oom_recoveries
        self.oom_step_backup = bool(oom_step_backup)
        self._oom_backup = HostBackup()
        self._oom_step_retried = -1                 # the optimizer step already retried once
        self._oom_eval_batch0 = self.args.per_device_eval_batch_size
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
                if not self._oom_recoverable(exc, "forward/backward"):
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
        raw = getattr(opt, "optimizer", opt)           # accelerate's AcceleratedOptimizer wraps it

        @functools.wraps(inner_step)  # keeps torch's LR-scheduler mark on the step
        def step(*args, **kwargs):
            while True:
                watch = StepWatch.before_step(
                    raw, self._oom_backup if self.oom_step_backup else None)
                try:
                    return inner_step(*args, **kwargs)
                except Exception as exc:
                    if not self._oom_recoverable(exc, "optimizer step"):
                        raise
                    cause, snapshot = self._oom_note(exc)
                self._oom_retry_step(watch, cause, snapshot)

        opt.step = step
        opt._hf_memkit_oom_guard = True

    def _oom_retry_step(self, watch: StepWatch | None, cause: str, snapshot: str | None) -> None:
        """Undo what the failed step changed, or stop; then free memory and retry it once."""
        where, step = "optimizer step", self.state.global_step + 1
        done, changed = watch.undo() if watch is not None else (False, 0)
        if not done:
            what = (f"after it had changed {changed} of {len(watch.params)} parameter tensors (or "
                    "their state); without a copy they cannot be put back exactly" if watch else
                    "and its state could not be read before the step, so a partial update cannot "
                    "be ruled out")
            self._oom_fail(
                f"the optimizer ran out of memory {what}; the run stops instead of going on from "
                "a half-applied step", where, cause, snapshot,
                fix="pass oom_step_backup=True to the OOM guard (a host copy of the parameters "
                    "and optimizer state before each step) and resume from the last checkpoint, "
                    "or make the step fit: " + _FIX[where])
        self._oom_free(None, drop_grads=False)
        if self._oom_step_retried == step:
            self._oom_fail("out of memory again in the same optimizer step, retried with memory "
                           "freed and without foreach kernels", where, cause, snapshot)
        self._oom_check_budget(where, cause, snapshot)
        self._oom_step_retried = step
        action = ("step put back" + (f" ({changed} changed tensors restored from the host copy)"
                                     if changed else "") + ", memory freed")
        if single_tensor_kernels(watch.opt):
            action += ", foreach kernels off"
        self._oom_record(where, cause, snapshot, action + ", retried with the same gradients")

    # -- the evaluation path --------------------------------------------------------------------

    def evaluate(self, *args, **kwargs):
        return self._oom_guard_eval(super().evaluate, *args, **kwargs)

    def predict(self, *args, **kwargs):
        return self._oom_guard_eval(super().predict, *args, **kwargs)

    def _oom_guard_eval(self, run: Callable[..., Any], *args, **kwargs):
        while True:
            try:
                return run(*args, **kwargs)
            except Exception as exc:
                if not self._oom_recoverable(exc, "evaluation"):
                    raise
                cause, snapshot = self._oom_note(exc)
            self._oom_free(None, drop_grads=False)
            self._oom_shrink_eval(cause, snapshot)

    def _oom_shrink_eval(self, cause: str, snapshot: str | None) -> None:
        where, current = "evaluation", self.args.per_device_eval_batch_size
        new = current // 2
        self._oom_check_budget(where, cause, snapshot)
        if new < 1:
            self._oom_fail(f"out of memory with {current} sample(s) per evaluation batch, which "
                           "cannot be split further", where, cause, snapshot)
        self.args.per_device_eval_batch_size = new
        cached = getattr(self, "_eval_dataloaders", None)   # kept with persistent workers
        if isinstance(cached, dict):
            cached.clear()
        self._oom_record(where, cause, snapshot,
                         f"per_device_eval_batch_size {current} -> {new}, evaluation restarted")

    # -- shared ---------------------------------------------------------------------------------

    def _oom_recoverable(self, exc: BaseException, where: str) -> bool:
        """A device OOM the guard may act on (not its own give-up, whose message quotes the OOM);
        host memory running out stops the run here, saying what to change."""
        if isinstance(exc, OOMRecoveryError):
            return False
        host = host_memory_error(exc, self.args.device.type)
        if host is not None:
            raise OOMRecoveryError(
                f"{host} ran out at {self._oom_when(where)} ({where}): "
                f"{first_line(exc).rstrip('.')}. It is "
                "not the device's memory: a smaller batch would not free it, so the OOM guard "
                f"does not retry. To fix: {HOST_FIX[host]}") from exc
        return is_oom_error(exc)

    def _oom_when(self, where: str) -> str:
        gs = self.state.global_step
        if where != "evaluation":
            return f"optimizer step {gs + 1}"
        return f"the evaluation after optimizer step {gs}" if gs else \
            "the evaluation before any optimizer step"

    def _oom_note(self, exc: BaseException) -> tuple[str, str | None]:
        """The cause, and a snapshot taken while the failed step's memory is still held."""
        if self.args.world_size > 1:
            raise OOMRecoveryError(
                f"out of memory on one of {self.args.world_size} processes; the OOM guard "
                "recovers single-process runs only (other ranks would not replay the step). "
                "Lower per_device_train_batch_size or plan with hf_memkit.plan_training") from exc
        directory = self.oom_snapshot_dir or self.args.output_dir or "."
        name = f"oom_snapshot_step{self.state.global_step + 1}_{len(self.oom_recoveries) + 1}"
        return first_line(exc), dump_snapshot(directory, name)

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

    def _oom_micro_batch(self) -> tuple[int, int]:
        """Samples per forward/backward and passes per optimizer step, as the run goes now."""
        mbs, ga = self.args.per_device_train_batch_size, self.args.gradient_accumulation_steps
        chunk = min(self.oom_chunk_size or mbs, mbs)
        return chunk, ga * math.ceil(mbs / chunk)

    def _setups(self, where: str) -> str:
        if where == "evaluation":
            sizes = [self._oom_eval_batch0] + [r.eval_batch_size for r in self.oom_recoveries
                                               if r.where == where]
            return "per_device_eval_batch_size " + " -> ".join(map(str, sizes))
        mbs, ga = self.args.per_device_train_batch_size, self.args.gradient_accumulation_steps
        out = [f"micro-batch {mbs} x accumulation {ga}"]
        out += [f"micro-batch {r.micro_batch_size} x accumulation {r.gradient_accumulation_steps}"
                for r in self.oom_recoveries if r.where == "forward/backward"]
        return " -> ".join(out)

    def _oom_check_budget(self, where: str, cause: str, snapshot: str | None) -> None:
        if len(self.oom_recoveries) >= self.max_oom_recoveries:
            self._oom_fail(f"out of memory again after {len(self.oom_recoveries)} recoveries "
                           f"(max_oom_recoveries={self.max_oom_recoveries})", where, cause, snapshot)

    def _oom_fail(self, problem: str, where: str, cause: str, snapshot: str | None, *,
                  fix: str | None = None) -> NoReturn:
        snaps = [r.snapshot for r in self.oom_recoveries if r.snapshot] + ([snapshot] if snapshot else [])
        where_snap = (f"; allocator snapshot: {snaps[-1]} (open at {MEMORY_VIZ})" if snaps else
                      "; no allocator snapshot (MemoryCallback(record_history=True) keeps one on CUDA)")
        if fix is None:
            fix = _FIX[where]
            if where == "forward/backward" and self._oom_micro_batch()[0] > 1:
                fix = ("lower per_device_train_batch_size (raise gradient_accumulation_steps to "
                       "keep the effective batch), " + fix)
        raise OOMRecoveryError(f"{problem} at {self._oom_when(where)} ({where}): {cause}. "
                               f"Setups tried: {self._setups(where)}{where_snap}. To fix: {fix}")

    def _oom_replan(self, where: str, cause: str, snapshot: str | None,
                    batch: int | None) -> None:
        mbs = self.args.per_device_train_batch_size
        current = min(self.oom_chunk_size or mbs, batch or mbs)
        new = int(self.oom_next_chunk_size(current))
        self._oom_check_budget(where, cause, snapshot)
        if not 1 <= new < current:
            self._oom_fail(f"out of memory with {current} sample(s) per forward/backward, which "
                           "cannot be split further", where, cause, snapshot)
        self.oom_chunk_size = new
        self._oom_record(where, cause, snapshot,
                         f"micro-batch {current} -> {new}, the step's micro-batches replayed")

    def _oom_record(self, where: str, cause: str, snapshot: str | None, action: str) -> None:
        chunk, ga = self._oom_micro_batch()
        mbs = self.args.per_device_train_batch_size
        rec = OOMRecovery(
            step=self.state.global_step + (where != "evaluation"), where=where, cause=cause,
            micro_batch_size=chunk, gradient_accumulation_steps=ga,
            effective_batch_size=mbs * self.args.gradient_accumulation_steps, snapshot=snapshot,
            eval_batch_size=self.args.per_device_eval_batch_size, action=action)
        self.oom_recoveries.append(rec)
        logger.warning("OOM at %s %d (%s): %s. %s; continuing with micro-batch %d x accumulation "
                       "%d (effective batch %d unchanged), eval batch %d%s",
                       "evaluation after step" if where == "evaluation" else "optimizer step",
                       rec.step, where, cause, action, chunk, ga, rec.effective_batch_size,
                       rec.eval_batch_size, f"; snapshot {snapshot}" if snapshot else "")
        self.log({"oom/recoveries": float(len(self.oom_recoveries)),
                  "oom/micro_batch_size": float(chunk),
                  "oom/gradient_accumulation_steps": float(ga),
                  "oom/eval_batch_size": float(rec.eval_batch_size)})


class OOMGuardTrainer(OOMGuardMixin, Trainer):
    """`transformers.Trainer` with `OOMGuardMixin`: recovers from OOM inside the loop.

    Args:
        *args, **kwargs:
            `transformers.Trainer`'s arguments (`model`, `args`, `train_dataset`, ...).
        max_oom_recoveries (`int`, *optional*, defaults to 3):
            Recoveries allowed in the run (see `OOMGuardMixin`).
        oom_snapshot_dir (`str`, *optional*):
            Where allocator snapshots are written; defaults to `args.output_dir`, else `.`.
        oom_next_chunk_size (`Callable[[int], int]`, *optional*):
            `chunk -> smaller chunk` after a forward/backward OOM; default halves it.
        oom_step_backup (`bool`, *optional*, defaults to `False`):
            Keep a host copy of the parameters and optimizer state before each optimizer step
            (see `OOMGuardMixin`).
    """
