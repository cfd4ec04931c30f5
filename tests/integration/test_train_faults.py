"""Faults of real runs on CPU, through the real ``transformers.Trainer`` and the real ``hf-memkit``
CLI: inexact CPU readings without MALLOC_MMAP_THRESHOLD_, Ctrl-C and SIGTERM during ``hf-memkit
train``, and a run whose model raises."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import hf_memkit as mk
from hf_memkit._device import probe as _device
from hf_memkit._device import rss as _rss
from tests.unit.device.test_faults import _warnings


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    """Each test sees the once-per-process warnings as if the process had just started."""
    monkeypatch.setattr(_device, "_WARNED", set())


# ----------------------------------------------------------------------------------------------
# CPU readings without MALLOC_MMAP_THRESHOLD_
# ----------------------------------------------------------------------------------------------


def _tiny_run(tmp_path, name):
    from transformers import LlamaForCausalLM, Trainer, TrainingArguments

    from hf_memkit._run.synthetic import SyntheticTextDataset, tiny_llama_config

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config(hidden_size=64, intermediate_size=128,
                                               num_hidden_layers=2, vocab_size=128))
    cb = mk.MemoryCallback(plot=False)
    args = TrainingArguments(output_dir=str(tmp_path / name), max_steps=2, logging_steps=1,
                             per_device_train_batch_size=2, report_to=[], use_cpu=True,
                             save_strategy="no", disable_tqdm=True, dataloader_num_workers=0)
    Trainer(model=model, args=args, callbacks=[cb],
            train_dataset=SyntheticTextDataset(vocab_size=128, seq_len=16, num_samples=4)).train()
    return cb.to_report()


def test_inexact_cpu_readings_warn_once_per_process(tmp_path, monkeypatch, caplog):
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    monkeypatch.setattr(_rss, "_mallopt_called", False)
    with caplog.at_level("WARNING", logger="hf_memkit"):
        first = _tiny_run(tmp_path, "a")
        _tiny_run(tmp_path, "b")                    # a second run in the same process: silent
    [msg] = _warnings(caplog, "MALLOC_MMAP_THRESHOLD_=65536")
    assert "read low" in msg and "hf-memkit train" in msg
    assert first["cpu_readings"] == {"malloc_mmap_threshold": None, "exact": False}
    assert first["status"]["state"] == "completed" and len(first["steps"]) == 2


def test_exact_cpu_readings_do_not_warn(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    with caplog.at_level("WARNING", logger="hf_memkit"):
        report = _tiny_run(tmp_path, "a")
    assert _warnings(caplog, "MALLOC_MMAP_THRESHOLD_") == []
    assert report["cpu_readings"] == {"malloc_mmap_threshold": "65536", "exact": True}


# ----------------------------------------------------------------------------------------------
# Ctrl-C during `hf-memkit train`, and a run whose model raises
# ----------------------------------------------------------------------------------------------


TINY_MODEL = """\
model:
  name: Llama-3.2-1B
  overrides: {hidden_size: 64, intermediate_size: 128, num_hidden_layers: 2,
              num_attention_heads: 2, num_key_value_heads: 1, head_dim: 32, vocab_size: 128,
              max_position_embeddings: 64, bos_token_id: 1, eos_token_id: 2,
              tie_word_embeddings: false}
data: {source: synthetic}
training: {seq_len: 16, target_batch_size: 4, method: full}
hardware: {device: cpu}
callbacks: [memory, throughput]
"""


def _cli() -> str:
    path = Path(sys.executable).parent / "hf-memkit"
    if not path.is_file():
        pytest.skip("the hf-memkit console script is not installed next to this Python")
    return str(path)


def _long_run_stopped_by(tmp_path: Path, sig: int) -> tuple[int, str, Path]:
    """``hf-memkit train`` of a long tiny run in a process of its own, sent ``sig`` once steps
    (and memory logs) exist: (exit code, stderr, output directory)."""
    recipe = tmp_path / "long.yaml"
    # a checkpoint every 3 steps tells the test that steps (and memory logs) exist
    recipe.write_text("# Run: hf-memkit train long.yaml\n" + TINY_MODEL + "pins: {max_steps: "
                      "5000, logging_steps: 1, save_strategy: steps, save_steps: 3, "
                      "save_total_limit: 1}\n")
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items()
           if k not in ("MALLOC_MMAP_THRESHOLD_", "HF_MEMKIT_REEXEC")}
    env.update(HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", TRANSFORMERS_VERBOSITY="error")
    with open(tmp_path / "stdout", "w") as so, open(tmp_path / "stderr", "w") as se:
        # SIGINT and SIGTERM at their defaults at exec, as in a shell (Python turns SIGINT
        # into KeyboardInterrupt; SIGTERM ends the process unless hf-memkit handles it)
        proc = subprocess.Popen([_cli(), "train", str(recipe), "--output-dir", str(out)],
                                stdout=so, stderr=se, env=env, cwd=tmp_path,
                                preexec_fn=lambda: [signal.signal(s, signal.SIG_DFL)
                                                    for s in (signal.SIGINT, signal.SIGTERM)])
        try:
            deadline = time.monotonic() + 300
            while not list(out.glob("checkpoint-*")):
                assert proc.poll() is None, (tmp_path / "stderr").read_text()[-3000:]
                assert time.monotonic() < deadline, "training did not start"
                time.sleep(0.2)
            proc.send_signal(sig)
            rc = proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
    return rc, (tmp_path / "stderr").read_text(), out


def _assert_kept(err: str, out: Path, head: str) -> dict:
    """The stopped run's last stderr line and the files it kept; its memory report."""
    assert "Traceback" not in err
    last = [line for line in err.splitlines() if line.strip()][-1]
    assert last.startswith(head) and str(out) in last, last
    assert "memory_report.json" in last and "the model" in last
    for name in ("model.safetensors", "config.json", "memory_report.json", "memory_timeline.png"):
        assert (out / name).is_file(), name
    report = json.loads((out / "memory_report.json").read_text())
    assert report["status"]["state"] == "interrupted" and report["status"]["step"] >= 3
    assert len(report["steps"]) >= 3
    # hf-memkit re-executed itself with the mmap threshold (same pid: the signal reached it)
    assert report["cpu_readings"] == {"malloc_mmap_threshold": "65536", "exact": True}
    return report


