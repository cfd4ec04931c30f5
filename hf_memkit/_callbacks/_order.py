"""Getting a callback's metrics into every ``report_to`` backend and ``state.log_history``.

``Trainer.log`` appends ``{**logs, "step": ...}`` to ``state.log_history`` and then calls
``on_log`` on each callback in list order: ``DefaultFlowCallback``, the reporting integrations
(TensorBoard, W&B, MLflow, ...), then the user's callbacks, then the console printer. A user
callback that adds keys to ``logs`` in ``on_log`` is therefore too late for the reporters and for
``log_history`` (docs/stack-facts.md#callback-order-and-logs).

The mechanism here: at ``on_train_begin`` the callback moves itself in the ``CallbackHandler``'s
list to just after the last ``DefaultFlowCallback``, ahead of every reporter. In ``on_log`` it then
adds its keys to the ``logs`` dict that every later callback (each reporter, the console) receives,
and to ``state.log_history[-1]``, the entry ``Trainer.log`` appended for this very call.

Moving itself during ``call_event``'s ``for callback in self.callbacks`` loop is safe: moving
the element at index ``k`` to ``j < k`` only shifts the elements in between, so the loop's next
index ``k + 1`` still holds the callback that came after it.
"""

from __future__ import annotations

import gc
import logging
import sys

from transformers.trainer_callback import CallbackHandler, DefaultFlowCallback

logger = logging.getLogger(__name__)


def _find_handler_list(callback) -> list | None:
    """The ``CallbackHandler.callbacks`` list that holds ``callback``.

    First the caller's frames (``CallbackHandler.call_event`` calls every event); else the
    garbage collector's referrers (slower, once per run).
    """
    frame = sys._getframe(1)
    for _ in range(8):
        if frame is None:
            break
        owner = frame.f_locals.get("self")
        if isinstance(owner, CallbackHandler) and any(c is callback for c in owner.callbacks):
            return owner.callbacks
        frame = frame.f_back
    for ref in gc.get_referrers(callback):
        if (isinstance(ref, list) and any(c is callback for c in ref)
                and any(isinstance(c, DefaultFlowCallback) for c in ref)):
            return ref
    return None


def move_ahead_of_reporters(callback) -> bool:
    """Place ``callback`` right after the last ``DefaultFlowCallback``. False if not found."""
    callbacks = _find_handler_list(callback)
    if callbacks is None:
        return False
    i = next(k for k, c in enumerate(callbacks) if c is callback)
    flow = [k for k, c in enumerate(callbacks[:i]) if isinstance(c, DefaultFlowCallback)]
    j = flow[-1] + 1 if flow else 0
    if j < i:
        callbacks.insert(j, callbacks.pop(i))
    return True


def add_to_logs(state, logs: dict, metrics: dict) -> None:
    """Put ``metrics`` into ``logs`` (seen by every later ``on_log``) and into ``log_history``."""
    logs.update(metrics)
    if state.log_history:
        last = state.log_history[-1]
        if last.get("step") == state.global_step and all(
                k in last and (last[k] is v or last[k] == v) for k, v in logs.items()
                if k not in metrics):
            last.update(metrics)
