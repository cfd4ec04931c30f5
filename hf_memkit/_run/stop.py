"""A training run that stops early (Ctrl-C, SIGTERM, or an exception in the model, the loss or a
kernel) keeps what exists: the callbacks' train-end work (``memory_report.json`` with its
``status``, the timeline), the model as it is and, on failure, ``error.txt`` with the traceback.

SIGTERM (``docker stop``, a batch scheduler's time limit, ``kill``) takes Ctrl-C's path while the
run trains (``sigterm_as_interrupt``): the same files are kept, and the CLI exits 143 (128 +
SIGTERM) where Ctrl-C exits 130 (128 + SIGINT)."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import warnings
from collections.abc import Iterator
from typing import Any

from .._compat import no_progress_bars
from .._errors import TrainingFailed


class Terminated(KeyboardInterrupt):
    """A signal other than SIGINT (SIGTERM) that stops the run as Ctrl-C does: raised by the
    handler ``sigterm_as_interrupt`` installs. A ``KeyboardInterrupt``, so every ``except
    KeyboardInterrupt`` on the way (ours, the Trainer's, the data loader's) treats it as Ctrl-C,
    and no ``except Exception`` swallows it."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(f"terminated by {signal.Signals(signum).name}")


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C (or SIGTERM) stopped the run; what existed was saved. A ``KeyboardInterrupt``, so
    code that handles Ctrl-C keeps working; the CLI exits 128 + ``signum`` (130 for Ctrl-C, 143
    for SIGTERM) with ``str(exc)`` as its one line."""

    def __init__(self, step: int, max_steps: int, output_dir: str, saved: list[str],
                 signum: int = signal.SIGINT):
        self.step, self.max_steps, self.output_dir, self.saved = step, max_steps, output_dir, saved
        self.signum = signum
        kept = f"saved {', '.join(saved)} to {output_dir}" if saved else "nothing saved"
        how = ("interrupted" if signum == signal.SIGINT else
               f"terminated by {signal.Signals(signum).name}")
        super().__init__(f"{how} at step {step} of {max_steps}; {kept}")


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """While the block runs, SIGTERM raises ``Terminated`` (Ctrl-C's path) instead of ending the
    process at once; the previous handler is restored after. Installed only where SIGTERM has
    its default action, in the main thread: a handler someone installed (the Trainer's own
    ``enable_jit_checkpoint``, the user's application), or SIGTERM ignored on purpose, is left
    as it is."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL):
        yield
        return

    def terminate(signum: int, frame: Any) -> None:
        raise Terminated(signum)

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def save_stopped_run(trainer: Any, memory: Any, out: str, status: dict[str, Any]) -> list[str]:
    """What a stopped run leaves in ``out``: the callbacks' train-end work (memory_report.json with
    ``status``, the timeline PNG, closed loggers, the progress bar stopped) and the model as it
    is. Returns the names written; a second Ctrl-C (or SIGTERM) stops the saving, never with a
    traceback."""
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
    except KeyboardInterrupt as exc:
        how = "SIGTERM" if isinstance(exc, Terminated) else "Ctrl-C"
        saved.append(f"(saving stopped by a second {how})")
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
    ``TrainingInterrupted`` (Ctrl-C, SIGTERM) or ``TrainingFailed`` (an exception) saying what was
    kept. SIGTERM takes Ctrl-C's path until what exists is saved (``sigterm_as_interrupt``)."""
    with sigterm_as_interrupt():
        _train_keeping_what_exists(trainer, memory, out, where)


def _train_keeping_what_exists(trainer: Any, memory: Any, out: str, where: str) -> None:
    try:
        trainer.train()
    except KeyboardInterrupt as exc:  # Ctrl-C or SIGTERM: keep what exists, then stop
        step = trainer.state.global_step
        signum = getattr(exc, "signum", signal.SIGINT)
        status = {"state": "interrupted", "step": step}
        if signum != signal.SIGINT:
            status["signal"] = signal.Signals(signum).name
        saved = save_stopped_run(trainer, memory, out, status)
        raise TrainingInterrupted(step, trainer.state.max_steps, out, saved, signum) from None
    except Exception as exc:  # the run failed (OOM beyond recovery, NaNs, a kernel error...)
        step = trainer.state.global_step
        saved = [write_error(out, f"training (step {step + 1})", exc)]
        saved += save_stopped_run(trainer, memory, out, {
            "state": "failed", "step": step, "error": f"{type(exc).__name__}: {exc}"})
        raise TrainingFailed(failure_message(f"training {where} failed at step {step}", exc,
                                             out, *saved)) from exc
