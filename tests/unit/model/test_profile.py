"""profile_model on meta vs the same model built for real; bundled configs vs published counts."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSeq2SeqLM,
    AutoModelForSequenceClassification,
    BertConfig,
    GPT2Config,
    LlamaConfig,
    OpenAIGPTConfig,
    T5Config,
)

import hf_memkit as mk
from hf_memkit._model import list_models
from tests.helpers import require

TINY = {
    "llama-gqa-untied": (LlamaConfig(hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, vocab_size=500,
                                     tie_word_embeddings=False), AutoModelForCausalLM),
    "gpt2-tied": (GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=500, n_positions=128),
                  AutoModelForCausalLM),
    "bert-encoder-cls": (BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                    intermediate_size=128, vocab_size=500, num_labels=3),
                         AutoModelForSequenceClassification),
    "t5-encoder-decoder": (T5Config(d_model=64, d_ff=128, d_kv=16, num_heads=4, num_layers=2,
                                    vocab_size=500), AutoModelForSeq2SeqLM),
}


@pytest.mark.parametrize("key", sorted(TINY))
def test_meta_profile_matches_real_model(key):
    config, auto = TINY[key]
    real = auto.from_config(config)  # real weights on CPU: the independent count
    real_count = sum(p.numel() for p in real.parameters())
    real_bytes = sum(p.numel() * p.element_size() for p in real.parameters())
    prof = mk.profile_model(config, task={
        AutoModelForCausalLM: "causal-lm", AutoModelForSequenceClassification: "seq-cls",
        AutoModelForSeq2SeqLM: "seq2seq-lm"}[auto])
    assert prof.total_params == real_count
    assert prof.param_bytes == real_bytes
    assert prof.architecture == type(real).__name__
    # the profile of the real model agrees with the config-only profile
    from_real = mk.profile_model(real)
    assert from_real.total_params == prof.total_params
    assert from_real.trainable_params == real_count and from_real.frozen_params == 0


def test_architecture_facts():
    p = mk.profile_model(TINY["llama-gqa-untied"][0])
    assert (p.num_layers, p.hidden_size, p.num_attention_heads, p.num_key_value_heads) == (2, 64, 4, 2)
    assert p.is_gqa and not p.tie_word_embeddings and p.head_dim == 16
    assert p.intermediate_size == 160 and p.vocab_size == 500
    assert "sdpa" in p.attn_implementations and p.supports_gradient_checkpointing
    assert p.layer_classes == ("LlamaDecoderLayer",)
    g = mk.profile_model(TINY["gpt2-tied"][0])
    assert g.tie_word_embeddings and g.intermediate_size == 4 * 64 and not g.is_gqa
    t = mk.profile_model(TINY["t5-encoder-decoder"][0])
    assert t.is_encoder_decoder and t.num_layers == 4 and t.task == "seq2seq-lm"


def test_profile_never_allocates_weights():
    import psutil

    before = psutil.Process().memory_info().rss
    p = mk.profile_model("Llama-3.1-70B")
    after = psutil.Process().memory_info().rss
    assert p.param_bytes > 100 * 2**30           # 131 GiB of fp32 weights described ...
    assert after - before < 512 * 2**20          # ... with well under 512 MiB of RSS growth


def test_frozen_and_dtype_counts_on_loaded_model():
    config = TINY["llama-gqa-untied"][0]
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    for p in model.model.parameters():
        p.requires_grad_(False)
    prof = mk.profile_model(model)
    head = model.lm_head.weight.numel()
    assert prof.trainable_params == head and prof.frozen_params == prof.total_params - head
    assert prof.params_by_dtype == {"bfloat16": prof.total_params}
    assert prof.param_bytes == 2 * prof.total_params


def test_peft_model_profile():
    peft = require("peft")
    config = TINY["llama-gqa-untied"][0]
    model = AutoModelForCausalLM.from_config(config)
    base_count = sum(p.numel() for p in model.parameters())
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    prof = mk.profile_model(lora)
    # r=4 on q (64->64) and v (64->32) in 2 layers: (4*64 + 64*4) + (4*64 + 32*4) per layer
    expected_lora = 2 * ((4 * 64 + 64 * 4) + (4 * 64 + 32 * 4))
    assert prof.is_peft and prof.trainable_params == expected_lora
    assert prof.total_params == base_count + expected_lora


def test_model_without_checkpointing_support():
    cfg = OpenAIGPTConfig(n_embd=32, n_layer=1, n_head=2, vocab_size=100, n_positions=32)
    assert mk.profile_model(cfg).supports_gradient_checkpointing is False


# Published parameter counts (model cards / safetensors index "total_size" / papers).
PUBLISHED = {
    ("Llama-3.1-8B", None): 8_030_261_248,
    ("Llama-3.1-70B", None): 70_553_706_496,
    ("Llama-3.2-1B", None): 1_235_814_400,
    ("Llama-3.2-3B", None): 3_212_749_824,
    ("Llama-2-7b-hf", None): 6_738_415_616,
    ("Mistral-7B-v0.1", None): 7_241_732_096,
    ("Qwen2.5-7B", None): 7_615_616_512,
    ("Qwen3-8B", None): 8_190_735_360,
    ("Qwen3-4B", None): 4_022_468_096,
    ("gpt2", None): 124_439_808,
    ("gpt2-xl", None): 1_557_611_200,
    ("bert-base-uncased", "base"): 109_482_240,
    ("bert-large-uncased", "base"): 335_141_888,
    ("xlm-roberta-large", "base"): 559_890_432,
    ("t5-3b", None): 2_851_598_336,
    ("pythia-410m", None): 405_334_016,
    ("opt-350m", None): 331_196_416,
}


def test_every_bundled_config_has_a_published_count():
    assert {name for name, _ in PUBLISHED} == set(list_models())


@pytest.mark.parametrize("name,task", sorted(PUBLISHED, key=str))
def test_bundled_configs_match_published_counts(name, task):
    assert mk.profile_model(name, task=task).total_params == PUBLISHED[(name, task)]


def test_bert_large_classifier_matches_anchor():
    # anchor hf_perf_bert_large_weights_loaded (docs/anchors.md): 335,141,888 + 2,050 classifier
    p = mk.profile_model("bert-large-uncased", task="sequence-classification")
    assert p.total_params == 335_143_938


@pytest.mark.parametrize("name", ["llama-3.1-8b", "meta-llama/Llama-3.1-8B",
                                  "meta-llama/Meta-Llama-3.1-8B", "LLAMA-3.1-8B"])
def test_name_aliases(name):
    assert mk.profile_model(name).total_params == 8_030_261_248


def test_local_directory_with_config(tmp_path):
    TINY["gpt2-tied"][0].save_pretrained(tmp_path)
    assert mk.profile_model(str(tmp_path)).architecture == "GPT2LMHeadModel"
    assert mk.profile_model(tmp_path).total_params == mk.profile_model(TINY["gpt2-tied"][0]).total_params


def test_directory_without_config_json(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(mk.HfMemkitError, match="has no config.json"):
        mk.profile_model(str(tmp_path))


def test_unknown_model_name_suggests_and_lists():
    with pytest.raises(mk.HfMemkitError) as e:
        mk.profile_model("Lama-3.1-8B")
    msg = str(e.value)
    assert "`Lama-3.1-8B`" in msg and "did you mean `Llama-3.1-8B`" in msg
    assert "gpt2" in msg and "config.json" in msg


def test_unknown_model_size_is_not_suggested_as_another_size():
    with pytest.raises(mk.HfMemkitError) as e:
        mk.profile_model("Llama-3.1-9B")
    msg = str(e.value)
    assert "did you mean" not in msg and "`meta-llama/Llama-3.1-9B`" in msg


def test_unknown_task():
    with pytest.raises(mk.HfMemkitError, match="unknown task `summarise`.*causal-lm"):
        mk.profile_model("gpt2", task="summarise")


def test_task_transformers_cannot_build():
    with pytest.raises(mk.HfMemkitError, match="cannot build"):
        mk.profile_model("t5-3b", task="causal-lm")


def test_wrong_type():
    with pytest.raises(mk.HfMemkitError, match="got int"):
        mk.profile_model(42)


def test_bundled_files_are_valid_config_json():
    from importlib import resources

    for name in list_models():
        data = json.loads((resources.files("hf_memkit") / "model_configs" / f"{name}.json").read_text())
        cfg = AutoConfig.for_model(data.pop("model_type"), **data)
        assert cfg.architectures, name
