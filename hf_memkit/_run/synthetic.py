"""Synthetic data and tiny models: what the demo, tests and benchmarks train on offline."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset
from transformers import LlamaConfig


class SyntheticTextDataset(Dataset):
    """Random token sequences as a causal-LM dataset (``input_ids``, ``attention_mask``, ``labels``).

    With ``variable_length=True`` lengths vary between ``seq_len // 2`` and ``seq_len`` (the
    padding path of real data); every item is deterministic in ``(seed, index)``. Each item also
    carries ``sample_id`` only if ``with_ids=True`` (useful to audit which samples were seen).
    With ``learnable=True`` a sequence counts up by one from a random start (mod the
    vocabulary), so a model can learn it and the loss visibly falls.
    """

    def __init__(self, *, vocab_size: int, seq_len: int, num_samples: int = 256, seed: int = 0,
                 variable_length: bool = False, with_ids: bool = False,
                 learnable: bool = True):
        if seq_len <= 0 or num_samples <= 0 or vocab_size <= 1:
            raise ValueError("seq_len and num_samples must be positive and vocab_size > 1")
        self.vocab_size, self.seq_len, self.num_samples = vocab_size, seq_len, num_samples
        self.seed, self.variable_length, self.with_ids = seed, variable_length, with_ids
        self.learnable = learnable

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not 0 <= i < self.num_samples:
            raise IndexError(i)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        n = self.seq_len
        if self.variable_length:
            n = int(torch.randint(max(1, self.seq_len // 2), self.seq_len + 1, (1,), generator=g))
        if self.learnable:
            start = torch.randint(0, self.vocab_size, (1,), generator=g)
            stride = 1
            ids = (start + stride * torch.arange(n)) % self.vocab_size
        else:
            ids = torch.randint(0, self.vocab_size, (n,), generator=g)
        item = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
        if self.with_ids:
            item["sample_id"] = torch.tensor(i)
        return item


def tiny_llama_config(**overrides) -> LlamaConfig:
    """A 0.87M-parameter Llama (GQA, untied head) that trains on a laptop CPU in seconds."""
    kw = dict(hidden_size=128, intermediate_size=352, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=512, max_position_embeddings=512,
              tie_word_embeddings=False, attention_dropout=0.0)
    kw.update(overrides)
    return LlamaConfig(**kw)
