"""What long work is doing, for whoever listens: the CLI's status line (``hf-memkit plan`` and
``estimate`` trace the real model code, tens of seconds for a large model on a first question).

``reporting(fn)`` makes ``fn(text)`` hear each ``report(text)`` made in its context (and only
there: a context variable, so other threads and the Python API are untouched); with no listener
``report`` costs one lookup.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar

_LISTENER: ContextVar[Callable[[str], None] | None] = ContextVar("hf_memkit_progress",
                                                                 default=None)


def report(text: str) -> None:
    """Tell the listener (if any) what is being done now.

    Args:
        text (`str`): One line, e.g. ``"tracing LlamaForCausalLM: micro-batch 2 x 2048"``.
    """
    listener = _LISTENER.get()
    if listener is not None:
        listener(text)


@contextlib.contextmanager
def reporting(listener: Callable[[str], None]) -> Iterator[None]:
    """Send each ``report`` made inside the block to ``listener``.

    Args:
        listener (`Callable[[str], None]`): Called with each report's text.
    """
    token = _LISTENER.set(listener)
    try:
        yield
    finally:
        _LISTENER.reset(token)
