"""``hf-memkit train`` and ``hf-memkit demo`` end to end on CPU: a recipe planned, built and
trained for real through ``transformers.Trainer`` (the demo's tiny recipe, QLoRA reloading its
random init in 4 bit, JSON-lines data with a local tokenizer), and a run that fails exiting 1."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import hf_memkit as mk
from hf_memkit._recipe import bundled_recipes_dir, load_recipe
from hf_memkit.commands.main import main
from tests.unit.recipe.test_recipes import TINY, write


def test_demo_trains_the_tiny_recipe_and_reports_memory(tmp_path, capsys):
    """`hf-memkit demo` = `hf-memkit train` on the bundled tiny CPU recipe: plan, model, logs, PNG."""
    out_dir = tmp_path / "out"
    assert main(["demo", "--steps", "4", "--output-dir", str(out_dir)]) == 0
    text = capsys.readouterr().out
    assert "This machine" in text and "hf-memkit plan" in text and "predicted memory" in text
    assert "memory at each logging step" in text and "loss (first -> last log)" in text
    assert (out_dir / "model.safetensors").is_file()
    report = json.loads((out_dir / "memory_report.json").read_text())
    assert [s["step"] for s in report["steps"]] == [2, 4]      # logging_steps shortened to 2
    # the run allocates at least AdamW's state (2 x 4 B x params) beyond the weights
    assert report["summary"]["max_peak_allocated"] > 8 * 869_504
    assert ((out_dir / "memory_timeline.png").is_file()
            or not mk._compat.is_matplotlib_available())


def test_train_tiny_recipe_end_to_end(tmp_path):
    """The real command in a process of its own, as users run it: on CPU it re-executes itself
    with MALLOC_MMAP_THRESHOLD_ so its memory readings are exact (in this test process, the heap
    that earlier tests freed would be reused and RSS would read low)."""
    out_dir = tmp_path / "run"
    run = subprocess.run([sys.executable, "-m", "hf_memkit.commands.main", "train", TINY,
                          "--max-steps", "6", "--output-dir", str(out_dir), "--json",
                          "logging_steps=2"], capture_output=True, text=True, timeout=600,
                         env={k: v for k, v in os.environ.items()
                              if k not in ("MALLOC_MMAP_THRESHOLD_", "HF_MEMKIT_REEXEC")})
    assert run.returncode == 0, run.stderr[-2000:]
    res = json.loads(run.stdout)
    assert res["steps"] == 6 and res["device"] == "cpu"
    assert res["last_loss"] < res["first_loss"]                       # it learned
    assert (out_dir / "config.json").is_file() and (out_dir / "model.safetensors").is_file()
    report = json.loads(Path(res["memory_report"]).read_text())
    assert [s["step"] for s in report["steps"]] == [2, 4, 6]
    assert report["predicted_peak_allocated"] == res["predicted_peak_allocated"]
    # the plan's prediction vs the measured peak tensor memory of this real run
    assert 0.85 < res["measured_over_predicted"] < 1.2
    assert res["plan"]["setup"].startswith("full, fp32")
    if res["memory_plot"]:
        assert Path(res["memory_plot"]).read_bytes()[:4] == b"\x89PNG"
    else:
        from hf_memkit._compat import is_matplotlib_available

        assert not is_matplotlib_available()
    reloaded = mk.profile_model(str(out_dir))
    assert reloaded.total_params == 869_504


def test_train_qlora_on_cpu_reloads_the_random_init_4bit(tmp_path):
    """QLoRA: from_config rejects quantization_config, so the random init is saved and reloaded
    with it (bitsandbytes 4-bit runs on CPU); only the adapter trains and is saved."""
    from hf_memkit._run.train import train_recipe

    text = (bundled_recipes_dir() / "tiny-llama/1m_full_cpu.yaml").read_text()
    p = write(tmp_path, text.replace("method: full ", "method: qlora"), "tiny_qlora.yaml")
    res = train_recipe(load_recipe(p), output_dir=str(tmp_path / "q"), max_steps=2)
    assert res.plan.chosen.method == "qlora" and res.steps == 2
    cfg = json.loads((tmp_path / "q" / "adapter_config.json").read_text())
    # a random init of a bundled config has no base to reload: nothing recorded, so peft does
    # not look the bundled name up on the Hub when it saves (the socket guard would fail it)
    assert cfg["base_model_name_or_path"] in (None, "")
    assert not (tmp_path / "q" / "model.safetensors").exists()       # the adapter only


def _tiny_tokenizer(tmp_path: Path, texts: list[str]) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(texts, trainers.WordLevelTrainer(special_tokens=["[PAD]", "[UNK]"]))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]")
    d = tmp_path / "tok"
    fast.save_pretrained(d)
    return d


def test_train_from_a_jsonl_file_with_a_local_tokenizer(tmp_path):
    texts = [f"the {c} cat sat on the {m} mat number {i}" for i, (c, m) in
             enumerate([("red", "blue"), ("big", "small"), ("old", "new")] * 8)]
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in texts))
    _tiny_tokenizer(tmp_path, texts)
    recipe = write(tmp_path, """