@pytest.mark.slow
def test_ctrl_c_saves_what_exists_and_exits_130(tmp_path):
    rc, err, out = _long_run_stopped_by(tmp_path, signal.SIGINT)
    assert rc == 130, err[-3000:]
    report = _assert_kept(err, out, "hf-memkit train: interrupted at step ")
    assert "signal" not in report["status"]


@pytest.mark.slow
def test_sigterm_saves_what_ctrl_c_saves_and_exits_143(tmp_path):
    """docker stop and batch schedulers send SIGTERM: the same files as Ctrl-C are kept, and
    the exit code is 128 + SIGTERM."""
    rc, err, out = _long_run_stopped_by(tmp_path, signal.SIGTERM)
    assert rc == 143, err[-3000:]
    report = _assert_kept(err, out, "hf-memkit train: terminated by SIGTERM at step ")
    assert report["status"]["signal"] == "SIGTERM"


def test_the_sigterm_handler_is_installed_for_training_only():
    """While training SIGTERM raises Terminated (a KeyboardInterrupt: Ctrl-C's path); before and
    after, the process's own handler is back; a handler someone else installed (the Trainer's
    enable_jit_checkpoint, the user's application) or SIGTERM ignored is left alone."""
    from hf_memkit._run.stop import Terminated, sigterm_as_interrupt

    runner = signal.signal(signal.SIGTERM, signal.SIG_DFL)   # as in `hf-memkit train`
    try:
        with pytest.raises(KeyboardInterrupt) as caught, sigterm_as_interrupt():
            assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)   # the handler raises at the next bytecode
        assert isinstance(caught.value, Terminated) and caught.value.signum == signal.SIGTERM
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        for theirs in (signal.SIG_IGN, lambda signum, frame: None):
            signal.signal(signal.SIGTERM, theirs)
            with sigterm_as_interrupt():
                assert signal.getsignal(signal.SIGTERM) is theirs
    finally:
        signal.signal(signal.SIGTERM, runner)


def _labelled_data_with_a_bad_label(tmp_path: Path) -> Path:
    """A local tokenizer and a JSON-lines file whose integer labels include -1: the loss raises
    IndexError in the real forward (data-dependent, so planning on fake tensors cannot see it)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    texts = [f"the {c} cat sat on mat {i}" for i, c in enumerate(["red", "big", "old"] * 4)]
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(texts, trainers.WordLevelTrainer(special_tokens=["[PAD]", "[UNK]"]))
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]",
                            unk_token="[UNK]").save_pretrained(tmp_path / "tok")
    (tmp_path / "train.jsonl").write_text("\n".join(
        json.dumps({"text": t, "label": -1}) for t in texts))
    recipe = tmp_path / "bad_labels.yaml"
    recipe.write_text("""# Run: hf-memkit train bad_labels.yaml
model:
  name: bert-base-uncased
  task: sequence-classification
  tokenizer: tok
  overrides: {hidden_size: 32, intermediate_size: 64, num_hidden_layers: 1,
              num_attention_heads: 2, vocab_size: 64, max_position_embeddings: 32, num_labels: 2}
data: {source: train.jsonl}
training: {seq_len: 16, target_batch_size: 4, method: full}
hardware: {device: cpu}
pins: {max_steps: 3, logging_steps: 1, save_strategy: "no"}
callbacks: [memory, throughput]
""")
    return recipe


def test_failed_run_keeps_error_report_and_model_and_exits_1(tmp_path, capsys):
    from hf_memkit.commands.main import main

    recipe = _labelled_data_with_a_bad_label(tmp_path)
    out = tmp_path / "out"
    rc = main(["train", str(recipe), "--output-dir", str(out)])
    err = capsys.readouterr().err
    assert rc == 1
    last = [line for line in err.splitlines() if line.strip()][-1]
    assert last.startswith(f"hf-memkit train: run failed: training {recipe} failed at step 0: "
                           "IndexError: Target -1 is out of bounds")
    assert "error.txt" in last and "memory_report.json" in last and str(out) in last
    assert "Traceback" not in err
    error = (out / "error.txt").read_text()
    assert error.startswith("hf-memkit: training (step 1) failed: IndexError: Target -1")
    assert "Traceback (most recent call last)" in error and "cross_entropy" in error
    report = json.loads((out / "memory_report.json").read_text())
    assert report["status"] == {"state": "failed", "step": 0,
                                "error": "IndexError: Target -1 is out of bounds."}
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
