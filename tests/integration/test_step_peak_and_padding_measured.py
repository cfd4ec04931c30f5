"""Two estimates whose peak depends on a term no other measured test reaches (issue 45), each
checked against a real run measured independently (``hf_memkit.testing.groundtruth``, RSS
method, in a child process):

* a step whose peak is in the optimizer step: torch's foreach AdamW (``adamw_torch``) allocates
  its temporaries (``_foreach_*`` intermediates over every parameter) after the backward has
  freed the activations; with batch 1 x 64 of a model whose parameters (12 M, 200 MB at the
  peak) outweigh its activations they make the step the peak. The model is that large so the
  RSS method's noise (Python objects the Trainer makes during a step, up to about 1 MB) stays
  near 0.5% of the peak: on a 30 MB model it was 2-3%, more than the term under test;
* TRL's SFT collator padding to ``pad_to_multiple_of``: rows of 70 tokens padded to 128.
"""

from __future__ import annotations

import warnings

import pytest

from tests.helpers import require

require("trl")

from transformers import LlamaConfig  # noqa: E402

import hf_memkit as mk  # noqa: E402
from hf_memkit.testing.groundtruth import measure_trainer_peak  # noqa: E402
from tests.unit.trainers.test_sft_and_dpo import CFG, FP32, _est  # noqa: E402

STEP_PEAK = LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=3,
                        num_attention_heads=4, num_key_value_heads=2, vocab_size=16000,
                        tie_word_embeddings=False)


@pytest.mark.slow
def test_a_step_that_peaks_in_the_optimizer_step_matches_a_real_run():
    args = dict(per_device_train_batch_size=1, optim="adamw_torch")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        e = mk.estimate_memory(STEP_PEAK, args, seq_len=64, device="cpu")
    m = measure_trainer_peak({"config": STEP_PEAK.to_dict(), "task": "causal-lm", "args": args,
                              "seq_len": 64})["peak"]
    assert e.peak_phase == "optimizer step", e.phase_peaks
    # the run really peaks past the forward and backward: above what both hold by 5% or more
    assert m > 1.05 * max(e.phase_peaks["forward"], e.phase_peaks["backward"]), (m, e.phase_peaks)
    # measured here: +0.25% to +0.40% over three runs (the estimate is below the run)
    assert e.peak_allocated == pytest.approx(m, rel=0.015), (e.peak_allocated, m)


@pytest.mark.slow
def test_sft_pad_to_multiple_of_matches_a_real_sft_trainer_run():
    """Rows of 70 tokens (``groundtruth_trl``: ``input_ids`` only) padded by TRL's collator to a
    multiple of 128: the step runs on 128 positions, which the estimate must trace (traced at
    70, the estimate is 32% under: padding matters here)."""
    args = dict(per_device_train_batch_size=2, max_length=256, pad_to_multiple_of=128, **FP32)
    e = _est(args, trainer="sft", seq_len=70)
    m = measure_trainer_peak({"config": CFG.to_dict(), "args": args, "seq_len": 70,
                              "trainer": "sft"})["peak"]
    assert e.peak_allocated == pytest.approx(m, rel=0.03), (e.peak_allocated, m)
