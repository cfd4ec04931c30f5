"""Values given in Python code are read as Python values (issue 28, "silently read"): a string
in a bool / number field of an ``estimate_memory`` dict or a ``plan_training`` pin is refused
(transformers reads ``bf16="False"`` as true), ``lengths`` takes any integral counts and refuses
what is not a sequence of them, one rule for ``lengths`` beside ``seq_len``, SFTTrainer's own
padding-free rule, token ids and budgets that cannot be used, and a sequence length named by the
argument it came from."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from transformers import GPT2Config, LlamaConfig, TrainingArguments

import hf_memkit as mk
from tests.helpers import require

TINY_KW = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
               num_key_value_heads=1, vocab_size=128, max_position_embeddings=256)
TINY = LlamaConfig(**TINY_KW)
FP32 = dict(bf16=False, gradient_checkpointing=False, per_device_train_batch_size=2)


def est(args=None, **kw):
    kw.setdefault("device", "cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return mk.estimate_memory(TINY, args, **kw)


def plan(**kw):
    kw.setdefault("device", "cpu")
    kw.setdefault("target_batch_size", 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return mk.plan_training(TINY, **kw)


def test_a_string_in_a_typed_field_is_refused_in_dicts_and_pins(tmp_path):
    # transformers keeps the string, and a non-empty string is true
    ta = TrainingArguments(str(tmp_path), bf16="False", use_cpu=True, report_to=[])
    assert ta.bf16 == "False" and bool(ta.bf16)
    for call in (lambda: est({"bf16": "False"}, seq_len=64),
                 lambda: plan(seq_len=64, bf16="False")):
        with pytest.raises(mk.ConfigError) as ei:
            call()
        msg = str(ei.value)
        assert "`bf16` expects True or False, got 'False' (a string" in msg
        assert "pass bf16=False" in msg and "only on the command line and in recipes" in msg
    require("trl")
    with pytest.raises(mk.ConfigError) as ei:
        est({"packing": "False", "padding_free": "false"}, seq_len=64, trainer="sft")
    assert ei.value.problems == [
        p.replace("NAME", n).replace("TEXT", t) for n, t in (("packing", "False"),
                                                            ("padding_free", "false"))
        for p in ["`NAME` expects True or False, got 'TEXT' (a string, which Python reads as "
                  "true): pass NAME=False; text is parsed as a value only on the command line "
                  "and in recipes"]]
    for call in (lambda: est({"beta": "high"}, seq_len=64, trainer="dpo"),
                 lambda: plan(seq_len=64, trainer="dpo", beta="high")):
        with pytest.raises(mk.ConfigError, match=r"`beta` expects a number \(an int or a float"
                                                 r"\), got 'high' \(a string\): pass a number"):
            call()
    # Python values of the right type still pass, 0/1 for a bool too
    assert est({"bf16": 0, **{k: v for k, v in FP32.items() if k != "bf16"}},
               seq_len=64).peak_allocated == est(FP32, seq_len=64).peak_allocated


def test_lengths_take_numpy_and_torch_integers_and_refuse_dict_set_and_str():
    require("trl")
    rows = [10, 40, 25, 64]
    args = {**FP32, "max_length": None, "padding_free": True}
    want = est(args, trainer="sft", lengths=rows)
    for given in (np.array(rows), [np.int64(v) for v in rows], torch.tensor(rows),
                  (v for v in rows)):
        got = est(args, trainer="sft", lengths=given)
        assert (got.seq_len, got.peak_allocated) == (want.seq_len, want.peak_allocated) == (
            64, want.peak_allocated)
    assert plan(trainer="sft", lengths=np.array(rows)).seq_len == 64
    for bad, says in (({10: 3, 40: 1}, "got a dict (its keys would be read as the counts); "
                                       "pass list(d.values())"),
                      ({10, 40}, "got a set (no order, equal counts merged); pass a list"),
                      ("10 40", "got a string; pass a list of integers"),
                      ([10, 2.5, True, np.float32(3)], "got 3 that are not: [2.5, True, "
                                                       "np.float32(3.0)]")):
        for call in (lambda b: est(args, trainer="sft", lengths=b),
                     lambda b: plan(trainer="sft", lengths=b)):
            with pytest.raises(mk.ConfigError) as ei:
                call(bad)
            assert "lengths must be the token counts of the dataset's rows" in str(ei.value)
            assert says in str(ei.value), str(ei.value)


def test_lengths_beside_seq_len_are_refused_by_estimate_and_plan_alike():
    require("trl")
    for call, source in ((lambda: est({**FP32, "max_length": None}, trainer="sft",
                                      lengths=[10, 20], seq_len=64), "estimate_memory"),
                         (lambda: plan(trainer="sft", lengths=[10, 20], seq_len=64),
                          "plan_training")):
        with pytest.raises(mk.ConfigError) as ei:
            call()
        assert ei.value.problems == [
            "lengths and seq_len=64 are both given: with lengths the longest row is the "
            "sequence length; leave seq_len out (--seq-len on the command line)"], source
    # the plain Trainer pads to the longest row: estimate_memory refused it silently before
    with pytest.raises(mk.ConfigError, match="lengths and seq_len=64 are both given"):
        est(FP32, lengths=[10, 20], seq_len=64)


def test_padding_free_with_a_max_length_is_refused_as_sft_trainer_refuses_it(tmp_path):
    trl = require("trl")
    from transformers import LlamaForCausalLM

    from hf_memkit._trainers import TRAINERS

    # TRL 1.16's SFTTrainer itself, on a real model and rows
    model = LlamaForCausalLM(TINY)
    rows = [{"input_ids": [1, 2, 3, 4]}] * 4
    cfg = dict(output_dir=str(tmp_path), use_cpu=True, report_to=[], bf16=False,
               padding_free=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match="`max_length` is not enforced"):
            TRAINERS.get("sft").build(model=model, args=trl.SFTConfig(**cfg, max_length=64),
                                      rows=rows, data_collator=None, processing_class=None,
                                      callbacks=[], oom_guard=False)
        TRAINERS.get("sft").build(model=model, args=trl.SFTConfig(**cfg, max_length=None),
                                  rows=rows, data_collator=None, processing_class=None,
                                  callbacks=[], oom_guard=False)
    says = ("padding_free=True without packing needs max_length=None, got max_length={}: "
            "SFTTrainer refuses it")
    with pytest.raises(mk.ConfigError, match=says.format(64)):
        est({**FP32, "padding_free": True, "max_length": 64}, trainer="sft")
    with pytest.raises(mk.ConfigError, match=says.format(1024)):  # SFTConfig's default
        est({**FP32, "padding_free": True}, seq_len=64, trainer="sft")
    with pytest.raises(mk.ConfigError, match=says.format(64) + r".*\(a plan's max_length is its "
                                                              r"seq_len unless pinned\)"):
        plan(seq_len=64, trainer="sft", padding_free=True)
    # what TRL runs is estimated and planned: max_length=None, or packing
    assert est({**FP32, "padding_free": True, "max_length": None}, seq_len=64,
               trainer="sft").setup.trainer.option("padding_free")
    assert est({**FP32, "padding_free": True, "packing": True, "max_length": 64},
               trainer="sft").setup.trainer.option("padding_free")
    ta = plan(seq_len=64, trainer="sft", padding_free=True, max_length=None).training_args_kwargs
    assert ta["padding_free"] is True and ta["max_length"] is None


def test_a_pad_token_id_outside_the_vocabulary_is_named():
    bad = LlamaConfig(**TINY_KW, pad_token_id=128)
    says = (r"pad_token_id=128 is outside the vocabulary \(vocab_size=128\): the embedding "
            r"cannot pad with it; set pad_token_id to a token id in \[0, 128\), e.g. the "
            r"eos_token_id 2, or None")
    for call in (lambda: mk.profile_model(bad),
                 lambda: mk.estimate_memory(bad, None, seq_len=8, device="cpu"),
                 lambda: mk.plan_training(bad, seq_len=8, target_batch_size=4, device="cpu")):
        with pytest.raises(mk.HfMemkitError, match=says):
            call()
    # -1 (old LLaMA conversions) is a valid padding index: built and estimated
    ok = LlamaConfig(**TINY_KW, pad_token_id=-1)
    assert mk.estimate_memory(ok, None, seq_len=8, device="cpu").peak_allocated > 0


@pytest.mark.parametrize("value, says", [
    (float("nan"), "max_memory=nan: memory size nan is not a finite number"),
    (float("inf"), "max_memory=inf: memory size inf is not a finite number"),
    (-5, "max_memory=-5: memory size -5 is negative"),
    (0, "max_memory=0 is a budget of 0 bytes, in which nothing fits; give the memory the run "
        "may use (bytes, or e.g. '20GiB'), or leave max_memory out to use the device's"),
    ("0GiB", "max_memory='0GiB' is a budget of 0 bytes"),
])
def test_max_memory_that_is_no_budget_is_named(value, says):
    for call in (lambda: est(None, seq_len=8, device="T4", max_memory=value),
                 lambda: plan(seq_len=8, device="T4", max_memory=value),
                 lambda: mk.max_batch_size(TINY, seq_len=8, device="T4", max_memory=value)):
        with pytest.raises(mk.ConfigError) as ei:
            call()
        assert says in str(ei.value)


def test_a_budget_too_small_names_max_memory_not_the_device():
    with pytest.raises(mk.HfMemkitError) as ei:
        plan(seq_len=8, device="T4", max_memory=1024)
    assert "max_memory=1024 allows 1.00 KiB; raise max_memory, or try a shorter seq_len" in \
        str(ei.value)
    assert "T4 has" not in str(ei.value)


def test_a_sequence_length_is_named_by_the_argument_it_came_from():
    require("trl")
    gpt = GPT2Config(n_embd=64, n_layer=2, n_head=2, vocab_size=128, n_positions=256)
    with pytest.raises(mk.HfMemkitError, match=r"^max_length 512 exceeds this model's learned "
                                               r"position embeddings \(256\); use max_length "
                                               r"<= 256$"):
        mk.estimate_memory(gpt, {**FP32, "max_length": 512}, trainer="sft", device="cpu")
    with pytest.raises(mk.HfMemkitError, match=r"^the longest row of lengths 300 exceeds"):
        mk.estimate_memory(gpt, FP32, lengths=[10, 300], device="cpu")
    with pytest.raises(mk.HfMemkitError, match=r"^seq_len 300 exceeds"):
        mk.estimate_memory(gpt, FP32, seq_len=300, device="cpu")
    for call in (lambda: est({"max_length": 10**30}, trainer="sft"),
                 lambda: plan(seq_len=64, trainer="sft", max_length=10**30)):
        with pytest.raises(mk.ConfigError, match=r"`max_length` must be a positive number of "
                                                 r"tokens \(at most 16777216\), or none"):
            call()
    # a length that would overflow deep in torch is refused by name
    with pytest.raises(mk.ConfigError, match=r"seq_len must be a positive integer \(at most "
                                             r"16777216 tokens\), got 10{26}"):
        est(None, seq_len=10**26)