model:
  name: Llama-3.2-1B
  tokenizer: tok
  overrides: {hidden_size: 64, intermediate_size: 128, num_hidden_layers: 2,
              num_attention_heads: 2, num_key_value_heads: 1, head_dim: 32, vocab_size: 64,
              max_position_embeddings: 64, bos_token_id: 0, eos_token_id: 0,
              tie_word_embeddings: false}
data: {source: train.jsonl}
training: {seq_len: 16, target_batch_size: 4, method: full}
hardware: {device: cpu}
pins: {max_steps: 3, logging_steps: 1, save_strategy: "no", learning_rate: 1.0e-3}
callbacks: [memory]
""")
    from hf_memkit._run.train import train_recipe

    res = train_recipe(load_recipe(recipe), output_dir=str(tmp_path / "out"))
    assert res.steps == 3 and res.first_loss is not None
    assert (tmp_path / "out" / "tokenizer.json").is_file()   # the tokenizer is saved with it
    assert len(res.timeline) == 3


def test_failed_run_exits_1(tmp_path, capsys):
    """A run that fails while training (torch's SGD rejects the momentum when the Trainer
    builds the optimizer) exits 1 with the cause on stderr."""
    assert main(["train", TINY, "--max-steps", "2", "--output-dir", str(tmp_path / "o"),
                 "--json", "optim=sgd", "optim_args=momentum=-1"]) == 1
    err = capsys.readouterr().err
    assert "run failed" in err and "Invalid momentum value: -1.0" in err


def test_a_run_reports_to_no_service_and_pushes_nothing_unless_told(tmp_path, monkeypatch):
    """The arguments the run really trained with (training_args.bin): report_to empty and no
    push, even inside a Kubeflow TrainJob (where transformers adds its reporter on its own);
    with report_to given, exactly those services (tensorboard writes under output_dir)."""
    import torch

    from hf_memkit._run.train import train_recipe

    monkeypatch.setenv("KUBEFLOW_TRAINER_SERVER_URL", "https://127.0.0.1:9/status")
    train_recipe(load_recipe(TINY), output_dir=str(tmp_path / "a"), max_steps=1)
    args = torch.load(tmp_path / "a" / "training_args.bin", weights_only=False)
    assert args.report_to == [] and args.push_to_hub is False
    train_recipe(load_recipe(TINY), output_dir=str(tmp_path / "b"), max_steps=1,
                 report_to=["tensorboard"])
    args = torch.load(tmp_path / "b" / "training_args.bin", weights_only=False)
    assert args.report_to == ["tensorboard"]
    assert list((tmp_path / "b").glob("runs/*/events.out.tfevents.*"))
