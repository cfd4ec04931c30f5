"""plan_training / auto_training_args: choices per GPU, the ladder under shrinking budgets,
overrides, round trips, impossible budgets and bad input. Plans run for real under a simulated
budget and LoRA/QLoRA plans trained: tests/integration/test_plans_train.py."""

from __future__ import annotations

import json
import warnings

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig, OpenAIGPTConfig

import hf_memkit as mk
from hf_memkit._device.catalog import catalog
from hf_memkit._units import GiB, MiB
from tests.helpers import require

TINY = LlamaConfig(hidden_size=128, intermediate_size=344, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, vocab_size=2000,
                   tie_word_embeddings=False, attention_dropout=0.0)
SEQ, TARGET = 128, 16


def cpu(total: int):
    return mk.get_device("cpu").replace(total_memory=total, free_memory=total)


def plan(total=None, **kw):
    kw.setdefault("seq_len", SEQ)
    kw.setdefault("target_batch_size", TARGET)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return mk.plan_training(TINY, device=kw.pop("device", None) or cpu(total or 8 * GiB), **kw)


@pytest.mark.parametrize("name", sorted(catalog()))
def test_precision_choice_per_catalog_gpu(name):
    spec = catalog()[name]
    if spec.vendor == "apple":  # MPS: no allocator model, no plan (the estimate is a floor)
        with pytest.raises(mk.HfMemkitError, match="MPS .* cannot promise that a plan"):
            mk.plan_training("gpt2", seq_len=256, target_batch_size=8, device=name)
        return
    p = mk.plan_training("gpt2", seq_len=256, target_batch_size=8, device=name)
    ta = p.training_args_kwargs
    if spec.vendor == "amd":  # ROCm: bf16; transformers' TF32 switch is CUDA's only
        assert ta["bf16"] and not ta.get("tf32") and not ta["fp16"]
    elif spec.compute_capability >= (8, 0):
        assert ta["bf16"] and ta["tf32"] and not ta["fp16"]
    else:  # Volta and Turing: fp16 AMP with loss scaling, no TF32
        assert ta["fp16"] and not ta["bf16"] and "tf32" not in ta
    assert ta["per_device_train_batch_size"] * ta["gradient_accumulation_steps"] == 8


def test_cpu_plan_is_fp32_and_uses_cpu():
    ta = plan().training_args_kwargs
    assert not ta["bf16"] and not ta["fp16"] and ta["use_cpu"]
    assert ta["dataloader_pin_memory"] is False


def test_ample_memory_enables_no_speed_costing_saver():
    p = plan(64 * GiB)
    c = p.chosen
    assert (c.method, c.checkpointing, c.optim) == ("full", False, "adamw_torch_fused")
    assert c.micro_batch == TARGET and c.grad_accum == 1


def _full_need(**kw) -> int:
    return mk.estimate_memory(TINY, dict(per_device_train_batch_size=TARGET,
                                         optim="adamw_torch_fused", **kw),
                              seq_len=SEQ, device="cpu").device_used


def test_ladder_climbs_as_memory_shrinks():
    need = _full_need()
    roomy = plan(max_memory=need + 1 * MiB).chosen
    tighter = plan(max_memory=int(need * 0.6)).chosen
    assert roomy.micro_batch == TARGET and not roomy.checkpointing
    assert tighter.micro_batch < TARGET or tighter.checkpointing or tighter.optim != \
        "adamw_torch_fused"
    assert tighter.device_used <= int(need * 0.6)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fraction=st.floats(min_value=0.25, max_value=1.5), target=st.sampled_from([4, 6, 16]))
def test_property_plan_fits_and_keeps_effective_batch(fraction, target):
    # no early return on a refusal: a quarter of the full setup's need still holds the fp32
    # AdamW states of this model with a micro-batch of 2 (planned at 0.25 for 4, 6 and 16:
    # checkpointing 4 x 1, 3 x 2, micro-batch 2 x 8), so every budget drawn here has a plan
    budget = int(_full_need() * fraction)
    p = plan(max_memory=budget, target_batch_size=target)
    c = p.chosen
    assert c.device_used <= budget == p.budget
    assert c.micro_batch * c.grad_accum * p.num_gpus == target
    assert target % c.micro_batch == 0


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(vocab=st.sampled_from([64, 2000]), pad=st.one_of(st.none(), st.integers(-3, 2100)),
       max_memory=st.sampled_from([None, 0, -1, float("nan"), float("inf"), "0GiB",
                                   8 * GiB]))
