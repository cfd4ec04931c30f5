"""``MemoryCallback``: memory in the Trainer's logs, actual vs predicted, and a report at the end.

At each logging step it adds (GiB unless named otherwise; axolotl's names in brackets):

    memory/allocated_gib         live tensor bytes now (CPU: RSS minus the non-tensor baseline)
    memory/reserved_gib          caching-allocator reserved now (CPU: = allocated)
                                 [memory/device_reserved]
    memory/peak_allocated_gib    peak allocated since the previous log [memory/max_allocated]
    memory/peak_active_gib       peak active bytes since the previous log (CUDA only:
                                 ``memory_stats()["active_bytes.all.peak"]``: blocks in use,
                                 those freed but still awaiting another stream included)
                                 [memory/max_active]
    memory/peak_reserved_gib     peak reserved since the previous log (CPU: = peak allocated)
    memory/fragmentation_gib     reserved - allocated
    memory/peak_forward_gib      peak of the model's forward calls in the logged step
    memory/peak_backward_gib     peak from the end of a forward to the next forward or to the
                                 optimizer step: the backward, loss code outside the model,
                                 gradient clipping (both: ``_phases``, where they separate)
    memory/peak_fwd_bwd_gib      peak of forward + backward (all micro-batches) of the logged step
    memory/peak_optimizer_gib    peak of the optimizer step of the logged step
    memory/peak_generate_gib     TRL's GRPO / RLOO: peak of the model's generate in the logged
                                 step (its own; a colocated vLLM shows in process_used)
    memory/peak_score_gib        ... and of its forwards without grad (old and reference
                                 log-probs)
    memory/peak_eval_gib         peak of an evaluation run during training; in that
                                 evaluation's log (its keys are ``eval_*``)
    memory/nvml_used_gib         the whole device's used memory as nvidia-smi shows it: every
                                 process and the driver's reservation (CUDA with nvidia-ml-py;
                                 on MIG, the instance's)
    memory/process_used_gib      what NVML lists for this process on the device (its context
                                 and the allocator's segments): the quantity
                                 ``MemoryEstimate.device_used`` predicts, and what
                                 ``calibrate=True`` compares with it
    memory/other_processes_gib   memory NVML lists for the other processes on this device (a
                                 colocated job, a stray context of another rank); where NVML
                                 permits (``_nvml``)
    memory/gpu_util              NVML utilisation, percent (NVML has none for MIG instances)
    memory/rss_gib               resident set size of the process (CPU)
    memory/predicted_peak_gib    MemoryEstimate.peak_allocated (when an estimate or plan is given)
    memory/actual_over_predicted  peak_allocated / predicted
    memory/peak_allocated_rank   with several ranks: the rank whose device holds the peak

Ranks: under torch.distributed with more than one rank (DDP, FSDP, ZeRO) each rank reads its own
device, and every reading above is the MAXIMUM over the ranks (the estimate is per rank, so
``actual_over_predicted`` compares the fullest rank with it). Every rank takes part in one
``all_reduce`` at each logging step (``_ranks``), so every rank needs the callback
(``across_ranks=False`` turns this off); rank 0 writes the logs, the report and the plot.
Each NVML field fails on its own: a MIG instance without utilisation still logs its memory.

With ``calibrate=True`` (CUDA, an estimate given, NVML's used memory readable) the first log at or
after step ``CALIBRATE_AFTER_STEP`` also appends NVML used / the estimate's ``device_used`` - 1 to
the stored calibration of this GPU (``hf-memkit calibrate`` must have made one), once per run;
where NVML gave no used memory, the warning says why (not installed, not started, refused).

Cost: on a step that does not log it does one integer test per event (and one attribute test
per model forward, in the phase hooks); the peak-since-last-log comes from the allocator's (or
the kernel's) own high-water mark, reset at each log, so nothing is read in between. The
per-phase peaks are taken on the step that will log (known in advance from ``logging_steps``):
the peak is read and reset at ``on_step_begin``, around each model forward,
``on_pre_optimizer_step`` and ``on_optimizer_step``, and around an evaluation; each reading is
folded into the peak-since-last-log. No reading synchronises the device (the cross-rank reduce
on NCCL waits for it, at logging steps only).

``TrainerMemoryTracker`` (``skip_memory_metrics=False``) resets the same peak statistic when
``train()`` starts and reads it when training ends, so the resets above would shrink its
``train_mem_gpu_peaked_delta`` to the peak since the last log. The callback keeps the largest
peak it read since training began and, in the train-end log that carries the tracker's metrics
(before any reporter sees it; the same dict ``train()`` returns), puts back the tracker's number
for the whole run: that peak minus memory allocated at the end. The tracker's own reset happens
before ``on_train_begin``, so it never shortens the callback's windows. Evaluation outside
``train()`` is left to the tracker alone.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from transformers import TrainerCallback

from .._device.probe import warn_once
from .._device.rss import mmap_threshold_set
from .._errors import ConfigError, quoted
from .._oom import guard as _oom
from .._units import GiB, is_positive_int
from ._calibrate import (
    can_calibrate,
    predicted_device_used,  # noqa: F401  (its home before; still read here)
    write_residual,
)
from ._order import add_to_logs, move_ahead_of_reporters
from ._phases import StepPhases
from ._ranks import collective_device, reduce_max, world
from ._readers import CpuReader, CudaReader, MpsReader, Reader, make_reader

logger = logging.getLogger(__name__)

MMAP_HINT = ("MemoryCallback: CPU memory readings (memory/*_gib) read low, by 25-45% on small "
             "models, because MALLOC_MMAP_THRESHOLD_ was not set when this process started: "
             "glibc serves new tensors from heap memory it already holds, which RSS does not "
             "count again. For exact readings start Python with it: "
             "`MALLOC_MMAP_THRESHOLD_=65536 python train.py` (`hf-memkit train` sets it itself)")
PREFIX = "memory/"
CALIBRATE_AFTER_STEP = 3   # the first steps allocate lazily (optimizer state, kernels, workspaces)
# the readings reduced across ranks (the same keys, in the same order, on every rank)
REDUCED = ("allocated", "reserved", "peak_allocated", "peak_active", "peak_reserved",
           "fragmentation", "peak_forward", "peak_backward", "peak_fwd_bwd", "peak_optimizer",
           "nvml_used", "process_used", "other_processes", "gpu_util", "rss")
TRACKER_KEY = "train_mem_gpu_peaked_delta"   # TrainerMemoryTracker's train-stage GPU peak


def predicted_peak(estimate: Any) -> int | None:
    """``peak_allocated`` of a ``MemoryEstimate``, of a ``Plan`` (its ``.estimate``), or None."""
    if estimate is None:
        return None
    est = getattr(estimate, "estimate", estimate)
    peak = getattr(est, "peak_allocated", None)
    return int(peak) if peak is not None else None


def will_log(args, state) -> bool:
    """Whether the step about to run (``global_step + 1``) ends with a log (DefaultFlowCallback)."""
    nxt = state.global_step + 1
    if nxt == 1 and args.logging_first_step:
        return True
    every = state.logging_steps
    return args.logging_strategy == "steps" and bool(every) and nxt % every == 0


class MemoryCallback(TrainerCallback):
    """Log device memory at each logging step into every `report_to` backend and `log_history`.

    The keys (`memory/*`) and the cost are in this module's docstring; rank 0 writes the logs,
    and at train end the report and the plot into `args.output_dir` (`write_outputs`).

    Args:
        estimate (`MemoryEstimate` or `Plan`, *optional*):
            A `MemoryEstimate`, a `Plan` (anything with `.estimate`) or anything with
            `.peak_allocated`; adds predicted-vs-actual keys and a line on the timeline.
        plot (`bool`, *optional*, defaults to `True`):
            Write `memory_timeline.png` at train end (needs matplotlib).
        report (`bool`, *optional*, defaults to `True`):
            Write `memory_report.json` at train end.
        record_history (`bool`, *optional*, defaults to `False`):
            On CUDA, record the allocator's history from train begin
            (`torch.cuda.memory._record_memory_history`) so that an OOM caught by the OOM guard
            dumps a snapshot pytorch.org/memory_viz opens. Each event keeps its Python stack
            only (`stacks="python"`): torch's default also unwinds the C++ stack at every
            allocation and free (larger entries, a slower dump on OOM).
        max_entries (`int`, *optional*, defaults to 100000):
            History ring-buffer size (alloc/free events) when `record_history`.
        calibrate (`bool`, *optional*, defaults to `False`):
            On CUDA with an estimate, append measured/predicted of `device_used` (NVML) to this
            GPU's stored calibration once, at the first log from step 3 on.
        across_ranks (`bool`, *optional*, defaults to `True`):
            Under torch.distributed, log the maximum over the ranks (every rank must then have
            this callback, as when one script builds the Trainer on every rank: each logging
            step is a collective). `False`: rank 0 logs its own readings, no collective.
    """

    def __init__(self, estimate: Any = None, *, plot: bool = True, report: bool = True,
                 record_history: bool = False, max_entries: int = 100_000,
                 calibrate: bool = False, across_ranks: bool = True):
        problems = [] if estimate is None or hasattr(estimate, "peak_allocated") or \
            hasattr(estimate, "estimate") else [
                f"estimate: expected a MemoryEstimate or a Plan (or None), got "
                f"{type(estimate).__name__} {quoted(estimate)}"]
        if not is_positive_int(max_entries):
            problems.append(f"max_entries: expected a positive number of allocator events, got "
                            f"{quoted(max_entries)}")
        problems += [f"{name}: expected True or False, got {quoted(v)}" for name, v in (
            ("plot", plot), ("report", report), ("record_history", record_history),
            ("calibrate", calibrate), ("across_ranks", across_ranks)) if not isinstance(v, bool)]
        if problems:
            raise ConfigError(problems, source="MemoryCallback")
        self.estimate = estimate
        self.calibrate = calibrate
        self.across_ranks = across_ranks
        self.plot = plot
        self.report = report
        self.record_history = record_history
        self.max_entries = max_entries
        self.timeline: list[dict[str, Any]] = []
        self.evals: list[dict[str, Any]] = []
        self.events: list[dict[str, Any]] = []
        self.report_path: str | None = None
        self.plot_path: str | None = None
        self._reader: Reader | None = None
        self._phases: StepPhases | None = None
        self._predicted: int | None = None
        self._world: tuple[int, int] | None = None
        self._main = True
        self._warned: set[str] = set()
        self.status: dict[str, Any] = {"state": "running"}   # "completed" at train end

    # -- helpers -------------------------------------------------------------------------------

    def _warn_once(self, key: str, msg: str) -> None:
        if self._main and key not in self._warned:
            self._warned.add(key)
            logger.warning(msg)

    def _read_peak(self) -> int | None:
        """Fold the peaks since the last reading into the log window, reset them; the allocated
        peak (None without a peak statistic)."""
        peaks = self._reader.peaks()
        for name, value in peaks.items():
            if value is not None:
                self._window[name] = max(self._window.get(name, 0), value)
        if peaks.get("allocated") is not None:
            self._run_peak = max(self._run_peak, peaks["allocated"])
        self._reader.reset_peak()
        return peaks.get("allocated")

    def _across_ranks(self, args, rec: dict[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
        """``rec`` with each of ``keys`` the maximum over the ranks (a collective: every rank
        calls it at the same log), and ``peak_allocated_rank``."""
        if self._world is None:
            return rec
        try:
            values, ranks = reduce_max(rec, keys, self._world,
                                       collective_device(getattr(args, "device", None)))
        except Exception as exc:
            logger.warning("memory readings not reduced across ranks (%s); rank %d logs its "
                           "own", exc, self._world[0])
            return rec
        out = {k: v for k, v in rec.items() if k not in keys}
        out.update({k: v for k, v in values.items() if v is not None})
        if "peak_allocated" in ranks:
            out["peak_allocated_rank"] = ranks["peak_allocated"]
        return out

    # -- events ---------------------------------------------------------------------------------

    def on_train_begin(self, args, state, control, **kwargs):
        self._main = bool(state.is_world_process_zero)
        self._world = world() if self.across_ranks else None
        # every rank measures and takes part in the reductions; rank 0 alone writes
        self._active = self._main or self._world is not None
        self._window: dict[str, int] = {}
        self._run_peak = 0
        self._phase: dict[str, int] = {}
        self._phase_step = -1
        self._last_step = -1
        self._eval_open = False
        self._anchored_after_first = False
        self.timeline, self.evals, self.events = [], [], []
        self.status = {"state": "running"}
        self._calibration_due = False
        if not self._active:
            return
        if self._main and not move_ahead_of_reporters(self):
            self._warn_once("order", "MemoryCallback could not find the Trainer's callback list; "
                                     "its keys reach only the backends that run after it")
        self._predicted = predicted_peak(self.estimate)
        if self.estimate is not None and self._predicted is None:
            self._warn_once("estimate", f"estimate of type {type(self.estimate).__name__} has no "
                                        "peak_allocated; predicted-vs-actual keys are skipped")
        self._reader = make_reader(args.device)
        self._start_reader()
        self._reader.anchor()
        self._read_peak()    # the peak since train() began: TrainerMemoryTracker's window
        self._window = {}
        self._phases = StepPhases(self._read_peak)
        if not getattr(args, "torch_compile", False):
            self._phases.attach(kwargs.get("model"))
        self._calibration_due = (self.calibrate and self._main
                                 and can_calibrate(self._reader, self.estimate, self._warn_once))

    def _start_reader(self) -> None:
        r = self._reader
        if isinstance(r, CudaReader):
            r.open_nvml()
            if self.record_history and self._main:
                _oom.start_memory_history(self.max_entries)
        elif isinstance(r, CpuReader) and self._main and not mmap_threshold_set():
            warn_once("mmap_threshold", MMAP_HINT)
        elif isinstance(r, MpsReader):
            self._warn_once("mps_peak", "MPS keeps no peak statistic: memory/peak_* are the "
                                        "largest readings at phase boundaries")
        if self.record_history and not isinstance(r, CudaReader):
            self._warn_once("history", "record_history needs CUDA; no allocator history is kept")

    def on_step_begin(self, args, state, control, **kwargs):
        if self._active and will_log(args, state):
            self._read_peak()
            self._phase = {}
            self._phase_step = state.global_step + 1
            self._phases.arm()

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self._active and self._phase_step == state.global_step + 1:
            self._phase.update(self._phases.finish(self._read_peak()))

    def on_optimizer_step(self, args, state, control, **kwargs):
        if self._active and self._phase_step == state.global_step + 1:
            peak = self._read_peak()
            if peak is not None:
                self._phase["optimizer"] = peak

    def on_step_end(self, args, state, control, **kwargs):
        if not self._active:
            return
        self._phases.armed = False   # finished at on_pre_optimizer_step, where that event runs
        # CPU: re-measure the non-tensor baseline once, after thread pools and caches exist.
        if not self._anchored_after_first and isinstance(self._reader, CpuReader):
            self._anchored_after_first = True
            self._reader.anchor()
        self._open_eval(control)

    def on_epoch_end(self, args, state, control, **kwargs):
        if self._active:
            self._open_eval(control)

    def _open_eval(self, control) -> None:
        """The Trainer evaluates next (DefaultFlowCallback, which runs first, said so)."""
        if getattr(control, "should_evaluate", False):
            self._read_peak()
            self._eval_open = True

    def on_evaluate(self, args, state, control, **kwargs):
        self._eval_open = False   # its log came first; this closes a window no log closed

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not getattr(self, "_active", False) or logs is None or self._reader is None:
            return
        if self._main and any(k.startswith("oom/") for k in logs):
            self.events.append({"step": state.global_step, **logs})
        if TRACKER_KEY in logs and isinstance(self._reader, CudaReader):
            self._restore_tracker(state, logs)
        if "loss" in logs and state.global_step != self._last_step:
            self._last_step = state.global_step
            self._log_step(args, state, logs)
        elif self._eval_open and "loss" not in logs:
            self._eval_open = False
            self._log_eval(args, state, logs)

    def _read_step(self, state) -> dict[str, Any]:
        """This rank's readings at a logging step (never raises: the ranks' reduce follows)."""
        r = self._reader
        rec: dict[str, Any] = {"step": state.global_step}
        try:
            alloc, reserved = r.allocated(), r.reserved()
            if self._read_peak() is None:
                self._warn_once("peak", f"no peak memory statistic on {r.kind}; "
                                        "memory/peak_allocated_gib is the current reading")
            w, self._window = self._window, {}
            rec.update(allocated=alloc, reserved=reserved,
                       peak_allocated=max(w.get("allocated", 0), alloc or 0),
                       peak_active=w.get("active"))
            if reserved is not None or "reserved" in w:
                rec["peak_reserved"] = max(w.get("reserved", 0), reserved or 0)
            if alloc is not None and reserved is not None:
                rec["fragmentation"] = reserved - alloc
            if self._phase_step == state.global_step:
                rec.update({"peak_" + name: value for name, value in self._phase.items()})
            rec.update(r.extra())
        except Exception as exc:  # a callback never stops training
            self._warn_once("read", f"memory readings failed at step {state.global_step}: {exc}")
        return rec

    def _log_step(self, args, state, logs: dict) -> None:
        rec = self._across_ranks(args, self._read_step(state), REDUCED)
        if not self._main:
            return
        if self._predicted and rec.get("peak_allocated") is not None:
            rec["predicted_peak"] = self._predicted
            rec["actual_over_predicted"] = rec["peak_allocated"] / self._predicted
        self.timeline.append(rec)
        add_to_logs(state, logs, to_metrics(rec))
        if self._calibration_due and state.global_step >= CALIBRATE_AFTER_STEP:
            self._calibration_due = False
            write_residual(self._reader, self.estimate, rec, self._warn_once)

    def _log_eval(self, args, state, logs: dict) -> None:
        rec: dict[str, Any] = {"step": state.global_step}
        try:
            rec["peak_eval"] = self._read_peak()
        except Exception as exc:
            self._warn_once("read", f"memory readings failed at step {state.global_step}: {exc}")
        rec = self._across_ranks(args, rec, ("peak_eval",))
        if self._main and rec.get("peak_eval") is not None:
            self.evals.append(rec)
            add_to_logs(state, logs, to_metrics(rec))

    def _restore_tracker(self, state, logs: dict) -> None:
        """TrainerMemoryTracker read the peak just before this log, after the resets here: put
        back its number for the whole of training (module docstring)."""
        try:
            peak = max(self._run_peak, self._reader.peaks().get("allocated") or 0)
            value = max(0, peak - self._reader.allocated())
        except Exception:
            return
        if value != logs[TRACKER_KEY]:
            add_to_logs(state, logs, {TRACKER_KEY: value})

    def on_train_end(self, args, state, control, **kwargs):
        if not getattr(self, "_active", False) or self._reader is None:
            return   # not measuring on this rank, or training never began
        self._active = False
        if self._phases is not None:
            self._phases.detach()
        if self.record_history and self._main and isinstance(self._reader, CudaReader):
            _oom.stop_memory_history()
        self._reader.close()
        if not self._main:
            return
        if self.status.get("state") == "running":
            self.status = {"state": "completed", "step": state.global_step}
        if args.output_dir:
            self.write_outputs(args.output_dir)

    def write_outputs(self, output_dir: str) -> None:
        """Write `memory_report.json` and `memory_timeline.png` (as enabled) into `output_dir`.

        Called at train end, and also for a run that stopped early (Ctrl-C, an exception), with
        `self.status` saying so in the report. A plot that cannot be drawn is a warning.

        Args:
            output_dir (`str`):
                The folder to write to (created if missing).
        """
        os.makedirs(output_dir, exist_ok=True)
        report = self.to_report()
        if self.report:
            self.report_path = os.path.join(output_dir, "memory_report.json")
            with open(self.report_path, "w") as f:
                json.dump(report, f, indent=2)
        if self.plot and self.timeline:
            from .plot import plot_timeline

            try:
                self.plot_path = plot_timeline(report,
                                               os.path.join(output_dir, "memory_timeline.png"))
            except Exception as exc:  # HfMemkitError when matplotlib is missing
                self._warn_once("plot", f"memory timeline not drawn: {exc}")

    def to_report(self) -> dict[str, Any]:
        """The JSON report: bytes throughout (GiB only in the logs); with several ranks each
        reading is the maximum over them.

        Returns:
            `dict[str, Any]`: the device, the predicted peak, the status, a summary, each
            logged step and evaluation, the OOM events and snapshots.
        """
        peaks = [r["peak_allocated"] for r in self.timeline if r.get("peak_allocated") is not None]
        kind = self._reader.kind if self._reader else None
        summary: dict[str, Any] = {"max_peak_allocated": max(peaks) if peaks else None}
        if self._predicted and peaks:
            summary["actual_over_predicted"] = max(peaks) / self._predicted
        out = {"device": kind, "predicted_peak_allocated": self._predicted or None,
               "units": "bytes", "status": self.status, "summary": summary,
               "world_size": self._world[1] if self._world else 1,
               "steps": self.timeline, "evaluations": self.evals,
               "events": self.events, "oom_snapshots": list(_oom.snapshot_paths())}
        if kind == "cpu":   # whether the readings are exact (docs/stack-facts.md#cpu-ground-truth)
            out["cpu_readings"] = {"malloc_mmap_threshold": os.environ.get(
                "MALLOC_MMAP_THRESHOLD_"), "exact": mmap_threshold_set()}
        return out


_GIB_KEYS = ("allocated", "reserved", "peak_allocated", "peak_active", "peak_reserved",
             "fragmentation", "peak_forward", "peak_backward", "peak_fwd_bwd", "peak_optimizer",
             "peak_generate", "peak_score",
             "peak_eval", "nvml_used", "process_used", "other_processes", "rss",
             "predicted_peak")


def to_metrics(rec: dict[str, Any]) -> dict[str, float]:
    out: dict[str, float] = {}
    for k, v in rec.items():
        if k == "step" or v is None:
            continue
        if k in _GIB_KEYS:
            out[f"{PREFIX}{k}_gib"] = v / GiB
        else:
            out[PREFIX + k] = float(v)
    return out
