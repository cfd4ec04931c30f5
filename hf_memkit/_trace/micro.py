"""The micro-steps ``step.trace_step`` runs on the fake model, inside its fake mode and memory
tracker: a training micro-step (forward, backward) and a no-grad one (eval, or a trainer's
phases of its own)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def train_micro_step(model: torch.nn.Module, batch: dict[str, torch.Tensor], loss: str,
                     grad_accum: int, suffix: str, record: Callable[[str], None],
                     forward_only: bool, step: Any = None, reference: Any = None) -> None:
    """One training micro-step: the loss (the model's own, ``logits.sum()``, or a trainer's
    ``TraceStep.loss``), scaled for accumulation; its forward and backward recorded."""
    if step is not None:  # a trainer's own loss (_trainers.TraceStep)
        out = value = step.loss(model, batch, reference)
    else:
        out = model(**batch)
        value = out.logits.sum() if loss == "logits_sum" else \
            out.loss if hasattr(out, "loss") else out[0]
    if grad_accum > 1:
        value = value / grad_accum
    del out
    record("forward" + suffix)
    if forward_only:
        return
    value.backward()
    del value
    record("backward" + suffix)


@torch.no_grad()
def eval_step(model: torch.nn.Module, batch: dict[str, torch.Tensor], trainer: Any, ref: Any,
              mt: Any, record: Callable[[Any, str], None]) -> None:
    """A no-grad step: the model's forward (phase "eval"), a trainer's loss, or a trainer's
    phases of its own (``TraceStep.rollout``: online RL's prefill and decode)."""
    if trainer is not None and trainer.records_phases:
        trainer.rollout(model, batch, ref, lambda name: (record(mt, name), mt.reset_mod_stats()))
        return
    out = model(**batch) if trainer is None else trainer.loss(model, batch, ref)
    del out
    record(mt, "eval")
