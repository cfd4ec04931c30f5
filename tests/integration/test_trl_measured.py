"""TRL's SFTTrainer, DPOTrainer, GRPOTrainer and RLOOTrainer estimated as they run, checked
against real TRL runs measured independently (``hf_memkit.testing.groundtruth``, RSS method,
in a child process)."""

from __future__ import annotations

import warnings

import pytest

from tests.helpers import require

require("trl")

import hf_memkit as mk  # noqa: E402
from hf_memkit.testing.groundtruth import measure_trainer_peak  # noqa: E402
from tests.unit.trainers.test_sft_and_dpo import CFG, FP32, _est  # noqa: E402


def test_sft_estimate_matches_a_real_sft_trainer_run():
    args = dict(per_device_train_batch_size=2, max_length=256, **FP32)
    e = _est(args, trainer="sft")          # seq_len from max_length
    m = measure_trainer_peak({"config": CFG.to_dict(), "args": args, "seq_len": 256,
                              "trainer": "sft"})
    assert e.seq_len == 256
    assert abs(e.peak_allocated / m["peak"] - 1) < 0.01
    # the plain Trainer's estimate of the same step misses TRL's CPU tile temporaries
    plain = _est({k: v for k, v in args.items() if k != "max_length"}, seq_len=256)
    assert plain.peak_allocated < 0.8 * m["peak"]


def test_dpo_estimate_with_peft_reference_matches_a_real_dpo_trainer_run():
    import peft

    lora = dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    args = dict(per_device_train_batch_size=2, max_length=256, **FP32)
    e = _est(args, trainer="dpo", peft_config=peft.LoraConfig(**lora))
    m = measure_trainer_peak({"config": CFG.to_dict(), "args": args, "seq_len": 256,
                              "trainer": "dpo", "lora": lora})
    assert abs(e.peak_allocated / m["peak"] - 1) < 0.01


def test_sft_tile_buffer_wider_than_the_vocabulary_is_counted_whole():
    """TRL's CPU fused head allocates a [tokens, 32768] tile buffer and writes only
    [tokens, vocab] of it: with a 16000-entry vocabulary about half its pages are never written,
    so RSS missed them (the estimate was 5% over) while the tensor is allocated whole, as CUDA's
    allocator and torch's MemTracker count it. The ground truth now writes every allocation
    (``MALLOC_PERTURB_``); without it the run reads short by about those unwritten pages."""
    from transformers import Qwen2Config

    cfg = Qwen2Config(hidden_size=128, intermediate_size=352, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=16000,
                      tie_word_embeddings=True)
    args = dict(per_device_train_batch_size=2, max_length=256, gradient_checkpointing=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        e = mk.estimate_memory(cfg, args, device="cpu", trainer="sft")
    spec = {"config": cfg.to_dict(), "args": args, "seq_len": 256, "trainer": "sft"}
    m = measure_trainer_peak(spec)
    assert abs(e.peak_allocated / m["peak"] - 1) < 0.01
    rss_only = measure_trainer_peak({**spec, "touch_pages": False})
    tokens = 2 * 255                                   # labels shifted by one
    unwritten = tokens * (32768 - cfg.vocab_size) * 2  # bf16 tile columns past the vocabulary
    assert 0.8 * unwritten < m["peak"] - rss_only["peak"] < 1.1 * unwritten


def test_sft_trains_a_quantized_models_adapters_in_bf16_as_a_real_run_measures():
    """TRL's SFTTrainer casts a quantized model's trainable parameters to bf16 (its
    ``_is_quantized_model`` branch). Adapters large next to the base make the cast visible: the
    estimate with it lands on the measured QLoRA run, the same estimate with peft's fp32 adapters
    is far over."""
    import peft
    import torch
    from transformers import BitsAndBytesConfig, LlamaConfig

    from hf_memkit._trainers.base import TrlTrainerKind

    require("bitsandbytes")
    cfg = LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=2048,
                      tie_word_embeddings=False)
    lora = dict(r=128, lora_alpha=16, lora_dropout=0.0,
                target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                "down_proj"])
    quant = dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype="bfloat16")
    args = dict(per_device_train_batch_size=1, max_length=128, **FP32)

    def estimate():
        q = BitsAndBytesConfig(**{**quant, "bnb_4bit_compute_dtype": torch.bfloat16})
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return mk.estimate_memory(cfg, args, device="cpu", trainer="sft",
                                      peft_config=peft.LoraConfig(**lora), quantization_config=q)

    e = estimate()
    assert any("casts the trainable adapters to bfloat16" in n for n in e.notes)
    m = measure_trainer_peak({"config": cfg.to_dict(), "args": args, "seq_len": 128,
                              "trainer": "sft", "lora": lora, "quantization": quant})
    assert abs(e.peak_allocated / m["peak"] - 1) < 0.03
    with pytest.MonkeyPatch.context() as mp:   # the counterfactual: adapters left in fp32
        mp.setattr(TrlTrainerKind, "adapter_dtype", lambda self, **kw: None)
        fp32 = estimate()
    assert fp32.peak_allocated / m["peak"] - 1 > 0.10