def test_property_bad_token_ids_and_budgets_are_named_never_crash(vocab, pad, max_memory):
    """Issue 28: a pad_token_id >= the vocabulary crashed 4 of 50 random planner cases deep in
    torch (nn.Embedding); a budget of nan, inf, a negative or 0 raised raw errors or blamed the
    device. Every case is a plan or an HfMemkitError naming the bad value."""
    cfg = LlamaConfig(**{**TINY.to_diff_dict(), "vocab_size": vocab, "pad_token_id": pad})
    bad_pad = pad is not None and not -vocab <= pad < vocab
    bad_budget = max_memory is not None and not (isinstance(max_memory, int) and max_memory > 0)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            p = mk.plan_training(cfg, seq_len=SEQ, target_batch_size=4, device=cpu(8 * GiB),
                                 max_memory=max_memory)
    except mk.HfMemkitError as exc:
        msg = str(exc)
        assert bad_pad or bad_budget, msg
        if bad_budget:  # checked first, with the other arguments
            assert f"max_memory={max_memory!r}" in msg, msg
        else:
            assert f"pad_token_id={pad} is outside the vocabulary (vocab_size={vocab})" in msg
        return
    assert not bad_pad and not bad_budget
    assert p.chosen.micro_batch * p.chosen.grad_accum == 4


def test_auto_fallback_to_lora_only_when_no_full_setup_fits():
    require("peft")
    states = mk.profile_model(TINY).total_params * 4 * 3  # fp32 weights + grads + one moment
    p = plan(max_memory=int(states * 0.9))
    assert p.chosen.method in ("lora", "qlora")
    assert any("falling back to the LoRA family" in n for n in p.notes)


def test_overrides_are_honoured_and_warn_when_they_do_not_fit(tmp_path):
    p = plan(max_memory=int(_full_need() * 0.5))
    args = p.to_training_args(output_dir=str(tmp_path), learning_rate=1e-5)
    assert args.learning_rate == 1e-5
    assert args.per_device_train_batch_size == p.chosen.micro_batch
    with pytest.warns(UserWarning, match="over the budget"):
        big = p.to_training_args(output_dir=str(tmp_path), per_device_train_batch_size=TARGET,
                                 gradient_accumulation_steps=1)
    assert big.per_device_train_batch_size == TARGET


def test_plan_round_trips_through_json():
    p = plan(max_memory=int(_full_need() * 0.5))
    again = mk.Plan.from_json(p.to_json())
    assert again.to_dict() == p.to_dict()
    assert again.chosen.label() == p.chosen.label()
    assert again.estimate.device_used == p.estimate.device_used
    json.loads(p.to_json())  # plain JSON


def test_plans_are_deterministic():
    a, b = plan(max_memory=int(_full_need() * 0.5)), plan(max_memory=int(_full_need() * 0.5))
    assert a.to_dict() == b.to_dict()


def test_impossible_budget_names_smallest_setup():
    with pytest.raises(mk.HfMemkitError) as e:
        plan(max_memory="1MiB")
    msg = str(e.value)
    assert "needs at least" in msg and "micro-batch 1" in msg
    assert "max_memory='1MiB' allows 1.00 MiB; raise max_memory" in msg  # the value, not the device
    assert "shorter seq_len" in msg


def test_model_without_checkpointing_support_is_planned_without_it():
    cfg = OpenAIGPTConfig(n_embd=64, n_layer=2, n_head=4, vocab_size=500, n_positions=128)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        need = mk.estimate_memory(cfg, dict(per_device_train_batch_size=8), seq_len=128,
                                  device="cpu").device_used
        p = mk.plan_training(cfg, seq_len=128, target_batch_size=8, max_memory=int(need * 0.7),
                             device="cpu", method="full")
    assert not any(c.checkpointing for c in p.candidates)
    assert any("does not support gradient checkpointing" in n for n in p.notes)


def test_bad_input_is_reported_together():
    with pytest.raises(mk.ConfigError) as e:
        mk.plan_training(TINY, seq_len=0, target_batch_size=10, num_gpus=4, method="dora",
                         device="A100-80GB")
    msg = str(e.value)
    assert "method `dora`" in msg and "seq_len" in msg
    assert "not divisible by 4 ranks; nearest valid targets: 8, 12" in msg


def test_more_gpus_than_exist(fake_cuda):
    from tests.helpers import A100_80

    fake_cuda([A100_80])
    with pytest.raises(mk.ConfigError, match="num_gpus=2 but this machine shows 1 GPU"):
        mk.plan_training(TINY, seq_len=SEQ, target_batch_size=8, num_gpus=2)


def test_max_memory_string_and_headroom():
    assert plan(max_memory="3GiB").budget == 3 * GiB
    assert plan(10 * GiB, headroom=0.2).budget == 8 * GiB


