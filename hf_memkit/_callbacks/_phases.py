"""The phases of one logged optimizer step, as ``MemoryCallback`` separates them.

The Trainer's events bound the step: ``on_step_begin`` (its micro-batches already fetched),
``on_pre_optimizer_step`` (after every forward and backward, and gradient clipping),
``on_optimizer_step``. Forward and backward interleave inside (one pair per micro-batch), with
no event between them, so two hooks on the model separate them: a forward pre-hook and a forward
hook on the top-level module (the one the Trainer's callbacks are given). Each reads the
allocator's peak since the previous reading and resets it (host-side counters, no device
synchronisation), only while armed, i.e. on a step that logs; on any other step a hook is one
attribute test.

    forward   from the start to the end of a model forward call (the loss, when the model
              computes it from ``labels``), the largest over the micro-batches
    backward  from the end of one forward to the start of the next, or to the optimizer step:
              loss code outside the model, the backward pass, gradient clipping

TRL's online RL trainers (GRPO, RLOO) add two phases before the micro-steps of a step that
generates, separated the same way:

    generate  the model's own ``generate`` call (wrapped while attached; its forwards inside
              count here, not as forwards)
    score     a forward call without grad outside ``generate``: the old and reference
              log-probs (a reference model of its own is another module: its forwards fall
              in the segment around them)

A colocated vLLM generates outside torch's allocator statistics: NVML's per-process reading
(``memory/process_used_gib``) shows it. Not separable, and then logged as ``peak_fwd_bwd``
only: a model whose forward does not go through the hooked module's ``__call__``, and
``torch_compile=True`` (hooks inside a compiled module would break its graph; they are not
attached).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class StepPhases:
    """Forward and backward peaks of a logged step. ``read()`` returns the allocated peak since
    the previous reading (or None) and resets it."""

    def __init__(self, read: Callable[[], int | None]):
        self._read = read
        self.armed = False
        self.peaks: dict[str, int] = {}
        self._handles: list[Any] = []
        self._seen_forward = False
        self._generating = False          # inside the wrapped generate
        self._generate_of: Any = None     # the model whose generate is wrapped

    def attach(self, model: Any) -> bool:
        if model is None or not hasattr(model, "register_forward_pre_hook"):
            return False
        self._handles = [model.register_forward_pre_hook(self._pre),
                         model.register_forward_hook(self._post)]
        self._wrap_generate(model)
        return True

    def _wrap_generate(self, model: Any) -> None:
        """Time the model's ``generate`` as a phase of its own (instance attribute, removed
        by ``detach``)."""
        generate = getattr(model, "generate", None)
        if not callable(generate) or "generate" in vars(model):
            return

        def timed(*args: Any, **kwargs: Any) -> Any:
            if self.armed:
                self._note("backward" if self._seen_forward else "before", self._read())
            self._generating = True
            try:
                return generate(*args, **kwargs)
            finally:
                self._generating = False
                if self.armed:
                    self._note("generate", self._read())

        model.generate = timed
        self._generate_of = model

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self.armed = False
        if self._generate_of is not None:
            vars(self._generate_of).pop("generate", None)
            self._generate_of = None

    def arm(self) -> None:
        self.armed, self.peaks, self._seen_forward = bool(self._handles), {}, False

    def _note(self, name: str, peak: int | None) -> None:
        if peak is not None:
            self.peaks[name] = max(self.peaks.get(name, 0), peak)

    def _pre(self, module, args) -> None:
        if self.armed and not self._generating:
            peak = self._read()
            self._note("backward" if self._seen_forward else "before", peak)

    def _post(self, module, args, output) -> None:
        if self.armed and not self._generating:
            if torch.is_grad_enabled():
                self._note("forward", self._read())
                self._seen_forward = True
            else:                               # scoring without grad (GRPO, RLOO)
                self._note("score", self._read())

    def finish(self, peak: int | None) -> dict[str, int]:
        """At ``on_pre_optimizer_step``, with the peak read there: ``fwd_bwd`` always (the
        largest reading since the step began), ``forward`` and ``backward`` when the hooks saw a
        forward."""
        self._note("backward" if self._seen_forward else "before", peak)
        before = self.peaks.pop("before", None)
        out = dict(self.peaks) if self._seen_forward else \
            {k: v for k, v in self.peaks.items() if k in ("generate", "score")}
        values = [v for v in (*self.peaks.values(), before) if v is not None]
        if values:
            out["fwd_bwd"] = max(values)
        self.armed = False
        return out