def test_grpo_and_rloo_estimates_match_real_runs_that_generate():
    """GRPOTrainer (no reference, generation with the policy's generate) and RLOOTrainer (a
    reference copy loaded by TRL, old and reference log-probs scored) against real runs."""
    for kind, args in (("grpo", dict(per_device_train_batch_size=4, num_generations=4,
                                     max_completion_length=32, **FP32)),
                       ("rloo", dict(per_device_train_batch_size=4, max_completion_length=32,
                                     **FP32))):
        e = _est(args, trainer=kind, seq_len=64)
        assert {"generate (decode)", "forward", "backward"} <= set(e.phase_peaks)
        m = measure_trainer_peak({"config": CFG.to_dict(), "args": args, "seq_len": 64,
                                  "trainer": kind})
        assert abs(e.peak_allocated / m["peak"] - 1) < 0.03, (kind, e.peak_allocated, m)


@pytest.mark.parametrize("kind", ["grpo", "rloo"])
def test_an_estimate_given_the_longest_completion_matches_a_run_whose_completions_stop_early(kind):
    """Completions that end early, on EOS the policy emits: ``generation_kwargs`` hold EOS (id 1
    of the harness's tokenizer) back for 23 tokens (``min_new_tokens``: transformers'
    ``MinNewTokensLengthLogitsProcessor``) and then make it certain (``sequence_bias`` +100:
    ``SequenceBiasLogitsProcessor``), so every completion is 24 tokens, EOS included, of a
    ``max_completion_length`` of 128 (TRL logged completions/max_length 24, clipped_ratio 0 for
    this run). Prompts of 64, 40, 24 and 56 words. Given those lengths the estimate lands on the
    measured peak; at the cap it is far over."""
    gen = {"min_new_tokens": 23, "sequence_bias": [[[1], 100.0]]}
    args = dict(per_device_train_batch_size=4, max_completion_length=128, generation_kwargs=gen,
                **FP32, **({"num_generations": 4} if kind == "grpo" else {}))
    prompts = [64, 40, 24, 56]
    m = measure_trainer_peak({"config": CFG.to_dict(), "args": args, "seq_len": 64,
                              "trainer": kind, "prompt_lengths": prompts})
    e = _est(args, trainer=kind, lengths=prompts, completion_lengths=[24] * 16)
    assert abs(e.peak_allocated / m["peak"] - 1) < 0.03, (kind, e.peak_allocated, m)
    cap = _est(args, trainer=kind, lengths=prompts)
    assert cap.peak_allocated / m["peak"] - 1 > 0.5     # the cap: the safe bound, far above


def test_memory_callback_logs_grpo_generation_and_scoring(tmp_path):
    """On a real GRPOTrainer, MemoryCallback separates the generate and score phases from the
    forward and backward, each a peak no larger than the step's (num_iterations=2: the policy
    scores its old log-probs)."""
    from hf_memkit.callbacks import MemoryCallback
    from hf_memkit.testing.groundtruth_trl import make_trl_trainer
    from hf_memkit.testing.models import spec_model

    args = dict(per_device_train_batch_size=4, num_generations=4, max_completion_length=16,
                num_iterations=2, max_steps=2, logging_steps=1, use_cpu=True, report_to=[],
                save_strategy="no", output_dir=str(tmp_path / "out"), disable_tqdm=True, **FP32)
    spec = {"config": CFG.to_dict(), "trainer": "grpo", "seq_len": 32, "args": args}
    model = spec_model(spec, str(tmp_path))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = make_trl_trainer(spec, model, dict(args), 16, str(tmp_path),
                                   [MemoryCallback(plot=False)])
        trainer.train()
    logs = [h for h in trainer.state.log_history if "memory/peak_generate_gib" in h]
    assert logs, trainer.state.log_history[-1]
    last = logs[-1]
    for key in ("generate", "score", "forward", "backward"):
        assert 0 < last[f"memory/peak_{key}_gib"] <= last["memory/peak_allocated_gib"], key