def test_reverse_queries_are_monotone_and_fit():
    dev = cpu(2 * GiB)
    args = dict(optim="adamw_torch_fused")
    b = mk.max_batch_size(TINY, args, seq_len=SEQ, device=dev, headroom=0.0)
    assert b >= 1
    # the upper band (centre + margin) is what must fit
    fits = mk.estimate_memory(TINY, dict(args, per_device_train_batch_size=b), seq_len=SEQ,
                              device=dev).upper
    over = mk.estimate_memory(TINY, dict(args, per_device_train_batch_size=b + 1), seq_len=SEQ,
                              device=dev).upper
    assert fits <= 2 * GiB < over
    s = mk.max_seq_len(TINY, dict(args, per_device_train_batch_size=4), device=dev, headroom=0.0,
                       limit=1 << 16)
    assert s % 64 == 0 and s >= 64


def test_auto_training_args(tmp_path):
    args = mk.auto_training_args(TINY, seq_len=SEQ, target_batch_size=TARGET,
                                 device=cpu(64 * GiB), output_dir=str(tmp_path))
    assert args.per_device_train_batch_size * args.gradient_accumulation_steps == TARGET
    assert args.output_dir == str(tmp_path)


def test_explain_mentions_choice_and_rejections():
    text = plan(max_memory=int(_full_need() * 0.5)).explain()
    assert "CHOSEN" in text and "budget" in text and "attention" in text


@pytest.mark.slow
def test_lora_ladder_reaches_the_8bit_base_before_giving_up():
    require("peft")
    require("bitsandbytes")
    start = plan(method="lora", max_memory=64 * GiB)
    assert start.chosen.method == "lora"
    # the smallest LoRA (full-precision base) setup, then budgets just below it
    need = min(c.device_used for c in start.candidates if c.method == "lora" and c.estimate)
    lora_min = mk.estimate_memory(TINY, dict(per_device_train_batch_size=1,
                                             gradient_accumulation_steps=TARGET,
                                             activation_checkpointing=True, optim="adafactor"),
                                  seq_len=SEQ, device="cpu",
                                  peft_config=start.peft_config).device_used
    assert lora_min <= need
    p = plan(method="lora", max_memory=lora_min - 1)
    assert p.chosen.method == "lora-8bit"
    assert p.model_kwargs["quantization_config"].load_in_8bit
    assert p.chosen.device_used < lora_min


def test_the_users_optimizer_is_kept_whenever_a_setup_with_it_fits():
    """The optimizer is part of the recipe: with room, TrainingArguments' default (fused AdamW)
    is planned even where another optimizer would reach a larger micro-batch; where no setup
    with it fits, another one is chosen with a warning, a note and its own rung in the ladder,
    and the setup without that rung really does not fit."""
    room = 30 * MiB
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        warnings.filterwarnings("error", message="no .* setup with")  # no optimizer warning
        roomy = mk.plan_training(TINY, seq_len=SEQ, target_batch_size=TARGET, device=cpu(room),
                                 max_memory=room, method="full")
    assert roomy.chosen.optim == "adamw_torch_fused"
    assert not any("instead of" in r["rung"] for r in roomy.ladder)
    # Adafactor without checkpointing would be faster, and fits: it is still not chosen
    faster = min((c for c in roomy.candidates if c.optim == "adafactor" and not c.checkpointing
                  and c.micro_batch == roomy.chosen.micro_batch), key=lambda c: c.rel_time)
    assert faster.rel_time < 1.0
    args = dict(roomy.training_args_kwargs, optim="adafactor", gradient_checkpointing=False)
    assert mk.estimate_memory(TINY, args, device=cpu(room), seq_len=SEQ).upper <= room

    budget = 12 * MiB
    with pytest.warns(UserWarning, match="no full setup with adamw_torch_fused .* fits"):
        tight = mk.plan_training(TINY, seq_len=SEQ, target_batch_size=TARGET, device=cpu(budget),
                                 max_memory=budget, method="full")
    assert tight.chosen.optim != "adamw_torch_fused"
    assert any(f"uses {tight.chosen.optim} instead" in n for n in tight.notes)
    row = next(r for r in tight.ladder if r["rung"].startswith(f"{tight.chosen.optim} instead"))
    assert row["must_fit"] <= budget < row["must_fit"] + row["saved"]
    # an independent estimate of the chosen setup with fused AdamW: over the budget
    args = dict(tight.training_args_kwargs, optim="adamw_torch_fused")
    again = mk.estimate_memory(TINY, args, device=cpu(budget), seq_len=SEQ)
    assert again.upper > budget


