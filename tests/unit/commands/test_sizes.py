"""Every size a user types is bounded, with a clear error before any trace (issue 47): a target
batch of 10**9 hung the planner, a config of 10**6 layers never answered, a micro-batch of
10**12 reached torch's storage overflow."""

from __future__ import annotations

import time

import pytest
from transformers import LlamaConfig

import hf_memkit as mk
from hf_memkit.commands.main import main

TINY = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=2, num_key_value_heads=1, vocab_size=128)


def refused(call, *words):
    t0 = time.process_time()
    with pytest.raises(mk.HfMemkitError) as err:
        call()
    assert time.process_time() - t0 < 5          # refused up front, not after a trace
    for w in words:
        assert w in str(err.value), (w, str(err.value))


@pytest.mark.parametrize("kw, words", [
    (dict(target_batch_size=10**9), ["target_batch_size must be at most 1048576", "1000000000"]),
    (dict(target_batch_size=8, micro_batch=10**12), ["micro_batch must be at most 1048576"]),
    (dict(target_batch_size=8, micro_batch="4"), ["micro_batch must be a positive integer",
                                                  "'4'"]),
    (dict(target_batch_size=8, num_gpus=10**7), ["num_gpus must be at most 131072"]),
    (dict(target_batch_size=8, per_device_train_batch_size=10**12),
     ["per_device_train_batch_size", "at most 1048576"]),
    (dict(target_batch_size=8, gradient_accumulation_steps=10**9),
     ["gradient_accumulation_steps", "at most 1048576"]),
])
def test_plan_training_bounds_what_it_is_asked(kw, words):
    refused(lambda: mk.plan_training(TINY, device="A100-80GB", seq_len=128, **kw), *words)


def test_estimate_memory_bounds_the_batch():
    refused(lambda: mk.estimate_memory(TINY, {"per_device_train_batch_size": 10**12},
                                       seq_len=128, device="A100-80GB"),
            "per_device_train_batch_size", "at most 1048576 = 2**20", "1000000000000")


@pytest.mark.parametrize("field", ["num_hidden_layers", "decoder_layers"])
def test_a_config_deeper_than_any_trained_model_is_refused(field):
    deep = LlamaConfig(**{**TINY.to_dict(), "num_hidden_layers": 10**6})
    if field == "decoder_layers":
        from transformers import BartConfig

        deep = BartConfig(d_model=16, encoder_layers=1, decoder_layers=10**6,
                          encoder_attention_heads=2, decoder_attention_heads=2,
                          encoder_ffn_dim=16, decoder_ffn_dim=16, vocab_size=64)
    refused(lambda: mk.estimate_memory(deep, seq_len=16, device="A100-80GB"),
            f"{field}=1000000 is more layers than hf_memkit plans", "at most 1024")


def test_the_cli_says_a_config_is_too_deep(tmp_path, capsys):
    LlamaConfig(**{**TINY.to_dict(), "num_hidden_layers": 10**6}).save_pretrained(tmp_path)
    code = main(["estimate", str(tmp_path), "--gpu", "A100-80GB", "--seq-len", "16",
                 "--no-cache"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert "num_hidden_layers=1000000 is more layers" in err


# -- what the bad-input bench found (bench/bad_input.py) ------------------------------------------

def test_a_negative_device_index_is_refused_not_read_as_this_machine():
    refused(lambda: mk.probe_device(index=-1), "CUDA device index -1", "integer >= 0")


def test_auto_training_args_checks_base_args_before_planning():
    refused(lambda: mk.auto_training_args(TINY, base_args="x", seq_len=64, target_batch_size=8,
                                          device="cpu"),
            "base_args: expected TrainingArguments", "str 'x'")


def test_a_config_transformers_cannot_build_is_bad_input(tmp_path, capsys):
    d = TINY.to_dict()
    d["hidden_size"] = -64
    bad = LlamaConfig(**d)
    refused(lambda: mk.estimate_memory(bad, seq_len=16, device="A100-80GB"),
            "transformers cannot build a `llama` model from this config",
            "negative dimension -64")


def test_a_config_json_that_is_a_fifo_says_so(tmp_path, capsys):
    import os

    os.mkfifo(tmp_path / "config.json")
    code = main(["estimate", str(tmp_path), "--gpu", "T4", "--seq-len", "16"])
    err = capsys.readouterr().err
    assert code == 2 and "is a FIFO (named pipe)" in err and "has no config.json" not in err


def test_batch_and_the_field_may_not_disagree(capsys):
    code = main(["estimate", "gpt2", "--gpu", "T4", "--seq-len", "16", "--batch", "2",
                 "per_device_train_batch_size=3", "--no-cache"])
    err = capsys.readouterr().err
    assert code == 2 and "--batch 2 and per_device_train_batch_size=3 name two batches" in err


def test_a_recipe_larger_than_any_recipe_is_not_read(tmp_path):
    from hf_memkit._recipe import bundled_recipes_dir, load_recipe

    text = (bundled_recipes_dir() / "tiny-llama" / "1m_full_cpu.yaml").read_text()
    (tmp_path / "huge.yaml").write_text(text + ("# " + "x" * 98 + "\n") * 20000)
    refused(lambda: load_recipe(tmp_path / "huge.yaml"), "is larger than 1 MiB")


def test_the_callbacks_check_their_arguments_when_made():
    refused(lambda: mk.MemoryCallback(estimate="garbage"), "estimate: expected a MemoryEstimate",
            "'garbage'")
    refused(lambda: mk.MemoryCallback(max_entries=-1), "max_entries", "got -1")
    refused(lambda: mk.MemoryCallback(plot="no"), "plot: expected True or False", "'no'")
    refused(lambda: mk.ThroughputCallback(device="A100-90GB"), "unknown GPU `A100-90GB`")
    mk.MemoryCallback(plot=False, max_entries=10)       # good arguments still build
    mk.ThroughputCallback(device="A100-80GB")


def test_cache_commands_say_when_the_cache_folder_is_a_file(tmp_path, monkeypatch, capsys):
    (tmp_path / "afile").write_text("x")
    monkeypatch.setenv("HF_MEMKIT_CACHE", str(tmp_path / "afile"))
    for command in ("clear", "info"):
        assert main(["cache", command]) == 2
        assert "is not a folder; point HF_MEMKIT_CACHE at a folder" in capsys.readouterr().err
    assert (tmp_path / "afile").read_text() == "x"
