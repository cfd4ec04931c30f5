"""``trl.RewardTrainer``: a sequence classifier with one output scores chosen and rejected rows.

Read from ``RewardTrainer.__init__`` / ``compute_loss`` and its ``DataCollatorForPreference``
(TRL 1.16, ``trl/trainer/reward_trainer.py``):
  * the model is an ``AutoModelForSequenceClassification`` with ``num_labels=1`` (a model name is
    loaded so; an instantiated model with another ``num_labels`` is refused); its
    ``pad_token_id`` is set from the tokenizer, so the classifier pools each row at its last
    real token;
  * the collator stacks every example's chosen ids and then its rejected ids: a micro-batch of
    B examples is 2B rows, right-padded to the longest (a real attention mask), padded up to
    ``pad_to_multiple_of``. ``max_length`` does not truncate: ``_prepare_dataset`` drops pairs
    whose chosen or rejected row is longer, so the longest row is at most ``max_length`` (the
    default ``seq_len``);
  * ``compute_loss`` runs the model's own forward without labels (``label_names = []``): the
    backbone, the score head's ``[2B, tokens, 1]`` and the pooled ``[2B, 1]`` rewards, then
    ``-logsigmoid(chosen - rejected).mean()`` (+ ``center_rewards_coefficient`` x the mean
    squared reward): no vocabulary-sized logits, no fused head, no reference model;
  * ``activation_offloading`` wraps the training step in TRL's offloading context
    (``offload``), as ``SFTTrainer`` does.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from .._errors import HfMemkitError
from .base import BatchShape, TraceStep, TrlTrainerKind, padded_length, register
from .data import token_rows, word_tokenizer

TASK = "sequence-classification"


def preference_ids(ids: list[int], vocab: int) -> dict[str, list[int]]:
    """A tokenized pair as ``RewardTrainer`` takes it (``chosen_ids`` / ``rejected_ids``: it skips
    tokenizing): the row as it is and the row with every token id shifted by one (ids 0-2 are
    the in-memory tokenizer's pad, EOS and unk, kept out), both ``len(ids)`` tokens."""
    return {"chosen_ids": list(ids),
            "rejected_ids": [3 + (t - 2) % (vocab - 3) if t >= 3 else t for t in ids]}


class RewardStep(TraceStep):
    title = "RewardTrainer"

    def prepare(self, model: Any, *, adapters: bool) -> None:
        super().prepare(model, adapters=adapters)
        labels = getattr(model.config, "num_labels", None)
        if not type(model).__name__.endswith("ForSequenceClassification") or labels != 1:
            raise HfMemkitError(
                f"RewardTrainer trains a sequence classifier with num_labels=1 (its __init__ "
                f"refuses others); this model is a {type(model).__name__} with num_labels="
                f"{labels}: pass task='sequence-classification' and a config with num_labels=1")
        text = model.config.get_text_config()
        if text.pad_token_id is None:   # RewardTrainer.__init__ sets it from the tokenizer
            text.pad_token_id = 0

    def loss(self, model: Any, batch: dict[str, Any], reference: Any = None) -> Any:
        inputs = {k: v for k, v in batch.items() if k != "labels"}   # label_names = []
        out = model(**inputs, use_cache=False)               # RewardTrainer.compute_loss
        chosen, rejected = torch.chunk(out.logits.squeeze(-1), chunks=2)
        loss = -torch.nn.functional.logsigmoid(chosen - rejected).mean()
        coef = self.options.get("center_rewards_coefficient")
        if coef is not None:
            loss = loss + coef * torch.mean((chosen + rejected) ** 2)
        return loss


class Reward(TrlTrainerKind):
    name = "reward"
    title = "RewardTrainer"
    config_class = "trl.RewardConfig"
    synthetic_examples = "RewardTrainer's pairs"
    sequence_split = False   # chosen and rejected rows go together: not split over ranks
    fields = ("max_length", "pad_to_multiple_of", "activation_offloading",
              "center_rewards_coefficient")
    memory_difference = (
        "it trains a sequence classifier with one output (num_labels=1) on chosen and rejected "
        "rows stacked (2 x micro-batch rows): no vocabulary-sized logits, so it holds less per "
        "token than an LM's step of the same rows")

    def read(self, get: Callable[[str], Any]) -> dict[str, Any]:
        return {"max_length": get("max_length"), "pad_to_multiple_of": get("pad_to_multiple_of"),
                "activation_offloading": bool(get("activation_offloading")),
                "center_rewards_coefficient": get("center_rewards_coefficient")}

    def shape(self, options: Mapping[str, Any], batch: int, seq: int) -> BatchShape:
        return BatchShape(2 * batch, padded_length(options, seq), padded=True)

    def step(self, options: Mapping[str, Any]) -> TraceStep:
        return RewardStep(options)

    def notes(self, options: Mapping[str, Any]) -> list[str]:
        return ["RewardTrainer: each example is a chosen and a rejected row (2 x micro-batch "
                "rows, right-padded) scored by a sequence classifier with one output; pairs "
                "longer than max_length are dropped, not truncated"]

    def completion_problem(self, options: Mapping[str, Any]) -> str | None:
        return ("completion_len does not apply to RewardTrainer: its classifier scores each "
                "whole row, with no vocabulary head")

    def run_problems(self, *, where: str, synthetic: bool, task: str | None,
                     callbacks: tuple[str, ...]) -> list[str]:
        problems = []
        if task != TASK:
            problems.append(f"{where}: model.task: trainer: {self.name} trains a sequence "
                            f"classifier with num_labels=1; set model.task: {TASK} and "
                            "model.overrides: {num_labels: 1}")
        problems += self.synthetic_problem(where, synthetic)
        if "oom_guard" in callbacks:
            problems.append(f"{where}: callbacks: oom_guard splits a micro-batch into rows, "
                            "which would separate chosen from rejected rows; drop it")
        return problems

    def build(self, *, model: Any, args: Any, rows: Any, data_collator: Any,
              processing_class: Any, callbacks: list[Any], oom_guard: bool) -> Any:
        """``trl.RewardTrainer`` over pre-tokenized pairs made from ``rows``
        (``data.preference_ids``: ``chosen_ids`` the row, ``rejected_ids`` it shifted by one
        token id), ``model`` a sequence classifier with ``num_labels=1``."""
        import datasets
        import trl

        vocab = model.config.get_text_config().vocab_size
        pairs = [preference_ids(r["input_ids"], vocab) for r in token_rows(rows)]
        return trl.RewardTrainer(model=model, args=args,
                                 train_dataset=datasets.Dataset.from_list(pairs),
                                 processing_class=processing_class or word_tokenizer(vocab),
                                 callbacks=callbacks)


register(Reward())
