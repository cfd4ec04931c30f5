"""estimate_memory: against hand-computed model states, the extrapolation against a full trace,
and bad input (against independent CPU measurements: tests/integration/test_estimate_measured.py)."""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    LlamaConfig,
    OpenAIGPTConfig,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

import hf_memkit as mk
from hf_memkit import _estimate
from hf_memkit._units import GiB, MiB
from tests.helpers import require

LLAMA = LlamaConfig(hidden_size=128, intermediate_size=344, num_hidden_layers=3, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=4000, tie_word_embeddings=False)


def est(model=LLAMA, args=None, **kw):
    kw.setdefault("seq_len", 128)
    kw.setdefault("device", "cpu")
    return mk.estimate_memory(model, args or {}, **kw)


# --- model states by hand ----------------------------------------------------------------------

def _n_params(config) -> int:
    return mk.profile_model(config).total_params


def test_fp32_adamw_model_states_by_hand():
    real = AutoModelForCausalLM.from_config(LLAMA)
    n = sum(p.numel() for p in real.parameters())
    buffers = sum(b.numel() * b.element_size() for b in real.buffers())   # rotary inv_freq
    n_tensors = sum(1 for _ in real.parameters())
    e = est(args=dict(optim="adamw_torch_fused"))
    assert e.breakdown["weights"] == 4 * n + buffers
    assert e.breakdown["optimizer"] == 8 * n + 4 * n_tensors


def test_pure_bf16_halves_states():
    n = _n_params(LLAMA)
    real = AutoModelForCausalLM.from_config(LLAMA)
    buffers = sum(b.numel() * b.element_size() for b in real.buffers())
    n_tensors = sum(1 for _ in real.parameters())
    e = est(args=dict(optim="adamw_torch_fused", gradient_accumulation_steps=2),
            dtype=torch.bfloat16)
    assert e.breakdown["weights"] == 2 * n + buffers
    assert e.breakdown["gradients"] == 2 * n                     # bf16 grads, alive when accumulating
    assert e.breakdown["optimizer"] == 4 * n + 4 * n_tensors     # bf16 moments + fp32 steps


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (None entries skipped)."""
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in tensors if isinstance(t, torch.Tensor)}.values())


class _StatesAtStep(TrainerCallback):
    """What a real Trainer step holds right after ``optimizer.step()``, before ``zero_grad``:
    the bytes of the model's parameters and buffers, of their ``.grad`` and of every tensor in
    ``optimizer.state``."""

    def __init__(self):
        self.steps = []

    def on_optimizer_step(self, args, state, control, model=None, optimizer=None, **kw):
        self.steps.append(dict(
            weights=_storage_bytes([*model.parameters(), *model.buffers()]),
            gradients=_storage_bytes(p.grad for p in model.parameters()),
            optimizer=_storage_bytes(v for s in optimizer.state.values() for v in s.values())))


@pytest.mark.slow
@pytest.mark.parametrize("args", [dict(), dict(gradient_accumulation_steps=4),
                                  dict(bf16=True, optim="adafactor"),
                                  dict(per_device_train_batch_size=1, optim="sgd")],
                         ids=["adamw", "accumulating", "adafactor", "sgd"])
def test_breakdown_model_states_match_a_real_trainer_step(args, tmp_path):
    """The breakdown's weights, gradients and optimizer state against the tensors a real CPU
    Trainer holds after two real optimizer steps (AdamW's moments and step counters, Adafactor's
    factored rows and columns, plain SGD's nothing). Gradients are a term of their own only when
    they outlive the step (accumulation): at GA=1 the peak is in backward, where the breakdown
    counts the gradients made so far with that phase's live bytes."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LLAMA)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ta = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, max_steps=2, report_to=[],
                               save_strategy="no", disable_tqdm=True, learning_rate=1e-4,
                               dataloader_num_workers=0, **args)
    e = est(args=ta)
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, LLAMA.vocab_size, (128,), generator=g)
           for _ in range(2 * ta.per_device_train_batch_size * ta.gradient_accumulation_steps)]
    measured = _StatesAtStep()
    Trainer(model=model, args=ta, train_dataset=[{"input_ids": i, "labels": i} for i in ids],
            callbacks=[measured]).train()
    assert len(measured.steps) == 2 and measured.steps[0] == measured.steps[1]
    got = measured.steps[-1]
    assert e.breakdown["weights"] == got["weights"]
    assert e.breakdown["optimizer"] == got["optimizer"]
    accumulating = ta.gradient_accumulation_steps > 1
    assert e.breakdown["gradients"] == (got["gradients"] if accumulating else 0)
    # the remainder the breakdown calls temporaries is never negative: the terms above fit
    # within the peak
    assert e.breakdown["temporaries"] >= 0


