"""TRL's GRPOTrainer and RLOOTrainer (issue 26): a step of phases (generate, score, train), the
generation batch TRL derives, the reference model, and a colocated vLLM as a tenant of the GPU.
The checks against real GRPO / RLOO runs measured independently are in
tests/integration/test_trl_measured.py and bench/estimator_trl.py."""

from __future__ import annotations

import warnings

import pytest

from tests.helpers import require

require("trl")

import torch  # noqa: E402
import trl  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM  # noqa: E402

import hf_memkit as mk  # noqa: E402
from hf_memkit._trainers.rl import grow_cache  # noqa: E402
from tests.unit.trainers.test_sft_and_dpo import CFG, FP32  # noqa: E402

RL = dict(per_device_train_batch_size=2, num_generations=2, max_completion_length=32, **FP32)
TRAIN_PHASES = {"forward", "backward", "optimizer step"}


def _est(args, *, trainer="grpo", seq_len=48, device="cpu", **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return mk.estimate_memory(kw.pop("model", CFG), args, seq_len=seq_len, device=device,
                                  trainer=trainer, **kw)


def test_a_grpo_step_is_generation_scoring_and_training():
    e = _est({**RL, "beta": 0.04})
    assert {"generate (prefill)", "generate (decode)", "score"} | TRAIN_PHASES <= \
        set(e.phase_peaks)
    assert e.phase_peaks[e.peak_phase] == max(e.phase_peaks.values())
    assert "phase: generate (decode)" in e.explain()


def test_scoring_runs_only_when_old_or_reference_log_probs_are_needed():
    # GRPO: old log-probs when the accumulation steps are not a multiple of
    # steps_per_generation x num_iterations (grpo_trainer.py); RLOO: always
    assert "score" not in _est(RL).phase_peaks                       # beta 0, aligned
    assert "score" in _est({**RL, "num_iterations": 2}).phase_peaks
    assert "score" in _est({**RL, "beta": 0.04}).phase_peaks
    assert "score" in _est({k: v for k, v in RL.items() if k != "num_generations"},
                           trainer="rloo").phase_peaks


@pytest.mark.parametrize("args,rows", [
    (dict(gradient_accumulation_steps=4), 4),                   # steps_per_generation = accum
    (dict(gradient_accumulation_steps=4, steps_per_generation=2), 2),
    (dict(generation_batch_size=6), 6),                          # 6 / (2 rows x 1 process) = 3
])
def test_the_generation_batch_is_the_one_grpoconfig_derives(args, rows):
    """A dict's unset generation_batch_size / steps_per_generation are derived from the user's
    batch and accumulation (GRPOConfig.__post_init__), not from a default config's."""
    base = dict(per_device_train_batch_size=1 if "generation_batch_size" not in args else 2,
                num_generations=2, max_completion_length=32, **FP32)
    e = _est({**base, **args})
    assert any(n.startswith(f"generation: {rows} rows") for n in e.notes), e.notes
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = trl.GRPOConfig(output_dir="unused", use_cpu=True, report_to=[],
                                **{**base, **args})
    assert _est(config).phase_peaks == e.phase_peaks    # the instance reads the same


def test_more_generation_rows_grow_the_generation_not_the_train_step():
    # 2 and 4 generation rows of 1-row micro-steps (TRL refuses 1 row: a group of
    # num_generations=2 completions would be split)
    two = _est({**RL, "per_device_train_batch_size": 1, "gradient_accumulation_steps": 2})
    four = _est({**RL, "per_device_train_batch_size": 1, "gradient_accumulation_steps": 4})
    # the train step changes only by the micro-batches the Trainer prefetches (a few KiB)
    assert abs(four.phase_peaks["forward"] - two.phase_peaks["forward"]) < 64 * 1024
    # 2 more rows of KV cache at prompt + completion - 1 tokens, fp32, 2 layers x 2 KV heads
    text = CFG.get_text_config()
    head = text.hidden_size // text.num_attention_heads
    cache_row = (48 + 32 - 1) * text.num_hidden_layers * 2 * text.num_key_value_heads * head * 4
    grown = four.phase_peaks["generate (decode)"] - two.phase_peaks["generate (decode)"]
    assert grown >= 2 * cache_row


def test_a_reference_copy_for_beta_and_none_for_peft():
    import peft

    plain, ref = _est(RL), _est({**RL, "beta": 0.04})
    weights = plain.breakdown["weights"]            # the policy's parameters and buffers
    assert weights >= mk.profile_model(CFG).param_bytes
    assert ref.breakdown["weights"] - weights == weights   # a frozen copy of them
    lora = peft.LoraConfig(r=8, target_modules=["q_proj"])
    assert _est({**RL, "beta": 0.04}, peft_config=lora).breakdown["weights"] == \
        _est(RL, peft_config=lora).breakdown["weights"]
    rloo = _est({k: v for k, v in RL.items() if k != "num_generations"}, trainer="rloo")
    assert rloo.breakdown["weights"] - plain.breakdown["weights"] == weights  # beta 0.05


@pytest.mark.parametrize("model_cls,config", [
    (LlamaForCausalLM, LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   vocab_size=100)),
    (MistralForCausalLM, MistralConfig(hidden_size=64, intermediate_size=128,
                                       num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, vocab_size=100,
                                       sliding_window=8)),
])
def test_grown_cache_is_the_cache_real_decoding_leaves(model_cls, config):
    """grow_cache (the trace's stand-in for decoding) against transformers decoding for real."""
    torch.manual_seed(0)
    model = model_cls(config).eval()
    prompt, steps = 12, 5
    ids = torch.randint(0, 100, (2, prompt))
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
        real = out.past_key_values
        grown = model(input_ids=ids, use_cache=True).past_key_values
        for _ in range(steps):
            out = model(input_ids=ids[:, :1], past_key_values=real, use_cache=True)
    grow_cache(grown, prompt + steps)
    assert [tuple(x.keys.shape) for x in grown.layers] == \
        [tuple(x.keys.shape) for x in real.layers]
    assert [tuple(x.values.shape) for x in grown.layers] == \
        [tuple(x.values.shape) for x in real.layers]
    assert grown.get_seq_length() == real.get_seq_length()


