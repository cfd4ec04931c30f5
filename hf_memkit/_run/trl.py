"""The trainer a recipe's ``trainer:`` key names, for ``hf-memkit train`` (``_train``).

``trainer`` (the default): ``transformers.Trainer`` (``OOMGuardTrainer`` with the ``oom_guard``
callback). ``sft``: TRL's real ``SFTTrainer``, built as users build it: the plan's
``SFTConfig`` (``Plan.to_training_args``: ``max_length`` is the recipe's ``seq_len``, the pins
are the config's fields), the recipe's rows as pre-tokenized ``input_ids`` lists (TRL then skips
tokenizing, truncates to ``max_length`` and packs or pads as its config says), and the recipe's
tokenizer, or for synthetic data a word-level tokenizer built in memory (nothing downloaded:
``SFTTrainer`` loads one from the model's name otherwise). hf_memkit's ``MemoryCallback`` and
``ThroughputCallback`` ride along as on the plain path. ``dpo``: TRL's real ``DPOTrainer`` on
synthetic preference pairs made from the recipe's rows (a prompt of ``seq_len // 4`` tokens, the
row's true continuation as ``chosen`` and a shifted one a token shorter as ``rejected``, each
ending in EOS, so prompt + chosen is ``seq_len`` tokens: the length the plan estimated), written
as words of the in-memory tokenizer since ``DPOTrainer`` tokenizes text itself. Its reference
model is what the plan counted (``_trainers/dpo.py``): the policy's own adapters for LoRA/QLoRA,
none with ``precompute_ref_log_probs``, else a frozen copy of the policy (``DPOTrainer`` would
load one from the model's Hub name, which a model built from a config does not have).
"""

from __future__ import annotations

from typing import Any

from .._errors import ConfigError


def check_trl_trainable(recipe: Any, task: str | None = None) -> None:
    """``ConfigError`` naming the file and key when ``hf-memkit train`` cannot train the
    recipe's TRL trainer (nothing to check for the plain Trainer)."""
    if recipe.trainer == "trainer":
        return
    where = recipe.source or "recipe"
    problems = []
    if recipe.trainer == "dpo" and not recipe.is_synthetic:
        problems.append(
            f"{where}: data.source: `hf-memkit train` makes DPO's preference pairs (prompt, "
            "chosen, rejected) only for data: synthetic; for your own pairs train DPOTrainer "
            "yourself with plan.to_training_args() and hf_memkit.MemoryCallback(plan) (hf-memkit "
            f"plan {where} works as it is)")
    if task is not None and task != "causal-lm":
        problems.append(f"{where}: model.task: trainer: {recipe.trainer} trains a causal LM; "
                        f"this model's task is {task} (use trainer: trainer, or model.task: "
                        "causal-lm)")
    if "oom_guard" in recipe.callbacks:
        problems.append(
            f"{where}: callbacks: oom_guard retries a step by splitting its micro-batch into "
            f"rows, which TRL's packed and padding-free batches do not allow; with trainer: "
            f"{recipe.trainer} drop oom_guard (the plan already fits the memory it was given)")
    if problems:
        raise ConfigError(problems, source=where)


def make_trainer(recipe: Any, *, model: Any, args: Any, train_dataset: Any, data_collator: Any,
                 processing_class: Any, callbacks: list[Any]) -> Any:
    """The trainer ``recipe.trainer`` names, over ``train_dataset`` (``_train.build_dataset``:
    rows with ``input_ids``) with ``callbacks``; ``args``: the plan's config for that trainer."""
    if recipe.trainer == "trainer":
        from transformers import Trainer

        from .._oom.guard import OOMGuardTrainer

        cls = OOMGuardTrainer if "oom_guard" in recipe.callbacks else Trainer
        return cls(model=model, args=args, train_dataset=train_dataset,
                   data_collator=data_collator, processing_class=processing_class,
                   callbacks=callbacks)
    check_trl_trainable(recipe)
    if recipe.trainer == "dpo":
        return dpo_trainer(model=model, args=args, rows=train_dataset, callbacks=callbacks)
    return sft_trainer(model=model, args=args, rows=train_dataset,
                       processing_class=processing_class, callbacks=callbacks)


def sft_trainer(*, model: Any, args: Any, rows: Any, processing_class: Any,
                callbacks: list[Any]) -> Any:
    """``trl.SFTTrainer`` over ``rows`` (anything indexable whose items hold ``input_ids``),
    pre-tokenized; ``processing_class`` None: ``word_tokenizer`` over the model's vocabulary."""
    import datasets
    import trl

    data = datasets.Dataset.from_list(
        [{"input_ids": [int(t) for t in rows[i]["input_ids"]]} for i in range(len(rows))])
    if processing_class is None:
        processing_class = word_tokenizer(model.config.get_text_config().vocab_size)
    return trl.SFTTrainer(model=model, args=args, train_dataset=data,
                          processing_class=processing_class, callbacks=callbacks)


def dpo_trainer(*, model: Any, args: Any, rows: Any, callbacks: list[Any]) -> Any:
    """``trl.DPOTrainer`` over preference pairs made from ``rows`` (module docstring), with the
    reference model the plan counted."""
    import copy

    import datasets
    import trl

    vocab = model.config.get_text_config().vocab_size
    pairs = [preference_pair([int(t) for t in rows[i]["input_ids"]], vocab)
             for i in range(len(rows))]
    adapters = hasattr(model, "disable_adapter")       # a PEFT policy is its own reference
    ref = None if adapters or args.precompute_ref_log_probs else copy.deepcopy(model).eval()
    return trl.DPOTrainer(model=model, ref_model=ref, args=args,
                          train_dataset=datasets.Dataset.from_list(pairs),
                          processing_class=word_tokenizer(vocab), callbacks=callbacks)


def preference_pair(ids: list[int], vocab: int) -> dict[str, str]:
    """A prompt of ``len(ids) // 4`` tokens; ``chosen``: the rest of the row, its last token
    replaced by EOS (prompt + chosen = ``len(ids)`` tokens); ``rejected``: that continuation
    shifted by one token id, one token shorter. Words of ``word_tokenizer``, one token each."""
    def text(tokens: list[int], eos: str = "") -> str:
        return " ".join([*(f"w{t}" for t in tokens), *([eos] if eos else [])])

    q = max(1, len(ids) // 4)
    rest = ids[q:-1]
    wrong = [(t + 1) % vocab for t in rest[:-1]]
    return {"prompt": text(ids[:q]), "chosen": " " + text(rest, "<eos>"),
            "rejected": " " + text(wrong, "<eos>")}


def word_tokenizer(vocab: int) -> Any:
    """A word-level fast tokenizer over ``vocab`` ids, built in memory (synthetic data has token
    ids, not text): ``<pad>``, ``<eos>``, ``<unk>`` are ids 0-2 and ``w<id>`` is token ``id``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{f"w{i}": i for i in range(3, vocab)}}
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                   unk_token="<unk>")
