"""``estimate_memory(..., lengths=[...])``: TRL's BFD packing simulated bin for bin, and the
largest micro-batch a padding-free SFT step can be handed."""

from __future__ import annotations

import random
import warnings

import pytest
from transformers import LlamaConfig

import hf_memkit as mk
from hf_memkit._trainers.packing import bfd_bins, peak_tokens
from tests.helpers import require

CFG = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=1000)


@pytest.mark.parametrize("strategy", ["bfd", "bfd_split"])
def test_bins_are_trls_own(strategy):
    """Against TRL's pack_dataset on a real dataset: the same bins in the same order, over
    several of datasets.map's 1000-row batches."""
    datasets = require("datasets")
    data_utils = require("trl.data_utils")
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
    require("trl")
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
    require("trl")
    with pytest.raises(mk.HfMemkitError, match=r"positive integers.*\[0, -3\]"):
        _est(dict(per_device_train_batch_size=2, max_length=256, packing=True),
             lengths=[10, 0, -3])
    with pytest.raises(mk.HfMemkitError, match="empty list"):
        _est(dict(per_device_train_batch_size=2, max_length=256, packing=True), lengths=[])


# -- planning from lengths ---------------------------------------------------------------------
SKEWED = [20 + (37 * i) % 100 for i in range(300)] + [512] * 3   # mostly short, a few long


def _plan(**kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return mk.plan_training(CFG, trainer="sft", target_batch_size=16, device="cpu",
                                method="full", **kw)


def test_a_plan_from_lengths_flattens_short_rows_and_says_what_to_truncate():
    """Most rows short, a few at 512: a padded micro-batch pays for its longest row, the
    padding-free one for the real tokens; with room for both the plan takes padding-free and
    emits what TRL needs for it (max_length=None), and its estimate is estimate_memory's for the
    emitted arguments and the same lengths."""
    require("trl")
    p = _plan(lengths=SKEWED)
    ta = p.training_args_kwargs
    assert p.chosen.padding_free and ta["padding_free"] is True and ta["max_length"] is None
    assert p.seq_len == 512
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        again = mk.estimate_memory(CFG, ta, trainer="sft", lengths=SKEWED, device="cpu")
    mb = ta["per_device_train_batch_size"]
    assert p.estimate.device_used == again.device_used
    assert any(f"holds {3 * 512 + sum(sorted(SKEWED)[-mb:-3])} tokens" in n for n in p.notes)
    # padded candidates peak at the longest row and cost E[longest of the micro-batch]
    padded = [c for c in p.candidates if not c.padding_free and c.micro_batch == mb]
    assert padded and all(c.rel_time > 1 for c in padded)


def test_a_budget_below_the_worst_micro_batch_picks_another_setup():
    require("trl")
    roomy = _plan(lengths=SKEWED)
    tight = _plan(lengths=SKEWED, max_memory=roomy.estimate.upper - 1)
    assert tight.chosen.label() != roomy.chosen.label()
    assert tight.estimate.upper <= roomy.estimate.upper - 1 < roomy.estimate.upper


def test_mean_and_max_plan_the_worst_micro_batch():
    require("trl")
    p = _plan(mean_len=60, max_len=256)
    assert p.seq_len == 256 and p.chosen.padding_free
    mb = p.chosen.micro_batch
    assert any(f"holds {mb * 256} tokens" in n for n in p.notes)


@pytest.mark.parametrize("kw, match", [
    (dict(lengths=[10, 20], trainer="dpo"), "trainer='sft'"),
    (dict(lengths=[10, 20], seq_len=64), "leave seq_len out"),
    (dict(lengths=[10, 0]), r"positive integers.*\[0\]"),
    (dict(mean_len=300, max_len=256), "0 < mean_len <= max_len"),
    (dict(lengths=[10], mean_len=5, max_len=10), "not both"),
])
def test_bad_length_requests_are_named(kw, match):
    require("trl")
    kw.setdefault("trainer", "sft")
    with pytest.raises(mk.HfMemkitError, match=match):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mk.plan_training(CFG, target_batch_size=16, device="cpu", method="full", **kw)
