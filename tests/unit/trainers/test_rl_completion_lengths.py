"""GRPO / RLOO given the completions' lengths (issue 44, item 5): ``completion_len`` (the longest
completion) or ``completion_lengths`` (their counts, a distribution) beside the prompts' ``seq_len``
/ ``lengths``.

Read from TRL 1.16 (``trl/trainer/grpo_trainer.py``): ``_generate_single_turn`` generates until
every row of the generation batch has emitted EOS (``generate``, ``max_new_tokens =
max_completion_length``); ``_generate_and_score_completions`` right-pads every completion of the
generation batch to the longest (``pad(completion_ids, ..., pad_to_multiple_of=...)``), and
``_prepare_inputs`` cuts that batch into micro-batches (``split_tensor_dict``), all as wide. So a
generation batch whose longest completion is ``c`` tokens is, tensor for tensor, the batch of a
config whose ``max_completion_length`` is ``c``: the checks below hold the estimate to that. The
measured check (a real GRPOTrainer whose completions stop early) is in
tests/integration/test_trl_measured.py.
"""

from __future__ import annotations

import warnings

import pytest

from tests.helpers import require

require("trl")

import hf_memkit as mk  # noqa: E402
from hf_memkit._errors import ConfigError  # noqa: E402
from tests.unit.trainers.test_sft_and_dpo import CFG, FP32  # noqa: E402

RL = dict(per_device_train_batch_size=2, num_generations=2, max_completion_length=64, **FP32)
PROMPTS = [48, 20, 33]


def _est(args, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return mk.estimate_memory(CFG, dict(args), device="cpu", trainer=kw.pop("trainer", "grpo"),
                                  **kw)


@pytest.mark.parametrize("trainer", ["grpo", "rloo"])
def test_a_longest_completion_below_the_cap_is_the_batch_a_config_capped_there_runs(trainer):
    args = RL if trainer == "grpo" else {k: v for k, v in RL.items() if k != "num_generations"}
    given = _est(args, trainer=trainer, lengths=PROMPTS, completion_len=16)
    capped = _est({**args, "max_completion_length": 16}, trainer=trainer, lengths=PROMPTS)
    at_cap = _est(args, trainer=trainer, lengths=PROMPTS)
    assert given.phase_peaks == capped.phase_peaks          # every phase: train, score, generate
    assert given.peak_allocated < at_cap.peak_allocated
    said = " ".join(given.notes)
    assert "estimated at 16, the longest completion given" in said
    assert "prompt + 16 tokens" in said                     # the last decode step's cache


def test_without_completion_lengths_the_estimate_says_it_took_the_cap():
    e = _est(RL, seq_len=48)
    assert any("estimated at 64, the cap" in n and "completion_lengths" in n for n in e.notes), \
        e.notes


def test_completion_lengths_stand_for_their_longest():
    spread = _est(RL, lengths=PROMPTS, completion_lengths=[3, 16, 9, 12])
    longest = _est(RL, lengths=PROMPTS, completion_len=16)
    assert spread.phase_peaks == longest.phase_peaks


def test_a_longest_completion_past_the_cap_stops_at_the_cap():
    past = _est(RL, seq_len=48, completion_len=500)
    assert past.phase_peaks == _est(RL, seq_len=48).phase_peaks
    assert any("completion_len=500 is past the cap" in n for n in past.notes)


def test_completions_are_padded_to_pad_to_multiple_of_as_trl_pads_them():
    """``pad(completion_ids, ..., pad_to_multiple_of=8)``: completions of at most 10 tokens are 16
    positions wide in the train step, as a config capped at 16 with no padding."""
    padded = _est({**RL, "pad_to_multiple_of": 8}, seq_len=48, completion_len=10)
    wide = _est({**RL, "max_completion_length": 16}, seq_len=48)
    for phase in ("forward", "backward"):
        assert padded.phase_peaks[phase] == wide.phase_peaks[phase], phase


def test_both_or_bad_completion_lengths_are_refused():
    with pytest.raises(ConfigError, match="both"):
        _est(RL, seq_len=48, completion_len=8, completion_lengths=[8])
    with pytest.raises(ConfigError, match="completion_lengths"):
        _est(RL, seq_len=48, completion_lengths=[])


def test_the_cli_reads_completion_lengths_from_a_file(tmp_path, capsys):
    import json

    from hf_memkit.commands.main import main

    CFG.save_pretrained(tmp_path / "model")
    f = tmp_path / "completions.txt"
    f.write_text("3\n16\n# a comment\n9\n")
    argv = ["estimate", str(tmp_path / "model"), "--gpu", "cpu", "--trainer", "grpo", "--seq-len",
            "48", "--batch", "2", "num_generations=2", "max_completion_length=64",
            "bf16=false", "gradient_checkpointing=false", "--json"]
    assert main([*argv, "--completion-lengths", str(f)]) == 0
    out = json.loads(capsys.readouterr().out)
    api = _est(RL, seq_len=48, completion_len=16)
    assert out["peak_allocated"] == api.peak_allocated
    f.write_text("3\nlots\n")
    assert main([*argv, "--completion-lengths", str(f)]) == 2
    assert "--completion-lengths" in capsys.readouterr().err