VLLM = dict(per_device_train_batch_size=4, gradient_accumulation_steps=2, num_generations=8,
            max_completion_length=256, use_vllm=True, vllm_max_model_length=1024, bf16=True,
            gradient_checkpointing=True)
SMALL = LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                    num_attention_heads=8, num_key_value_heads=8, vocab_size=32000)


def test_a_colocated_vllm_holds_its_share_of_the_gpu():
    dev = mk.get_device("H100-80GB")
    server = _est({**VLLM, "vllm_mode": "server"}, model=SMALL, device=dev, seq_len=128,
                  dtype=torch.bfloat16)
    colo = _est(VLLM, model=SMALL, device=dev, seq_len=128, dtype=torch.bfloat16)
    # server mode: vLLM is on other GPUs, and the policy does not generate on this one
    assert "vllm" not in server.breakdown and "generate (decode)" not in server.phase_peaks
    share = 0.3 * dev.total_memory                  # TRL's default vllm_gpu_memory_utilization
    # vLLM fills its share: weights, activations, graphs, and the KV cache from what is left
    assert 0.97 * share <= colo.breakdown["vllm"] <= share
    assert colo.device_used - server.device_used == colo.breakdown["vllm"]
    assert colo.fits is True and not colo.refusals


def test_sleep_mode_frees_the_engine_while_the_trainer_trains():
    dev = mk.get_device("H100-80GB")
    awake = _est(VLLM, model=SMALL, device=dev, seq_len=128, dtype=torch.bfloat16)
    asleep = _est({**VLLM, "vllm_enable_sleep_mode": True}, model=SMALL, device=dev,
                  seq_len=128, dtype=torch.bfloat16)
    assert asleep.device_used < awake.device_used


def test_vllm_that_cannot_start_beside_the_trainer_does_not_fit():
    """vLLM requests utilization x total at start-up and refuses when less is free (the policy
    is already on the GPU): fits is False whatever the budget, and the refusal says why."""
    e = _est({**VLLM, "vllm_gpu_memory_utilization": 0.99}, model=SMALL,
             device="H100-80GB", seq_len=128, dtype=torch.bfloat16)
    assert e.fits is False and e.refusals
    assert any("0.99" in r or "utilization" in r for r in e.refusals), e.refusals


def test_generation_under_zero3_gathers_the_whole_model():
    """TRL's unwrap_model_for_generation gathers every parameter under ZeRO-3
    (ds3_gather_for_generation=True): the generate phases hold the whole 16-bit model on each
    rank beside its shards; without the gather, DeepSpeed gathers module by module."""
    ds = {"zero_optimization": {"stage": 3}, "bf16": {"enabled": True}}
    args = {**RL, "bf16": True, "deepspeed": ds, "per_device_train_batch_size": 1}
    kw = dict(model=SMALL, device="A100-80GB", seq_len=64, num_gpus=2)
    whole = _est(args, **kw)
    parts = _est({**args, "ds3_gather_for_generation": False}, **kw)
    model_16bit = 2 * mk.profile_model(SMALL).total_params
    # the whole model instead of the modules DeepSpeed gathers one by one (its largest ones)
    assert whole.phase_peaks["generate (decode)"] > parts.phase_peaks["generate (decode)"]
    assert whole.phase_peaks["generate (decode)"] > model_16bit   # all of it, plus the shards
    assert whole.phase_peaks["forward"] == parts.phase_peaks["forward"]
    assert any("gathers the whole model" in n for n in whole.notes)
