"""``trl.DPOTrainer``: chosen and rejected rows together, the fused head, a reference forward.

Read from ``DPOTrainer.__init__`` / ``_compute_loss`` and ``DataCollatorForPreference``
(TRL 1.16, ``trl/trainer/dpo_trainer.py``):
  * the collator stacks each example's prompt+chosen and prompt+rejected rows: a micro-batch of
    B examples is 2B rows, right-padded to the longest (a real attention mask), truncated to
    ``max_length`` (the default ``seq_len``). ``padding_free`` is switched off by the trainer;
  * the policy runs ``add_fused_lm_head`` (``fused_head``) with
    ``outputs=("log_probs", "entropy", "mean_logits", "is_top1")`` (+ ``log_sum_sq_probs`` with
    ``use_weighting``);
  * the reference: without ``ref_model``, a PEFT policy serves as its own reference with the
    adapters disabled ("adapters"), ``precompute_ref_log_probs=True`` keeps none during
    training, and otherwise a frozen copy of the policy ("copy") is loaded; a user's own
    ``ref_model`` is a copy. The reference forward runs under ``torch.no_grad()`` after the
    policy's forward, while the policy's activations are alive, through its own fused head;
  * ``activation_offloading``: as ``SFTTrainer`` (``offload``); the reference forward saves
    nothing (no grad), so only the policy's activations go to the host.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from .._techniques.liger import liger_layers_only
from .base import BatchShape, TraceStep, TrainerKind, padded_length, register
from .fused_head import DPO_OUTPUTS, add_head, fold_context


def _read(get: Callable[[str], Any]) -> dict[str, Any]:
    return {"max_length": get("max_length"),
            "precompute_ref_log_probs": bool(get("precompute_ref_log_probs")),
            "use_weighting": bool(get("use_weighting")),
            "pad_to_multiple_of": get("pad_to_multiple_of"),
            "ref_model": None,   # set by estimate_memory(ref_model=...)
            "activation_offloading": bool(get("activation_offloading"))}


def _shape(o: Mapping[str, Any], batch: int, seq: int) -> BatchShape:
    return BatchShape(2 * batch, padded_length(o, seq), padded=True)


def reference(o: Mapping[str, Any], adapters: bool) -> str | None:
    if o.get("ref_model"):
        return "copy"
    if adapters:
        return "adapters"
    return None if o.get("precompute_ref_log_probs") else "copy"


class DPOStep(TraceStep):
    title = "DPOTrainer"

    def __init__(self, options: Mapping[str, Any]) -> None:
        super().__init__(options)
        self.outputs = DPO_OUTPUTS + (("log_sum_sq_probs",) if options.get("use_weighting")
                                      else ())
        self.precomputed = bool(options.get("precompute_ref_log_probs")) and \
            not options.get("ref_model")

    def prepare(self, model: Any, *, adapters: bool) -> None:
        super().prepare(model, adapters=adapters)
        add_head(model, self.outputs)

    def prepare_reference(self, model: Any) -> None:
        add_head(model)                     # DPOTrainer: add_fused_lm_head(self.ref_model)

    def kernels(self, target: Any) -> Any:
        return fold_context(target)

    def loss(self, model: Any, batch: dict[str, Any], reference: Any = None) -> Any:
        out = model(**batch, fused_lm_head=True)
        chosen, rejected = out.log_probs.sum(dim=1).chunk(2, dim=0)
        if self.precomputed:
            ref_c, ref_r = torch.zeros_like(chosen), torch.zeros_like(rejected)
        else:
            with torch.no_grad():
                if hasattr(reference, "disable_adapter"):  # a PEFT policy, adapters disabled
                    with reference.disable_adapter():
                        ref = reference(**batch, fused_lm_head=True)
                else:
                    ref = reference(**batch, fused_lm_head=True)
            ref_c, ref_r = ref.log_probs.sum(dim=1).chunk(2, dim=0)
            del ref
        delta = (chosen - ref_c) - (rejected - ref_r)
        return -torch.nn.functional.logsigmoid(0.1 * delta).mean()  # loss_type "sigmoid"


def _notes(o: Mapping[str, Any]) -> list[str]:
    return ["DPOTrainer: each example is a chosen and a rejected row (2 x micro-batch rows), "
            "scored by TRL's fused log-prob head"]


register(TrainerKind(
    "dpo", title="DPOTrainer", config_class="trl.DPOConfig", extra="trl", read=_read,
    fields=("max_length", "precompute_ref_log_probs", "use_weighting", "pad_to_multiple_of",
            "padding_free", "activation_offloading", "loss_type"),
    seq_len=lambda o: o.get("max_length"), shape=_shape, step=DPOStep, reference=reference,
    notes=_notes, adjust=liger_layers_only))
