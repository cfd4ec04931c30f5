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

from .base import BatchShape, TraceStep, TrlTrainerKind, padded_length, register
from .data import preference_pair, token_rows, word_tokenizer
from .fused_head import DPO_OUTPUTS, add_head, fold_context, head_notes


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
        return fold_context(target, self.options)

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


class DPO(TrlTrainerKind):
    name = "dpo"
    title = "DPOTrainer"
    config_class = "trl.DPOConfig"
    synthetic_examples = "DPO's preference pairs (prompt, chosen, rejected)"
    sequence_split = False   # chosen and rejected rows go together: not split over ranks
    fields = ("max_length", "precompute_ref_log_probs", "use_weighting", "pad_to_multiple_of",
              "padding_free", "activation_offloading", "loss_type")
    takes_ref_model = True
    irrelevant = {
        "DPO loss arithmetic on per-sequence log-prob sums ([2 x batch] values)": (
            "beta", "label_smoothing", "loss_weights", "f_divergence_type",
            "f_alpha_divergence_coef", "discopop_tau"),
        "TR-DPO: the reference (already a held copy) is mixed in place between steps": (
            "sync_ref_model", "ref_model_mixup_alpha", "ref_model_sync_steps")}

    def read(self, get: Callable[[str], Any]) -> dict[str, Any]:
        return {"max_length": get("max_length"),
                "precompute_ref_log_probs": bool(get("precompute_ref_log_probs")),
                "use_weighting": bool(get("use_weighting")),
                "pad_to_multiple_of": get("pad_to_multiple_of"),
                "ref_model": None,   # set by estimate_memory(ref_model=...)
                "activation_offloading": bool(get("activation_offloading"))}

    def shape(self, options: Mapping[str, Any], batch: int, seq: int) -> BatchShape:
        return BatchShape(2 * batch, padded_length(options, seq), padded=True)

    def step(self, options: Mapping[str, Any]) -> TraceStep:
        return DPOStep(options)

    def reference(self, options: Mapping[str, Any], adapters: bool) -> str | None:
        return policy_reference(options, adapters)

    def notes(self, options: Mapping[str, Any]) -> list[str]:
        return ["DPOTrainer: each example is a chosen and a rejected row (2 x micro-batch rows), "
                "scored by TRL's fused log-prob head"] + head_notes(options, "the prompt")

    def completion_problem(self, options: Mapping[str, Any]) -> str | None:
        return None  # DPOTrainer labels only the completions (completion_mask)

    def run_problems(self, *, where: str, synthetic: bool, task: str | None,
                     callbacks: tuple[str, ...]) -> list[str]:
        return self.synthetic_problem(where, synthetic) + super().run_problems(
            where=where, synthetic=synthetic, task=task, callbacks=callbacks)

    def build(self, *, model: Any, args: Any, rows: Any, data_collator: Any,
              processing_class: Any, callbacks: list[Any], oom_guard: bool) -> Any:
        """``trl.DPOTrainer`` over preference pairs made from ``rows`` (``data``), with the
        reference model the plan counted (``reference``): the policy's own adapters for
        LoRA/QLoRA, none with ``precompute_ref_log_probs``, else a frozen copy of the policy
        (``DPOTrainer`` would load one from the model's Hub name, which a model built from a
        config does not have)."""
        import copy

        import datasets
        import trl

        vocab = model.config.get_text_config().vocab_size
        pairs = [preference_pair(r["input_ids"], vocab) for r in token_rows(rows)]
        adapters = hasattr(model, "disable_adapter")       # a PEFT policy is its own reference
        ref = None if adapters or args.precompute_ref_log_probs else copy.deepcopy(model).eval()
        return trl.DPOTrainer(model=model, ref_model=ref, args=args,
                              train_dataset=datasets.Dataset.from_list(pairs),
                              processing_class=word_tokenizer(vocab), callbacks=callbacks)


register(DPO())


def policy_reference(options: Mapping[str, Any], adapters: bool) -> str | None:
    """The reference of a trainer built like ``DPOTrainer`` (KTO too): the user's own
    ``ref_model`` is a held copy; a PEFT policy is its own reference, adapters disabled;
    ``precompute_ref_log_probs`` keeps none during training; else a frozen copy."""
    if options.get("ref_model"):
        return "copy"
    if adapters:
        return "adapters"
    return None if options.get("precompute_ref_log_probs") else "copy"
