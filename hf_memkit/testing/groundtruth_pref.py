"""Real ``KTOTrainer``, ``RewardTrainer`` and ``DistillationTrainer`` runs for the CPU ground truth
(``groundtruth``, through ``groundtruth_trl.make_trl_trainer``), on synthetic data and an
in-memory word tokenizer (``_trainers.data.word_tokenizer``: pad, EOS, unk are ids 0-2, ``w<id>``
is token ``id``), as users build them.

Spec keys besides ``groundtruth.measure_trainer_peak``'s (``seq_len``: a row's tokens):
  * "kto": rows ``{"prompt", "completion", "label"}`` of ``seq_len // 4`` and the rest of
    ``seq_len`` words, every other completion a word shorter, so batches are padded as real
    ones are (the completion ends in EOS, so KTOTrainer adds none), labels alternating; the KL
    rows KTOTrainer builds pair each prompt with the previous completion. ``ref_model`` (default True): a separate reference built like the policy, unless
    the policy is a PEFT model or ``precompute_ref_log_probs`` is set (KTOTrainer loads it from
    the model's Hub name otherwise);
  * "reward": pre-tokenized pairs ``{"chosen_ids", "rejected_ids"}`` of ``seq_len`` and
    ``seq_len - 1`` ids, so batches are padded as real ones are (RewardTrainer skips
    tokenizing); the spec's ``task`` must be "sequence-classification" and
    its config ``num_labels=1``, as RewardTrainer refuses other models;
  * "distillation": ``prompt`` rows of ``seq_len`` words; the teacher is ``spec["teacher"]``
    (a config dict, default the student's config) built like the student and passed as
    ``teacher_model``. EOS is id 1 of a vocabulary of thousands, so the random student's
    completions run to ``max_completion_length``.
"""

from __future__ import annotations

from typing import Any


def _words(g: Any, vocab: int, k: int) -> list[str]:
    import torch

    return [f"w{i}" for i in torch.randint(3, vocab, (k,), generator=g).tolist()]


def kto_rows(spec: dict[str, Any], vocab: int, n: int) -> list[dict[str, Any]]:
    import torch

    g = torch.Generator().manual_seed(1)
    s = spec["seq_len"]
    q = s // 4
    return [{"prompt": " ".join(_words(g, vocab, q)),
             "completion": " " + " ".join([*_words(g, vocab, s - q - 1 - i % 2), "<eos>"]),
             "label": i % 2 == 0} for i in range(n)]


def reward_rows(spec: dict[str, Any], vocab: int, n: int) -> list[dict[str, list[int]]]:
    import torch

    g = torch.Generator().manual_seed(1)
    s = spec["seq_len"]
    return [{"chosen_ids": torch.randint(3, vocab, (s,), generator=g).tolist(),
             "rejected_ids": torch.randint(3, vocab, (s - 1,), generator=g).tolist()}
            for _ in range(n)]


def prompt_rows(spec: dict[str, Any], vocab: int, n: int) -> list[dict[str, str]]:
    """``n`` prompts of ``seq_len`` words."""
    import torch

    g = torch.Generator().manual_seed(1)
    return [{"prompt": " ".join(_words(g, vocab, spec["seq_len"]))} for _ in range(n)]


def pref_trainer(spec: dict[str, Any], model: Any, a: dict[str, Any], n: int, workdir: str,
                 callbacks: list[Any]) -> Any:
    """The ``spec["trainer"]`` TRL trainer over ``n`` synthetic rows, ``a`` its config fields."""
    import datasets
    import trl

    from .._trainers.data import word_tokenizer as tokenizer
    from .models import spec_model

    vocab = model.config.get_text_config().vocab_size
    kind = spec["trainer"]
    if kind == "kto":
        config = trl.KTOConfig(**a)
        ref = None
        if spec.get("ref_model", True) and not spec.get("lora") and \
                not config.precompute_ref_log_probs:
            ref = spec_model(spec, workdir)
        return trl.KTOTrainer(model=model, ref_model=ref, args=config,
                              train_dataset=datasets.Dataset.from_list(kto_rows(spec, vocab, n)),
                              processing_class=tokenizer(vocab), callbacks=callbacks)
    if kind == "reward":
        return trl.RewardTrainer(model=model, args=trl.RewardConfig(**a),
                                 train_dataset=datasets.Dataset.from_list(
                                     reward_rows(spec, vocab, n)),
                                 processing_class=tokenizer(vocab), callbacks=callbacks)
    teacher_spec = {**spec, "config": spec.get("teacher") or spec["config"], "lora": None}
    return trl.DistillationTrainer(
        model=model, teacher_model=spec_model(teacher_spec, workdir).eval(),
        args=trl.DistillationConfig(**a),
        train_dataset=datasets.Dataset.from_list(prompt_rows(spec, vocab, n)),
        processing_class=tokenizer(vocab), callbacks=callbacks)
