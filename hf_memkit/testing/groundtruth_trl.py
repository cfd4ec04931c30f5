"""TRL trainers for the CPU ground truth (``groundtruth``): a real ``SFTTrainer`` or
``DPOTrainer`` on synthetic, already tokenized data, as users build them.

Spec keys besides ``groundtruth.measure_trainer_peak``'s:
  * ``trainer``: "sft" or "dpo"; ``args`` then holds ``SFTConfig`` / ``DPOConfig`` fields;
  * ``lengths`` (SFT): token counts of the rows, cycled (default every row ``seq_len``). Each row
    is ``input_ids`` only, so TRL skips tokenizing, truncates to ``max_length`` and packs or
    pads as its config says;
  * ``dpo`` (DPO): ``{"prompt": n, "chosen": n, "rejected": n}``, token counts (ints or lists,
    cycled) of each row's prompt, chosen and rejected text (EOS included in the completions).
    DPOTrainer tokenizes text itself, so the rows are words ``w<id>`` that the in-memory
    tokenizer maps one to one onto token ids;
  * ``ref_model`` (DPO, default True): pass a separate reference model, built like the policy,
    unless the policy is a PEFT model or ``precompute_ref_log_probs`` is set (as users must:
    ``DPOTrainer`` loads the reference from the model's Hub name otherwise,
    docs/stack-facts.md#trl-sfttrainer-and-dpotrainer);
  * "grpo" / "rloo": ``GRPOTrainer`` / ``RLOOTrainer`` generating with the policy's own
    ``generate`` (``use_vllm=False``); each row is a ``prompt`` of ``seq_len`` words (the longest
    prompt, as ``estimate_memory``'s ``seq_len``), rewarded by the completion's share of even
    token ids (any function does: rewards are host floats). EOS is id 1 of a vocabulary of
    thousands, so a random policy's completions run to ``max_completion_length`` (generation
    stops only when every row has stopped). With ``beta > 0`` and no PEFT, TRL loads the
    reference from the policy's ``_name_or_path``: the policy is saved to the work directory
    first and its config points there;
  * "kto" / "reward" / "distillation": ``KTOTrainer``, ``RewardTrainer``, ``DistillationTrainer``
    (``groundtruth_pref``).

The processing class is a word-level tokenizer built in memory (no download): pad, EOS and
unk are ids 0-2 and ``w<id>`` is token ``id``, split on whitespace.
"""

from __future__ import annotations

from itertools import cycle, islice
from typing import Any


def tokenizer(vocab: int):
    """A word-level fast tokenizer over ``vocab`` ids, built offline."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{f"w{i}": i for i in range(3, vocab)}}
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                   unk_token="<unk>")


def _counts(v: Any, n: int) -> list[int]:
    return list(islice(cycle(v if isinstance(v, (list, tuple)) else [v]), n))


def _ids(g: Any, vocab: int, k: int) -> list[int]:
    import torch

    return torch.randint(3, vocab, (k,), generator=g).tolist()  # never pad / EOS / unk


def sft_rows(spec: dict[str, Any], vocab: int, n: int) -> list[dict[str, list[int]]]:
    import torch

    g = torch.Generator().manual_seed(1)
    return [{"input_ids": _ids(g, vocab, k)} for k in _counts(spec.get("lengths", spec["seq_len"]), n)]


def dpo_rows(spec: dict[str, Any], vocab: int, n: int) -> list[dict[str, list[int]]]:
    import torch

    g = torch.Generator().manual_seed(1)
    lens = spec.get("dpo") or {}
    p = _counts(lens.get("prompt", spec["seq_len"] // 4), n)
    c = _counts(lens.get("chosen", spec["seq_len"] - spec["seq_len"] // 4), n)
    r = _counts(lens.get("rejected", spec["seq_len"] - spec["seq_len"] // 4 - 1), n)
    def text(k: int) -> str:
        return " ".join(f"w{i}" for i in _ids(g, vocab, k))

    return [{"prompt": text(a), "chosen": " " + text(b - 1) + " <eos>",
             "rejected": " " + text(k - 1) + " <eos>"} for a, b, k in zip(p, c, r, strict=True)]


def make_trl_trainer(spec: dict[str, Any], model: Any, a: dict[str, Any], n: int, workdir: str,
                     callbacks: list[Any]) -> Any:
    """The TRL trainer of ``spec`` over ``n`` synthetic rows, with ``a`` as its config fields."""
    import datasets
    import trl

    from .models import spec_model

    vocab = model.config.get_text_config().vocab_size
    kind = spec["trainer"]
    if kind == "sft":
        config = trl.SFTConfig(**a)
        data = datasets.Dataset.from_list(sft_rows(spec, vocab, n))
        return trl.SFTTrainer(model=model, args=config, train_dataset=data,
                              processing_class=tokenizer(vocab), callbacks=callbacks)
    if kind == "dpo":
        config = trl.DPOConfig(**a)
        data = datasets.Dataset.from_list(dpo_rows(spec, vocab, n))
        ref = None
        if spec.get("ref_model", True) and not spec.get("lora") and \
                not config.precompute_ref_log_probs:
            ref = spec_model(spec, workdir)
        return trl.DPOTrainer(model=model, ref_model=ref, args=config, train_dataset=data,
                              processing_class=tokenizer(vocab), callbacks=callbacks)
    if kind in ("grpo", "rloo"):
        return _rl_trainer(spec, model, a, n, workdir, callbacks)
    if kind in ("kto", "reward", "distillation"):
        from .groundtruth_pref import pref_trainer

        return pref_trainer(spec, model, a, n, workdir, callbacks)
    raise ValueError(f"trainer must be 'trainer', 'sft', 'dpo', 'grpo', 'rloo', 'kto', 'reward' or "
                     f"'distillation', got {kind!r}")


def prompt_rows(spec: dict[str, Any], vocab: int, n: int) -> list[dict[str, str]]:
    """``n`` prompts of ``spec["prompt_lengths"]`` (cycled; default ``seq_len``) words."""
    import torch

    g = torch.Generator().manual_seed(1)
    return [{"prompt": " ".join(f"w{i}" for i in _ids(g, vocab, k))}
            for k in _counts(spec.get("prompt_lengths", spec["seq_len"]), n)]


def _rl_trainer(spec: dict[str, Any], model: Any, a: dict[str, Any], n: int, workdir: str,
                callbacks: list[Any]) -> Any:
    import os

    import datasets
    import trl

    from .._trainers.rl import even_ids

    vocab = model.config.get_text_config().vocab_size
    config_cls, trainer_cls = (trl.GRPOConfig, trl.GRPOTrainer) if spec["trainer"] == "grpo" \
        else (trl.RLOOConfig, trl.RLOOTrainer)
    a = dict(a, use_vllm=False)
    # every prompt is repeated num_generations times: n rows of completions need n / G prompts
    config = config_cls(**a)
    prompts = prompt_rows(spec, vocab, max(1, n // config.num_generations) + 1)
    if config.beta != 0.0 and not spec.get("lora"):  # TRL loads the reference from here
        path = os.path.join(workdir, "policy")
        model.save_pretrained(path)
        model.config._name_or_path = path
    return trainer_cls(model=model, reward_funcs=even_ids, args=config,
                       train_dataset=datasets.Dataset.from_list(prompts),
                       processing_class=tokenizer(vocab), callbacks=callbacks)
