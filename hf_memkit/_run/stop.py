"""A training run that stops early (Ctrl-C, or an exception in the model, the loss or a kernel)
keeps what exists: the callbacks' train-end work (``memory_report.json`` with its ``status``, the
timeline), the model as it is and, on failure, ``error.txt`` with the traceback."""

from __future__ import annotations

import os
import warnings
from typing import Any

from .._compat import no_progress_bars
from .._errors import TrainingFailed


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C stopped the run; what existed was saved. A ``KeyboardInterrupt``, so code that
    handles Ctrl-C keeps working; the CLI exits 130 with ``str(exc)`` as its one line."""

    def __init__(self, step: int, max_steps: int, output_dir: str, saved: list[str]):
        self.step, self.max_steps, self.output_dir, self.saved = step, max_steps, output_dir, saved
        kept = f"saved {', '.join(saved)} to {output_dir}" if saved else "nothing saved"
        super().__init__(f"interrupted at step {step} of {max_steps}; {kept}")


def save_stopped_run(trainer: Any, memory: Any, out: str, status: dict[str, Any]) -> list[str]:
    """What a stopped run leaves in ``out``: the callbacks' train-end work (memory_report.json with
    ``status``, the timeline PNG, closed loggers, the progress bar stopped) and the model as it
    is. Returns the names written; a second Ctrl-C stops the saving, never with a traceback."""
    saved: list[str] = []
    try:
        os.makedirs(out, exist_ok=True)
        if memory is not None:
            memory.status = status
        try:
            trainer.callback_handler.on_train_end(trainer.args, trainer.state, trainer.control)
        except Exception as exc:  # a callback that cannot finish must not hide the real error
            warnings.warn(f"callbacks could not finish the stopped run: {exc}", stacklevel=2)
        if memory is not None:
            saved += [os.path.basename(p) for p in (memory.report_path, memory.plot_path) if p]
        try:
            with no_progress_bars():
                trainer.save_model(out)
            saved.append(f"the model (step {trainer.state.global_step})")
        except Exception as exc:
            warnings.warn(f"the model of the stopped run was not saved: {exc}", stacklevel=2)
    except KeyboardInterrupt:
        saved.append("(saving stopped by a second Ctrl-C)")
    return saved


def write_error(out: str, during: str, exc: BaseException) -> str:
    """``out/error.txt``: what failed, when, and the full traceback. Returns its name."""
    import traceback

    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "error.txt"), "w") as f:
        f.write(f"hf-memkit: {during} failed: {type(exc).__name__}: {exc}\n\n")
        f.write("".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))
    return "error.txt"


def failure_message(head: str, exc: BaseException, out: str, *saved: str) -> str:
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"{head}: {type(exc).__name__}: {first} (saved {', '.join(saved)} to {out})"


def train_keeping_what_exists(trainer: Any, memory: Any, out: str, where: str) -> None:
    """``trainer.train()``; if it stops early, save what exists in ``out`` and raise
    ``TrainingInterrupted`` (Ctrl-C) or ``TrainingFailed`` (an exception) saying what was kept."""
    try:
        trainer.train()
    except KeyboardInterrupt:  # Ctrl-C: keep what exists, then stop
        step = trainer.state.global_step
        saved = save_stopped_run(trainer, memory, out, {"state": "interrupted", "step": step})
        raise TrainingInterrupted(step, trainer.state.max_steps, out, saved) from None
    except Exception as exc:  # the run failed (OOM beyond recovery, NaNs, a kernel error...)
        step = trainer.state.global_step
        saved = [write_error(out, f"training (step {step + 1})", exc)]
        saved += save_stopped_run(trainer, memory, out, {
            "state": "failed", "step": step, "error": f"{type(exc).__name__}: {exc}"})
        raise TrainingFailed(failure_message(f"training {where} failed at step {step}", exc,
                                             out, *saved)) from exc