def test_accumulation_keeps_gradients_alive():
    one = est(args=dict(per_device_train_batch_size=4, gradient_accumulation_steps=1))
    four = est(args=dict(per_device_train_batch_size=4, gradient_accumulation_steps=4))
    assert four.peak_phase in ("forward (accumulating)", "backward (accumulating)")
    assert four.breakdown["gradients"] == 4 * _n_params(LLAMA)
    assert four.peak_allocated > one.peak_allocated


def test_checkpointing_cuts_activations_and_new_name_wins():
    off = est(args=dict(per_device_train_batch_size=8), seq_len=256)
    on = est(args=dict(per_device_train_batch_size=8, activation_checkpointing=True), seq_len=256)
    assert on.breakdown["activations"] < 0.6 * off.breakdown["activations"]
    # both names set -> the new one wins, silently
    # (docs/stack-facts.md#checkpointing-field-names)
    mixed = est(args=dict(per_device_train_batch_size=8, activation_checkpointing=False,
                          gradient_checkpointing=True), seq_len=256)
    assert mixed.peak_allocated == off.peak_allocated
    old = est(args=dict(per_device_train_batch_size=8, gradient_checkpointing=True), seq_len=256)
    assert old.peak_allocated == on.peak_allocated


def test_training_arguments_and_dict_agree(tmp_path):
    d = dict(per_device_train_batch_size=2, gradient_accumulation_steps=2, optim="adamw_torch",
             gradient_checkpointing=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ta = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, **d)
    assert est(args=ta).peak_allocated == est(args=d).peak_allocated


def test_loaded_model_meta_model_and_config_agree():
    from_config = est()
    real = AutoModelForCausalLM.from_config(LLAMA)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(LLAMA)
    assert est(real).peak_allocated == from_config.peak_allocated
    assert est(meta).peak_allocated == from_config.peak_allocated


def test_extrapolation_matches_full_trace_of_24_layers(monkeypatch):
    cfg = LlamaConfig(hidden_size=128, intermediate_size=344, num_hidden_layers=24,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=2000)
    for args in (dict(per_device_train_batch_size=2), dict(per_device_train_batch_size=2,
                                                            gradient_checkpointing=True, bf16=True)):
        extrapolated = est(cfg, args, seq_len=256)
        assert extrapolated.traced_layers == (2, 3)
        monkeypatch.setattr(_estimate.activations, "FULL_TRACE_MAX_LAYERS", 100)
        full = est(cfg, args, seq_len=256)
        monkeypatch.undo()
        assert full.traced_layers == (24,)
        assert extrapolated.peak_allocated == pytest.approx(full.peak_allocated, rel=0.01)
        assert extrapolated.breakdown["activations"] == pytest.approx(
            full.breakdown["activations"], rel=0.01)


def test_eval_stage_is_forward_only_with_states_resident():
    train = est(args=dict(per_device_train_batch_size=4, per_device_eval_batch_size=4))
    ev = est(args=dict(per_device_train_batch_size=4, per_device_eval_batch_size=4), stage="eval")
    big_eval = est(args=dict(per_device_eval_batch_size=64), stage="eval")
    assert ev.peak_phase == "eval forward" and ev.stage == "eval"
    assert ev.breakdown["gradients"] == 0 and ev.breakdown["optimizer"] == train.breakdown["optimizer"]
    assert ev.peak_allocated < train.peak_allocated < big_eval.peak_allocated


