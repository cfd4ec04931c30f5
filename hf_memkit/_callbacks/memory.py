"""``MemoryCallback``: memory in the Trainer's logs, actual vs predicted, and a report at the end.

At each logging step it adds (GiB unless named otherwise):

    memory/allocated_gib        live tensor bytes now (CPU: RSS minus the non-tensor baseline)
    memory/reserved_gib         caching-allocator reserved (CPU: = allocated)
    memory/peak_allocated_gib   peak allocated since the previous log
    memory/fragmentation_gib    reserved - allocated
    memory/peak_fwd_bwd_gib     peak of forward + backward (all micro-batches) of the logged step
    memory/peak_optimizer_gib   peak of the optimizer step of the logged step
    memory/nvml_used_gib        what nvidia-smi shows (CUDA with nvidia-ml-py)
    memory/gpu_util             NVML utilisation, percent (CUDA with nvidia-ml-py)
    memory/rss_gib              resident set size of the process (CPU)
    memory/predicted_peak_gib   MemoryEstimate.peak_allocated (when an estimate or plan is given)
    memory/actual_over_predicted  peak_allocated / predicted

With ``calibrate=True`` (CUDA, an estimate given, nvidia-ml-py installed) the first log at or
after step ``CALIBRATE_AFTER_STEP`` also appends NVML used / the estimate's ``device_used`` - 1 to
the stored calibration of this GPU (``hf-memkit calibrate`` must have made one), once per run.

Cost: on a step that does not log it does one integer test per event; the peak-since-last-log
comes from the allocator's (or the kernel's) own high-water mark, reset at each log, so nothing
is read in between. The per-phase peaks are taken on the step that will log (known in advance
from ``logging_steps``): the peak is read and reset at ``on_step_begin``,
``on_pre_optimizer_step`` and ``on_optimizer_step``, each reading folded into the
peak-since-last-log. No reading synchronises the device.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import torch
from transformers import TrainerCallback

from .._device.calibration import record_residual
from .._device.probe import probe_device, warn_once
from .._device.rss import mmap_threshold_set
from .._oom import guard as _oom
from .._units import GiB
from ._order import add_to_logs, move_ahead_of_reporters
from ._readers import CpuReader, CudaReader, MpsReader, Reader, make_reader

logger = logging.getLogger(__name__)

MMAP_HINT = ("MemoryCallback: CPU memory readings (memory/*_gib) read low, by 25-45% on small "
             "models, because MALLOC_MMAP_THRESHOLD_ was not set when this process started: "
             "glibc serves new tensors from heap memory it already holds, which RSS does not "
             "count again. For exact readings start Python with it: "
             "`MALLOC_MMAP_THRESHOLD_=65536 python train.py` (`hf-memkit train` sets it itself)")
PREFIX = "memory/"
CALIBRATE_AFTER_STEP = 3   # the first steps allocate lazily (optimizer state, kernels, workspaces)


def predicted_peak(estimate: Any) -> int | None:
    """``peak_allocated`` of a ``MemoryEstimate``, of a ``Plan`` (its ``.estimate``), or None."""
    if estimate is None:
        return None
    est = getattr(estimate, "estimate", estimate)
    peak = getattr(est, "peak_allocated", None)
    return int(peak) if peak is not None else None


def predicted_device_used(estimate: Any) -> int | None:
    """``device_used`` of a ``MemoryEstimate`` for a CUDA device (or of a ``Plan``'s), or None."""
    est = getattr(estimate, "estimate", estimate)
    used = getattr(est, "device_used", None)
    kind = getattr(getattr(est, "device", None), "kind", "cuda")
    return int(used) if used and kind == "cuda" else None


def will_log(args, state) -> bool:
    """Whether the step about to run (``global_step + 1``) ends with a log (DefaultFlowCallback)."""
    nxt = state.global_step + 1
    if nxt == 1 and args.logging_first_step:
        return True
    every = state.logging_steps
    return args.logging_strategy == "steps" and bool(every) and nxt % every == 0


class MemoryCallback(TrainerCallback):
    """Log device memory at each logging step into every ``report_to`` backend and ``log_history``.

    Args:
        estimate: a ``MemoryEstimate``, a ``Plan`` (anything with ``.estimate``) or anything with
            ``.peak_allocated``; adds predicted-vs-actual keys and a line on the timeline.
        plot: write ``memory_timeline.png`` at train end (needs matplotlib).
        report: write ``memory_report.json`` at train end.
        record_history: on CUDA, record the allocator's history from train begin
            (``torch.cuda.memory._record_memory_history``) so that an OOM caught by the OOM guard
            dumps a snapshot pytorch.org/memory_viz opens. Each event keeps its Python stack
            only (``stacks="python"``): torch's default also unwinds the C++ stack at every
            allocation and free (larger entries, a slower dump on OOM).
        max_entries: history ring-buffer size (alloc/free events) when ``record_history``.
        calibrate: on CUDA with an estimate, append measured/predicted of ``device_used`` (NVML)
            to this GPU's stored calibration once, at the first log from step 3 on.
    """

    def __init__(self, estimate: Any = None, *, plot: bool = True, report: bool = True,
                 record_history: bool = False, max_entries: int = 100_000,
                 calibrate: bool = False):
        self.estimate = estimate
        self.calibrate = calibrate
        self.plot = plot
        self.report = report
        self.record_history = record_history
        self.max_entries = max_entries
        self.timeline: list[dict[str, Any]] = []
        self.events: list[dict[str, Any]] = []
        self.report_path: str | None = None
        self.plot_path: str | None = None
        self._reader: Reader | None = None
        self._warned: set[str] = set()
        self.status: dict[str, Any] = {"state": "running"}   # "completed" at train end

    # -- helpers -------------------------------------------------------------------------------

    def _warn_once(self, key: str, msg: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(msg)

    def _read_peak(self) -> int | None:
        peak = self._reader.peak()
        if peak is not None:
            self._window = max(self._window, peak)
        self._reader.reset_peak()
        return peak

    # -- events ---------------------------------------------------------------------------------

    def on_train_begin(self, args, state, control, **kwargs):
        self._active = bool(state.is_world_process_zero)
        self._window = 0
        self._phase: dict[str, int] = {}
        self._phase_step = -1
        self._last_step = -1
        self._anchored_after_first = False
        self.timeline, self.events = [], []
        self.status = {"state": "running"}
        self._calibration_due = False
        if not self._active:
            return
        if not move_ahead_of_reporters(self):
            self._warn_once("order", "MemoryCallback could not find the Trainer's callback list; "
                                     "its keys reach only the backends that run after it")
        self._predicted = predicted_peak(self.estimate)
        if self.estimate is not None and self._predicted is None:
            self._warn_once("estimate", f"estimate of type {type(self.estimate).__name__} has no "
                                        "peak_allocated; predicted-vs-actual keys are skipped")
        self._reader = make_reader(args.device)
        if isinstance(self._reader, CudaReader):
            self._reader.open_nvml()
            if self.record_history:
                _oom.start_memory_history(self.max_entries)
        elif isinstance(self._reader, CpuReader) and not mmap_threshold_set():
            warn_once("mmap_threshold", MMAP_HINT)
        elif isinstance(self._reader, MpsReader):
            self._warn_once("mps_peak", "MPS keeps no peak statistic: memory/peak_* are the "
                                        "largest readings at phase boundaries")
        if self.record_history and not isinstance(self._reader, CudaReader):
            self._warn_once("history", "record_history needs CUDA; no allocator history is kept")
        self._reader.anchor()
        self._reader.reset_peak()
        self._calibration_due = self.calibrate and self._can_calibrate()

    def on_step_begin(self, args, state, control, **kwargs):
        if self._active and will_log(args, state):
            self._read_peak()
            self._phase = {}
            self._phase_step = state.global_step + 1

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self._active and self._phase_step == state.global_step + 1:
            peak = self._read_peak()
            if peak is not None:
                self._phase["fwd_bwd"] = peak

    def on_optimizer_step(self, args, state, control, **kwargs):
        if self._active and self._phase_step == state.global_step + 1:
            peak = self._read_peak()
            if peak is not None:
                self._phase["optimizer"] = peak

    def on_step_end(self, args, state, control, **kwargs):
        # CPU: re-measure the non-tensor baseline once, after thread pools and caches exist.
        if self._active and not self._anchored_after_first and isinstance(self._reader, CpuReader):
            self._anchored_after_first = True
            self._reader.anchor()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not self._active or logs is None:
            return
        if any(k.startswith("oom/") for k in logs):
            self.events.append({"step": state.global_step, **logs})
        if "loss" not in logs or state.global_step == self._last_step:
            return
        self._last_step = state.global_step
        r = self._reader
        rec: dict[str, Any] = {"step": state.global_step}
        alloc, reserved = r.allocated(), r.reserved()
        peak = r.peak()
        if peak is None:
            self._warn_once("peak", f"no peak memory statistic on {r.kind}; "
                                    "memory/peak_allocated_gib is the current reading")
            peak = alloc
        peak = max(self._window, peak, alloc or 0)
        self._window = 0
        r.reset_peak()
        rec.update(allocated=alloc, reserved=reserved, peak_allocated=peak)
        if alloc is not None and reserved is not None:
            rec["fragmentation"] = reserved - alloc
        if self._phase_step == state.global_step:
            for name, value in self._phase.items():
                rec["peak_" + name] = value
        for name, value in r.extra().items():
            rec[name] = value
        if self._predicted:
            rec["predicted_peak"] = self._predicted
            rec["actual_over_predicted"] = peak / self._predicted
        self.timeline.append(rec)
        add_to_logs(state, logs, to_metrics(rec))
        if self._calibration_due and state.global_step >= CALIBRATE_AFTER_STEP:
            self._calibration_due = False
            self._write_residual(rec)

    # -- calibrate=True --------------------------------------------------------------------------

    def _can_calibrate(self) -> bool:
        if not isinstance(self._reader, CudaReader):
            self._warn_once("calibrate", f"calibrate=True needs CUDA, this run is on "
                                         f"{self._reader.kind}; no residual is recorded")
            return False
        if predicted_device_used(self.estimate) is None:
            self._warn_once("calibrate", "calibrate=True needs an estimate (MemoryEstimate or Plan) "
                                         "for a CUDA device; no residual is recorded")
            return False
        return True

    def _write_residual(self, rec: dict[str, Any]) -> None:
        """NVML used / predicted device_used - 1 into this GPU's calibration; never raises."""
        try:
            measured = rec.get("nvml_used")
            if measured is None:
                self._warn_once("calibrate", "calibrate=True needs NVML (pip install "
                                             "nvidia-ml-py); no residual is recorded")
                return
            dev = probe_device(self._reader.index)
            path = record_residual(int(measured), predicted_device_used(self.estimate),
                                   gpu=dev.name, cuda=torch.version.cuda,
                                   driver=dev.driver_version, torch_version=torch.__version__)
            if path is None:
                self._warn_once("calibrate", f"no calibration stored for {dev.name} (driver "
                                             f"{dev.driver_version}, torch {torch.__version__}, "
                                             f"CUDA {torch.version.cuda}); run `hf-memkit "
                                             "calibrate` on this machine first")
            else:
                logger.info("memory residual of step %d recorded in %s", rec["step"], path)
        except Exception as exc:  # a callback never stops training
            self._warn_once("calibrate", f"calibration residual not recorded: {exc}")

    def on_train_end(self, args, state, control, **kwargs):
        if not getattr(self, "_active", False) or self._reader is None:
            return   # not the main process, or training never began
        if self.status.get("state") == "running":
            self.status = {"state": "completed", "step": state.global_step}
        if self.record_history and isinstance(self._reader, CudaReader):
            _oom.stop_memory_history()
        self._reader.close()
        if args.output_dir:
            self.write_outputs(args.output_dir)

    def write_outputs(self, output_dir: str) -> None:
        """``memory_report.json`` and ``memory_timeline.png`` (as enabled) into ``output_dir``;
        also called for a run that stopped early (Ctrl-C, an exception), with ``self.status``
        saying so in the report."""
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
        """The JSON report: bytes throughout (GiB only in the logs)."""
        peaks = [r["peak_allocated"] for r in self.timeline if r.get("peak_allocated") is not None]
        kind = self._reader.kind if self._reader else None
        summary: dict[str, Any] = {"max_peak_allocated": max(peaks) if peaks else None}
        if self._predicted and peaks:
            summary["actual_over_predicted"] = max(peaks) / self._predicted
        out = {"device": kind, "predicted_peak_allocated": self._predicted or None,
               "units": "bytes", "status": self.status, "summary": summary,
               "steps": self.timeline,
               "events": self.events, "oom_snapshots": list(_oom.snapshot_paths())}
        if kind == "cpu":   # whether the readings are exact (DESIGN.md: the RSS method)
            out["cpu_readings"] = {"malloc_mmap_threshold": os.environ.get(
                "MALLOC_MMAP_THRESHOLD_"), "exact": mmap_threshold_set()}
        return out


_GIB_KEYS = ("allocated", "reserved", "peak_allocated", "fragmentation", "peak_fwd_bwd",
             "peak_optimizer", "nvml_used", "rss", "predicted_peak")


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

