"""``estimate_memory(..., lengths=[...])``: TRL's BFD packing simulated bin for bin, and the
largest micro-batch a padding-free SFT step can be handed."""

from __future__ import annotations

import random
import warnings

import pytest
from transformers import LlamaConfig

import hf_memkit as mk
from hf_memkit._trainers.packing import bfd_bins, peak_tokens

CFG = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=1000)


@pytest.mark.parametrize("strategy", ["bfd", "bfd_split"])
def test_bins_are_trls_own(strategy):
    """Against TRL's pack_dataset on a real dataset: the same bins in the same order, over
    several of datasets.map's 1000-row batches."""
    datasets = pytest.importorskip("datasets")
    data_utils = pytest.importorskip("trl.data_utils")
    rng = random.Random(7)
    lengths = [rng.randint(1, 700) for _ in range(2300)]
    ds = datasets.Dataset.from_list([{"input_ids": [1] * n} for n in lengths])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        packed = data_utils.pack_dataset(ds, 512, strategy)
    assert bfd_bins(lengths, 512, split=strategy == "bfd_split") == \
        [len(x) for x in packed["input_ids"]]


def test_the_largest_micro_batch_holds_the_fullest_bins_or_longest_rows():
    lengths = [100, 60, 96] * 2 + [100, 60]   # BFD at 256: bins of 200, 256, 216
    assert bfd_bins(lengths, 256) == [200, 256, 216]
    assert peak_tokens(lengths, 2, packing=True, max_length=256) == 256 + 216
    assert peak_tokens(lengths, 2, packing=False, max_length=None) == 200


def _est(args, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return mk.estimate_memory(CFG, dict(args, bf16=False, gradient_checkpointing=False),
                                  device="cpu", trainer="sft", **kw)


def test_lengths_set_the_tokens_of_a_packed_step():
    """A packed step of the two fullest bins (472 tokens) is a padding-free step of 472
    tokens: the same trace as padding-free rows of 236 x 2."""
    pytest.importorskip("trl")
    lengths = [100, 60, 96] * 2 + [100, 60]
    packed = _est(dict(per_device_train_batch_size=2, max_length=256, packing=True),
                  lengths=lengths)
    free = _est(dict(per_device_train_batch_size=2, max_length=None, padding_free=True),
                seq_len=236)
    full_bins = _est(dict(per_device_train_batch_size=2, max_length=256, packing=True))
    assert packed.peak_allocated == free.peak_allocated < full_bins.peak_allocated
    assert any("472 tokens" in n for n in packed.notes)
    # a padded batch peaks at its longest row, truncated at max_length
    padded = _est(dict(per_device_train_batch_size=2, max_length=96), lengths=lengths)
    assert padded.seq_len == 96


def test_bad_lengths_are_named():
    pytest.importorskip("trl")
    with pytest.raises(mk.HfMemkitError, match=r"positive integers.*\[0, -3\]"):
        _est(dict(per_device_train_batch_size=2, max_length=256, packing=True),
             lengths=[10, 0, -3])
    with pytest.raises(mk.HfMemkitError, match="empty list"):
        _est(dict(per_device_train_batch_size=2, max_length=256, packing=True), lengths=[])