def test_one_precision_rule_for_plans_estimates_and_recipes(tmp_path):
    """bf16 on a T4 runs (torch emulates it and TrainingArguments accepts it): plan, estimate
    and recipe all warn with one message and none refuses; tf32 on a T4 (TrainingArguments
    raises) and fp16 on a CPU are refused by plans and recipes alike."""
    from hf_memkit._recipe import load_recipe

    said = "no bf16 tensor cores before compute capability 8.0"
    with pytest.warns(UserWarning, match=said):
        p = mk.plan_training("gpt2", seq_len=128, target_batch_size=8, device="T4",
                             bf16=True)
    assert p.training_args_kwargs["bf16"] and any(said in n for n in p.notes)
    with pytest.warns(UserWarning, match=said):
        est = mk.estimate_memory("gpt2", {"bf16": True, "per_device_train_batch_size": 8},
                                 seq_len=128, device="T4")
    assert any(said in n for n in est.notes)
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model: gpt2\ntraining: {seq_len: 8, target_batch_size: 8}\n"
                      "hardware: {device: T4}\npins: {bf16: true}\n")
    with pytest.warns(UserWarning, match=f"pins.bf16: .*{said}"):
        load_recipe(recipe)

    for device, pin, fragment in (("T4", "tf32", "TrainingArguments\\(tf32=True\\) raises"),
                                  ("cpu", "fp16", "fp16=True on a CPU")):
        with pytest.raises(mk.HfMemkitError, match=fragment):
            mk.plan_training("gpt2", seq_len=128, target_batch_size=8, device=device,
                             **{pin: True})
        recipe.write_text(f"model: gpt2\ntraining: {{seq_len: 8, target_batch_size: 8}}\n"
                          f"hardware: {{device: {device}}}\npins: {{{pin}: true}}\n")
        with pytest.raises(mk.HfMemkitError, match=f"pins.{pin}: .*{fragment}"):
            load_recipe(recipe)


def test_a_sequence_past_the_positions_is_refused_or_warned_as_transformers_would(tmp_path):
    """A learned position table (GPT-2's 1024) cannot index further: refused. Rotary positions
    (Llama) run past max_position_embeddings: plan and estimate warn and say so in their notes."""
    rope = LlamaConfig(**{**TINY.to_diff_dict(), "max_position_embeddings": 256})
    said = "past this model's max_position_embeddings \\(256\\)"
    with pytest.warns(UserWarning, match=said):
        est = mk.estimate_memory(rope, {"per_device_train_batch_size": 1}, seq_len=512,
                                 device="cpu")
    assert any("max_position_embeddings (256)" in n for n in est.notes)
    with pytest.warns(UserWarning, match=said):
        p = mk.plan_training(rope, seq_len=512, target_batch_size=2, device=cpu(8 * GiB))
    assert any("max_position_embeddings (256)" in n for n in p.notes)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*max_position_embeddings")
        mk.estimate_memory(rope, {"per_device_train_batch_size": 1}, seq_len=256, device="cpu")
    from hf_memkit._recipe import load_recipe

    recipe = tmp_path / "r.yaml"
    recipe.write_text("model: {name: Llama-3.2-1B, overrides: {max_position_embeddings: 256}}\n"
                      "training: {seq_len: 512, target_batch_size: 2}\n")
    with pytest.warns(UserWarning, match=f"training.seq_len: seq_len 512 is {said}"):
        load_recipe(recipe)
    for call in (lambda: mk.estimate_memory("gpt2", None, seq_len=2048, device="cpu"),
                 lambda: mk.plan_training("gpt2", seq_len=2048, target_batch_size=2,
                                          device=cpu(8 * GiB))):
        with pytest.raises(mk.HfMemkitError, match="learned position embeddings \\(1024\\)"):
            call()


def test_setups_of_methods_the_ladder_never_reached_say_why():
    """Where LoRA fits, the 8-bit and 4-bit methods after it in the ladder are never estimated;
    their rows say so (they said only "not estimated")."""
    cfg = LlamaConfig(hidden_size=1024, intermediate_size=2752, num_hidden_layers=8,
                      num_attention_heads=8, num_key_value_heads=8, vocab_size=8000)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p = mk.plan_training(cfg, seq_len=128, target_batch_size=8, device="A100-80GB",
                             max_memory=int(1.5 * GiB))
    assert p.chosen.method == "lora"
    later = [c for c in p.candidates if c.method in ("lora-8bit", "qlora", "fsdp-qlora")]
    assert later and all(c.estimate is None for c in later)
    assert {c.reason for c in later} == {
        "not needed: a lora setup fits (earlier in the method ladder)"}
