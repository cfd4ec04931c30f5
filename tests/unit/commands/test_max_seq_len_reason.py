"""``hf-memkit estimate --max-seq-len`` says what its answer needs, the margin it holds back and
the budget it fits (with where the budget comes from), and, with ``--trainer sft``, why TRL's
SFTTrainer answers longer than the plain Trainer on the same arguments."""

from __future__ import annotations

import contextlib
import io
import json
import warnings

import pytest
from transformers import LlamaConfig

import hf_memkit as mk
from hf_memkit._units import GiB, format_bytes
from hf_memkit.commands.main import main

TINY = LlamaConfig(hidden_size=128, intermediate_size=344, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, vocab_size=2000,
                   tie_word_embeddings=False, attention_dropout=0.0,
                   max_position_embeddings=1 << 16)
BUDGET = "1.5GiB"
CLI = ["--gpu", "A100-80GB", "--seq-len", "8192", "--batch", "1", "--max-seq-len",
       "--max-memory", BUDGET, "--no-cache"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The model's folder, and the plain Trainer's --json answer."""
    folder = tmp_path_factory.mktemp("tiny")
    TINY.save_pretrained(folder)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["estimate", str(folder), *CLI, "--json"]) == 0
    return str(folder), json.loads(out.getvalue())


def _estimate(model: str, seq_len: int, **kw) -> mk.MemoryEstimate:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return mk.estimate_memory(model, {"per_device_train_batch_size": 1}, seq_len=seq_len,
                                  device="A100-80GB", max_memory=BUDGET, **kw)


def test_the_answer_says_its_need_margin_and_the_next_length(tiny, capsys):
    folder, d = tiny
    n = d["max_seq_len"]
    assert n % 64 == 0 and 64 <= n < 8192
    here, above = _estimate(folder, n), _estimate(folder, n + 64)
    # the answer is the boundary: its upper band fits 1.5 GiB, the next length's does not
    assert here.upper <= 1.5 * GiB < above.upper
    assert (d["needed"], d["margin"]) == (here.upper, here.margin) and here.margin > 0
    assert (d["next_len"], d["next_needed"]) == (n + 64, above.upper)
    assert d["budget"] == int(1.5 * GiB) and d["budget_basis"]

    assert main(["estimate", folder, *CLI]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith(f"longest seq_len that fits (multiples of 64 up to 8192): {n}; ")
    assert (f"it needs {format_bytes(here.upper)} with a margin of "
            f"{format_bytes(here.margin)} held back") in line
    assert f"of a {format_bytes(1.5 * GiB)} budget (max_memory" in line
    assert "\n" not in line   # the plain Trainer: no second line


def test_sft_says_why_its_answer_is_longer(tiny, capsys):
    folder, plain = tiny[0], tiny[1]["max_seq_len"]
    assert main(["estimate", folder, *CLI, "--trainer", "sft"]) == 0
    head, why = capsys.readouterr().out.strip().split("\n")
    sft = int(head.split(": ", 1)[1].split(";")[0])
    assert sft > plain   # what the second line explains
    # the reason the line gives, read from the setups the two trainers really get: SFTConfig
    # turns checkpointing on for the same arguments, TrainingArguments does not
    assert _estimate(folder, sft, trainer="sft").setup.checkpointing
    assert not _estimate(folder, 64).setup.checkpointing
    assert why.startswith("SFTTrainer: ") and "gradient checkpointing on" in why
    assert "fused head" in why
