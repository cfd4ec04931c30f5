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
    ``DPOTrainer`` loads the reference from the model's Hub name otherwise, DESIGN.md).

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

    from .models import build_model

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
            ref = build_model(spec, workdir)
        return trl.DPOTrainer(model=model, ref_model=ref, args=config, train_dataset=data,
                              processing_class=tokenizer(vocab), callbacks=callbacks)
    raise ValueError(f"trainer must be 'trainer', 'sft' or 'dpo', got {kind!r}")
