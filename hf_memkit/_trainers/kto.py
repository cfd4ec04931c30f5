"""``trl.KTOTrainer``: prompt + completion rows, a KL batch of mismatched completions, a reference.

Read from ``KTOTrainer.__init__`` / ``_prepare_dataset`` / ``_compute_loss`` /
``_compute_kl_logps`` and ``DataCollatorForUnpairedPreference`` (TRL 1.16,
``trl/trainer/kto_trainer.py``):
  * each example is one prompt + completion row with a desirable / undesirable label (paired
    data is unpaired first); the collator truncates a row to ``max_length`` (the default
    ``seq_len``) and right-pads the micro-batch to its longest row (a real attention mask): B
    examples are B rows, not DPO's 2B;
  * with ``loss_type="kto"`` (the KL estimate; not ``"apo_zero_unpaired"``) every example also
    carries a KL row: the same prompt followed by the previous example's completion in the
    batch (``add_kl_completion_ids``), collated the same way, so another B rows of at most
    ``max_length`` tokens. The policy scores them first, under ``torch.no_grad()``, before its
    own forward: nothing is saved then, so that forward's peak is below the reference's
    forwards that run later on top of the saved activations, and it is not traced;
  * the policy runs ``add_fused_lm_head`` (``fused_head``) with
    ``outputs=("log_probs", "entropy", "mean_logits")``; the reference (no grad, checkpointing
    off) scores the KL rows and then the rows themselves through its own fused head, one
    after the other, each leaving only per-row sums: the trace runs one of them (the same
    micro-batch shape);
  * the reference, as ``DPOTrainer``'s: without ``ref_model``, a PEFT policy with its adapters
    disabled ("adapters"), none with ``precompute_ref_log_probs`` (computed in ``__init__``,
    before training), else a frozen copy loaded from the policy's name ("copy"); a user's
    ``ref_model`` is a copy;
  * ``KTOTrainer.__init__`` refuses ``per_device_train_batch_size=1`` and a
    ``train_sampling_strategy`` other than "sequential" while it estimates the KL term;
  * ``activation_offloading``: as ``SFTTrainer`` (``offload``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from .base import BatchShape, TraceStep, TrlTrainerKind, padded_length, register
from .data import token_rows, word_tokenizer
from .dpo import policy_reference
from .fused_head import add_head, fold_context, head_notes

KTO_OUTPUTS = ("log_probs", "entropy", "mean_logits")   # KTOTrainer.__init__
NO_KL = "apo_zero_unpaired"    # the one loss type without the KL estimate (calculate_KL)


class KTOStep(TraceStep):
    title = "KTOTrainer"

    def __init__(self, options: Mapping[str, Any]) -> None:
        super().__init__(options)
        self.precomputed = bool(options.get("precompute_ref_log_probs")) and \
            not options.get("ref_model")

    def prepare(self, model: Any, *, adapters: bool) -> None:
        super().prepare(model, adapters=adapters)
        add_head(model, KTO_OUTPUTS)

    def prepare_reference(self, model: Any) -> None:
        add_head(model)                       # KTOTrainer: add_fused_lm_head(self.ref_model)

    def kernels(self, target: Any) -> Any:
        return fold_context(target, self.options)

    def loss(self, model: Any, batch: dict[str, Any], reference: Any = None) -> Any:
        out = model(**batch, use_cache=False, fused_lm_head=True)   # KTOTrainer._compute_loss
        logps = out.log_probs.sum(-1)
        if self.precomputed:
            ref = torch.zeros_like(logps)
        else:
            with torch.no_grad():
                if hasattr(reference, "disable_adapter"):  # a PEFT policy, adapters disabled
                    with reference.disable_adapter():
                        r = reference(**batch, use_cache=False, fused_lm_head=True)
                else:
                    r = reference(**batch, use_cache=False, fused_lm_head=True)
            ref = r.log_probs.sum(-1)
            del r
        ratio, half = logps - ref, logps.shape[0] // 2   # desirable rows, then undesirable
        kl = 0.0    # (KL_logps - ref_KL_logps).mean().detach(): a scalar
        losses = torch.cat((1 - torch.sigmoid(0.1 * (ratio[:half] - kl)),
                            1 - torch.sigmoid(0.1 * (kl - ratio[half:]))))
        return losses.nanmean()                                     # loss_type "kto"


class KTO(TrlTrainerKind):
    name = "kto"
    title = "KTOTrainer"
    config_class = "trl.KTOConfig"
    synthetic_examples = "KTO's labelled completions"
    sequence_split = False   # rows go with their KL rows and reference: not split over ranks
    fields = ("max_length", "precompute_ref_log_probs", "pad_to_multiple_of",
              "activation_offloading", "loss_type")
    takes_ref_model = True
    irrelevant = {
        "KTO loss arithmetic on per-example log-prob sums ([batch] values)": (
            "beta", "desirable_weight", "undesirable_weight"),
        "TR-DPO: the reference (already a held copy) is mixed in place between steps": (
            "sync_ref_model", "ref_model_mixup_alpha", "ref_model_sync_steps")}

    def read(self, get: Callable[[str], Any]) -> dict[str, Any]:
        return {"max_length": get("max_length"),
                "precompute_ref_log_probs": bool(get("precompute_ref_log_probs")),
                "pad_to_multiple_of": get("pad_to_multiple_of"),
                "loss_type": str(get("loss_type") or "kto"),
                "ref_model": None,   # set by estimate_memory(ref_model=...)
                "activation_offloading": bool(get("activation_offloading")),
                # read for KTOTrainer.__init__'s refusal (config_problems) only
                "sampling": str(get("train_sampling_strategy") or "sequential")}

    def config_problems(self, options: Mapping[str, Any]) -> list[str]:
        if options.get("loss_type") != NO_KL and options.get("sampling") != "sequential":
            return [f"train_sampling_strategy={options['sampling']!r}: KTOTrainer refuses it "
                    f"with loss_type={options.get('loss_type')!r} (the KL completions are "
                    "paired with neighbouring examples of a fixed-order batch); use "
                    f"'sequential' or loss_type={NO_KL!r}"]
        return []

    def batch_problems(self, options: Mapping[str, Any], micro_batch: int, grad_accum: int,
                       ranks: int) -> list[str]:
        if options.get("loss_type", "kto") != NO_KL and micro_batch <= 1:
            return [f"per_device_train_batch_size={micro_batch}: KTOTrainer refuses a "
                    "micro-batch of 1 with the KL estimate (the KL term would equal the implied "
                    f"reward); use 2 or more, or loss_type={NO_KL!r}"]
        return []

    def shape(self, options: Mapping[str, Any], batch: int, seq: int) -> BatchShape:
        return BatchShape(batch, padded_length(options, seq), padded=True)

    def step(self, options: Mapping[str, Any]) -> TraceStep:
        return KTOStep(options)

    def reference(self, options: Mapping[str, Any], adapters: bool) -> str | None:
        return policy_reference(options, adapters)

    def notes(self, options: Mapping[str, Any]) -> list[str]:
        kl = ("; a KL row per example (the prompt with another example's completion) is scored "
              "without grad by the policy and the reference" if options.get("loss_type") != NO_KL
              else "")
        return [f"KTOTrainer: one prompt + completion row per example, scored by TRL's fused "
                f"log-prob head{kl}"] + head_notes(options, "the prompt")

    def completion_problem(self, options: Mapping[str, Any]) -> str | None:
        return None  # KTOTrainer labels only the completions (completion_mask)

    def run_problems(self, *, where: str, synthetic: bool, task: str | None,
                     callbacks: tuple[str, ...]) -> list[str]:
        return self.synthetic_problem(where, synthetic) + super().run_problems(
            where=where, synthetic=synthetic, task=task, callbacks=callbacks)

    def build(self, *, model: Any, args: Any, rows: Any, data_collator: Any,
              processing_class: Any, callbacks: list[Any], oom_guard: bool) -> Any:
        """``trl.KTOTrainer`` over unpaired examples made from ``rows`` (``unpaired``: a prompt
        of a quarter of the row, the rest as its completion, labels alternating), with the
        reference the plan counted: the policy's own adapters for LoRA/QLoRA, none with
        ``precompute_ref_log_probs``, else a frozen copy of the policy (``KTOTrainer`` would
        load one from the model's Hub name, which a model built from a config lacks)."""
        import copy

        import datasets
        import trl

        vocab = model.config.get_text_config().vocab_size
        examples = [unpaired(r["input_ids"], i) for i, r in enumerate(token_rows(rows))]
        adapters = hasattr(model, "disable_adapter")
        ref = None if adapters or args.precompute_ref_log_probs else copy.deepcopy(model).eval()
        return trl.KTOTrainer(model=model, ref_model=ref, args=args,
                              train_dataset=datasets.Dataset.from_list(examples),
                              processing_class=word_tokenizer(vocab), callbacks=callbacks)


def unpaired(ids: list[int], i: int) -> dict[str, Any]:
    """An unpaired example (``prompt``, ``completion``, ``label``) as words of ``word_tokenizer``:
    a prompt of ``len(ids) // 4`` tokens, the rest of the row as the completion, its last token
    replaced by EOS (KTOTrainer adds none then: prompt + completion = ``len(ids)`` tokens), the
    label alternating so that every micro-batch has both kinds."""
    q = max(1, len(ids) // 4)
    words = [f"w{t}" for t in ids]
    return {"prompt": " ".join(words[:q]), "completion": " " + " ".join([*words[q:-1], "<eos>"]),
            "label": i % 2 == 0}


register(KTO())
