"""The data of a recipe run: synthetic sequences of exactly ``seq_len`` tokens (labelled for a
classifier), or a local text / JSON-lines file tokenized by the recipe's local tokenizer.
Problems name the file and key (``ConfigError``, exit 2)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from .._errors import ConfigError
from .._recipe import Recipe


class _ClassifiedSynthetic(Dataset):
    """Synthetic sequences labelled by the range their first token falls in (learnable)."""

    def __init__(self, base: Dataset, num_labels: int, vocab_size: int):
        self.base, self.num_labels, self.vocab_size = base, num_labels, vocab_size

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        item = dict(self.base[i])
        item["labels"] = torch.tensor(int(item["input_ids"][0]) * self.num_labels
                                      // self.vocab_size)
        return item


class _Tokenized(Dataset):
    def __init__(self, rows: list[dict[str, Any]]):
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.rows[i]


def _read_records(recipe: Recipe, where: str, task: str) -> list[tuple[str, Any]]:
    path = Path(recipe.data)
    records: list[tuple[str, Any]] = []
    if path.suffix == ".txt":
        if task != "causal-lm":
            raise ConfigError([f"{where}: data.source: a .txt file has no labels; "
                               f"{task} needs a .jsonl file with `{recipe.label_field}`"],
                              source=where)
        records = [(line.strip(), None) for line in path.read_text().splitlines() if line.strip()]
    else:
        text = path.read_text()
        try:
            rows = json.loads(text) if text.lstrip().startswith("[") else [
                json.loads(line) for line in text.splitlines() if line.strip()]
        except json.JSONDecodeError as exc:
            raise ConfigError([f"{where}: data.source: `{path.name}` is not JSON lines (one "
                               f"object per line): {exc}"], source=where) from None
        for n, row in enumerate(rows, 1):
            if not isinstance(row, dict) or recipe.text_field not in row:
                raise ConfigError([f"{where}: data.text_field: record {n} of `{path.name}` has "
                                   f"no `{recipe.text_field}` key; keys: "
                                   f"{', '.join(row) if isinstance(row, dict) else type(row)}"],
                                  source=where)
            label = row.get(recipe.label_field)
            if task == "sequence-classification" and label is None:
                raise ConfigError([f"{where}: data.label_field: record {n} of `{path.name}` has "
                                   f"no `{recipe.label_field}` key"], source=where)
            records.append((str(row[recipe.text_field]), label))
    if not records:
        raise ConfigError([f"{where}: data.source: `{path.name}` holds no examples"], source=where)
    return records[: recipe.num_samples] if recipe.num_samples else records


def build_dataset(recipe: Recipe, config: Any, task: str, *, num_samples: int,
                  tokenizer: Any = None) -> tuple[Dataset, Any]:
    """``(dataset, data_collator)``: synthetic sequences of exactly ``seq_len`` tokens, or the
    file's examples tokenized (truncated to ``seq_len``, padded per batch)."""
    from .synthetic import SyntheticTextDataset

    where = recipe.source or "recipe"
    if recipe.is_synthetic:
        data = SyntheticTextDataset(vocab_size=config.vocab_size, seq_len=recipe.seq_len,
                                    num_samples=num_samples)
        if task == "sequence-classification":
            data = _ClassifiedSynthetic(data, config.num_labels, config.vocab_size)
        return data, None
    records = _read_records(recipe, where, task)
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ConfigError([f"{where}: model.tokenizer: the tokenizer has neither a pad nor "
                               "an eos token; add a pad token (tokenizer.add_special_tokens("
                               "{'pad_token': '[PAD]'}) and save it again)"], source=where)
        tokenizer.pad_token = tokenizer.eos_token
    if len(tokenizer) > config.vocab_size:
        raise ConfigError([f"{where}: model.overrides.vocab_size: the tokenizer has "
                           f"{len(tokenizer)} tokens but the model's vocab_size is "
                           f"{config.vocab_size}; set model.overrides.vocab_size: "
                           f"{len(tokenizer)}"], source=where)
    enc = tokenizer([t for t, _ in records], truncation=True, max_length=recipe.seq_len)
    rows = [{k: enc[k][i] for k in ("input_ids", "attention_mask")} for i in range(len(records))]
    from transformers import DataCollatorForLanguageModeling, DataCollatorWithPadding

    if task == "sequence-classification":
        labels = [lab for _, lab in records]
        ids = {v: i for i, v in enumerate(sorted(set(labels), key=str))} if not all(
            isinstance(v, int) for v in labels) else {v: v for v in set(labels)}
        if max(ids.values()) >= config.num_labels:
            raise ConfigError([f"{where}: model.overrides.num_labels: the data has "
                               f"{len(ids)} label(s) ({', '.join(map(str, list(ids)[:8]))}) "
                               f"but the model has {config.num_labels}; set "
                               f"model.overrides.num_labels: {max(ids.values()) + 1}"],
                              source=where)
        for row, lab in zip(rows, labels, strict=True):
            row["labels"] = ids[lab]
        return _Tokenized(rows), DataCollatorWithPadding(tokenizer)
    return _Tokenized(rows), DataCollatorForLanguageModeling(tokenizer, mlm=False)


def load_tokenizer(recipe: Recipe) -> Any:
    from transformers import AutoTokenizer

    where = recipe.source or "recipe"
    tok_dir = recipe.tokenizer_dir()
    if tok_dir is None:
        raise ConfigError([f"{where}: model.tokenizer: data from a file needs a tokenizer; set "
                           "model.tokenizer to a local directory (tokenizer.save_pretrained)"],
                          source=where)
    try:
        return AutoTokenizer.from_pretrained(tok_dir, local_files_only=True,
                                             trust_remote_code=False)
    except Exception as exc:
        raise ConfigError([f"{where}: model.tokenizer: cannot load a tokenizer from "
                           f"`{tok_dir}`: {exc}"], source=where) from None
