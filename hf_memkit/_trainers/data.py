"""The data ``hf-memkit train`` hands TRL's trainers when a recipe names one (``build`` of the
``sft`` and ``dpo`` entries): the recipe's rows as pre-tokenized ``input_ids`` lists (TRL then
skips tokenizing, truncates to ``max_length`` and packs or pads as its config says) and, for
synthetic data, a word-level tokenizer built in memory (nothing downloaded: ``SFTTrainer`` loads
one from the model's name otherwise). DPO gets synthetic preference pairs made from the rows (a
prompt of ``seq_len // 4`` tokens, the row's true continuation as ``chosen`` and a shifted one a
token shorter as ``rejected``, each ending in EOS, so prompt + chosen is ``seq_len`` tokens: the
length the plan estimated), written as words of the in-memory tokenizer since ``DPOTrainer``
tokenizes text itself."""

from __future__ import annotations

from typing import Any


def token_rows(rows: Any) -> list[dict[str, list[int]]]:
    """``rows`` (anything indexable whose items hold ``input_ids``) as lists of ints; a row's
    ``completion_mask`` (1 on the completion's tokens) is kept, so that ``SFTTrainer`` with
    ``completion_only_loss`` scores the completion alone, as it does for its own
    prompt-completion rows."""
    out = []
    for i in range(len(rows)):
        row = {"input_ids": [int(t) for t in rows[i]["input_ids"]]}
        if "completion_mask" in rows[i]:
            row["completion_mask"] = [int(t) for t in rows[i]["completion_mask"]]
        out.append(row)
    return out


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