def test_lora_and_qlora_states_by_hand():
    peft = require("peft")
    from transformers import BitsAndBytesConfig

    lora_cfg = peft.LoraConfig(r=8, target_modules=["q_proj", "v_proj"])
    args = dict(per_device_train_batch_size=2, gradient_accumulation_steps=2)
    full = est(args=args)
    lora = est(args=args, peft_config=lora_cfg)
    qlora = est(args=args, peft_config=lora_cfg,
                quantization_config=BitsAndBytesConfig(load_in_4bit=True,
                                                       bnb_4bit_compute_dtype=torch.bfloat16))
    # r=8 adapters on q (128->128) and v (128->64) in 3 layers, fp32
    adapters = 3 * (8 * 128 + 128 * 8 + 8 * 128 + 64 * 8)
    assert lora.breakdown["weights"] - full.breakdown["weights"] == 4 * adapters
    assert lora.breakdown["gradients"] == 4 * adapters          # only adapters get gradients
    assert lora.breakdown["optimizer"] == 8 * adapters + 4 * 12  # AdamW moments + 12 step scalars
    # NF4 base: 0.5 B per linear weight + one fp32 absmax per 64; the rest fp32
    # (prepare_model_for_kbit_training), the head (untied lm_head) is not quantized.
    linear = 3 * (128 * 128 + 128 * 64 + 128 * 64 + 128 * 128 + 3 * 128 * 344)
    other = full.breakdown["weights"] - 4 * linear
    assert qlora.breakdown["weights"] == linear // 2 + 4 * (linear // 64) + other + 4 * adapters
    assert qlora.peak_allocated < lora.peak_allocated < full.peak_allocated


def test_cuda_band_is_two_sigma_of_the_documented_terms_by_hand(clean_cuda_env):
    """The band of a small model's step on an A100 (CUDA 13, lazy module loading, one rank),
    worked by hand from the sigmas hf_memkit/_cuda/runtime.py documents: the CUDA context's
    1 sigma is 100 MiB (``context_sigma``); the allocator's 35% of the fragmentation; the traced
    bytes' hypot(0.5%, 5%) (CPU residuals, CUDA emulation: bf16 autocast acts). Combined as
    independent errors the half-width is 2 sqrt(sum of squares): here the context's 200 MiB,
    plus at most 0.24 MiB from the small terms (summed linearly instead: about 213 MiB). On a
    CPU the half-width is 2 x 0.5% of the peak (``traced_cpu_sigma``)."""
    e = est(args=dict(bf16=True, per_device_train_batch_size=4), device="A100-80GB",
            cuda_version="13.0")
    assert e.breakdown["context"] == 764 * MiB  # CUDA 13, lazy loading (runtime.py)
    lo, hi = e.band
    assert (lo + hi) / 2 == pytest.approx(e.device_used, abs=1)  # centred (int rounding)
    small = (0.35 * e.breakdown["fragmentation"]) ** 2 + (
        0.0502 * (e.breakdown["activations"] + e.breakdown["temporaries"])) ** 2
    # sqrt(a^2 + small) <= a + small / 2a
    assert 2 * 100 * MiB <= (hi - lo) / 2 <= 2 * (100 * MiB + small / (200 * MiB)) + 1
    assert "device used" in e.explain()
    cpu = est(args=dict(bf16=True, per_device_train_batch_size=4))
    assert cpu.band == pytest.approx((0.99 * cpu.peak_allocated, 1.01 * cpu.peak_allocated),
                                     abs=2)


def test_70b_plan_is_traced_on_a_few_layers():
    e = mk.estimate_memory("Llama-3.1-70B", dict(bf16=True, per_device_train_batch_size=1,
                                                 gradient_checkpointing=True,
                                                 optim="adamw_torch_fused"),
                           seq_len=4096, device="H100-80GB")
    assert e.traced_layers == (2, 3)
    n = 70_553_706_496
    assert e.breakdown["weights"] == pytest.approx(4 * n, rel=0.001)
    assert e.device_used > 16 * n  # weights + grads + AdamW fp32: far beyond one GPU
    assert e.device_used > 1000 * GiB


def test_unmodelled_settings_warn():
    with pytest.warns(UserWarning, match="torch_compile"):
        e = est(args=dict(torch_compile=True))
    assert any("torch_compile" in n for n in e.notes)


# --- bad input ---------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,match", [
    (dict(seq_len=0), "seq_len must be a positive integer"),
    (dict(seq_len=-5), "seq_len must be a positive integer"),
    (dict(stage="predict"), "stage must be one of 'train', 'eval', 'forward_backward'"),
])
def test_bad_call_arguments(kwargs, match):
    with pytest.raises(mk.HfMemkitError, match=match):
        est(**kwargs)


def test_bad_args_are_reported_together():
    with pytest.raises(mk.ConfigError) as e:
        est(args=dict(per_device_train_batch_size=0, optim="adamw_fast", gradient_acumulation_steps=2))
    msg = str(e.value)
    assert "3 problem(s)" in msg
    assert "per_device_train_batch_size" in msg and "got 0" in msg
    assert "`adamw_fast`" in msg and "adamw_torch" in msg
    assert "did you mean `gradient_accumulation_steps`" in msg


def test_model_without_checkpointing_support():
    cfg = OpenAIGPTConfig(n_embd=64, n_layer=2, n_head=4, vocab_size=500, n_positions=128)
    assert est(cfg, dict(gradient_checkpointing=False)).peak_allocated > 0
    with pytest.raises(mk.HfMemkitError, match="does not support gradient checkpointing"):
        est(cfg, dict(gradient_checkpointing=True))


def test_model_type_transformers_cannot_build():
    with pytest.raises(mk.HfMemkitError, match="cannot build"):
        est("t5-3b", task="causal-lm")


def test_unknown_device_and_model():
    with pytest.raises(mk.HfMemkitError, match="unknown GPU"):
        est(device="X9000")
    with pytest.raises(mk.HfMemkitError, match="unknown model"):
        est("not-a-model")


def test_quantized_base_without_adapter():
    from transformers import BitsAndBytesConfig

    with pytest.raises(mk.HfMemkitError, match="peft_config"):
        est(quantization_config=BitsAndBytesConfig(load_in_4bit=True))


def test_seq_len_beyond_learned_positions():
    gpt2 = GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=500, n_positions=128)
    with pytest.raises(mk.HfMemkitError, match=r"exceeds .* learned position.*<= 128"):
        est(gpt2, seq_len=256)
    assert est(LLAMA, seq_len=4096, args=dict(per_device_train_batch_size=1)).peak_allocated > 0


def test_band_counts_the_cuda_emulation_only_where_it_acts():
    """The traced term's CUDA share is the emulation's (autocast, SDPA kernels, fused dropout):
    an eager, unmixed step without dropout runs on CUDA the ops the CPU trace measured, so its
    margin is the small floor; any of the three brings the emulation's sigma back."""
    import dataclasses

    from hf_memkit._cuda.runtime import CALIBRATION
    from hf_memkit._estimate import device

    def on_cuda(config=LLAMA, args=None, attn="eager"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return est(config, args or {}, device="A100-80GB", attn_implementation=attn)

    said = "runs differently on CUDA"
    plain = on_cuda()
    assert any(said in n for n in plain.notes)
    dropout = LlamaConfig(**{**LLAMA.to_dict(), "attention_dropout": 0.1})
    for e in (on_cuda(dropout), on_cuda(attn="sdpa"), on_cuda(args={"bf16": True})):
        assert not any(said in n for n in e.notes)
    # the same step's margin with the emulation's sigma instead of the floor
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(device, "CALIBRATION", dataclasses.replace(
            CALIBRATION, traced_cuda_floor_sigma=CALIBRATION.traced_cuda_sigma))
        full = on_cuda()
    traced = plain.margin_terms["activations (traced)"]
    assert traced < full.margin_terms["activations (traced)"]
    assert plain.required == full.required and plain.margin < full.margin
