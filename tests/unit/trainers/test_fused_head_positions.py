"""TRL's fused head on CUDA scores only the labelled positions (``add_fused_lm_head``'s compact
branch, ``hidden_states[mask]``); hf_memkit traces that branch on fake tensors, where a boolean
selection has no size, through ``_trace.masked.MaskedSelect``. Checked against the same TRL code
run on real tensors with real labels (-100 on each row's prompt), measured by torch's
MemTracker; and ``completion_len`` as ``estimate_memory`` takes it."""

from __future__ import annotations

import warnings

import pytest

from tests.helpers import require

require("trl")

import torch  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402
from torch.distributed._tools.mem_tracker import MemTracker  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import hf_memkit as mk  # noqa: E402
from hf_memkit._errors import HfMemkitError  # noqa: E402
from hf_memkit._trace.masked import MaskedSelect  # noqa: E402
from hf_memkit._trainers.fused_head import labelled  # noqa: E402

SMALL = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                    num_attention_heads=4, num_key_value_heads=2, vocab_size=5000)
ROWS, SEQ, COMPLETION = 3, 96, 20


def _head_peak(model, batch) -> int:
    """Peak bytes of one forward + backward through TRL's head, on TRL's compact branch."""
    from trl.trainer import utils as tu

    mt = MemTracker()
    mt.track_external(model)
    use_triton, tu._use_triton = tu._use_triton, lambda device: True   # the CUDA branch
    try:
        with mt:
            model(**batch, fused_lm_head=True).loss.backward()
    finally:
        tu._use_triton = use_triton
    return int(mt.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"])


def _model():
    from trl.trainer.utils import add_fused_lm_head

    torch.manual_seed(0)
    # eager attention: CPU SDPA on real tensors takes another kernel than on fake ones (a fixed
    # offset that has nothing to do with the head)
    model = LlamaForCausalLM._from_config(SMALL, attn_implementation="eager")
    add_fused_lm_head(model)
    return model


def test_masked_select_on_fake_tensors_allocates_what_the_real_selection_does():
    real_model = _model()
    ids = torch.randint(0, SMALL.vocab_size, (ROWS, SEQ))
    labels = ids.clone()
    labels[:, :SEQ - COMPLETION] = -100          # the prompt: unlabelled
    real = _head_peak(real_model, {"input_ids": ids, "labels": labels})

    fm = FakeTensorMode()
    with fm:
        fake_model = _model()
        batch = {"input_ids": torch.zeros(ROWS, SEQ, dtype=torch.long),
                 "labels": torch.zeros(ROWS, SEQ, dtype=torch.long)}
    count = lambda shape: labelled({"completion_len": COMPLETION}, shape)  # noqa: E731
    with fm, MaskedSelect(count):
        fake = _head_peak(fake_model, batch)
    assert fake == real
    every = _head_peak(real_model, {"input_ids": ids, "labels": ids})
    assert every - real > ROWS * (SEQ - 1 - COMPLETION) * SMALL.vocab_size * 4  # fp32 CPU tile


def _est(args, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return mk.estimate_memory(SMALL, args, **kw)


def test_completion_len_shrinks_the_cuda_head_only():
    args = dict(per_device_train_batch_size=2, max_length=1024, completion_only_loss=True)
    every = _est(args, trainer="sft", device="A100-80GB")
    part = _est(args, trainer="sft", device="A100-80GB", completion_len=128)
    # at least the bf16 tile shrinks, from 2 x 1023 to 2 x 128 rows of the vocabulary
    tile_rows = 2 * 1023 - 2 * 128
    assert every.peak_allocated - part.peak_allocated >= tile_rows * SMALL.vocab_size * 2
    assert any("128 per row" in n for n in part.notes)
    assert any("without completion_len" in n for n in every.notes)
    cpu = [_est(args, trainer="sft", device="cpu", completion_len=c).peak_allocated
           for c in (None, 128)]
    assert cpu[0] == cpu[1]                      # a CPU scores every position


def test_completion_len_refused_where_every_token_is_labelled():
    with pytest.raises(HfMemkitError, match="completion_only_loss=False"):
        _est(dict(max_length=128, completion_only_loss=False), trainer="sft", device="cpu",
             completion_len=32)
    with pytest.raises(HfMemkitError, match="SFTTrainer and DPOTrainer"):
        _est(dict(per_device_train_batch_size=1), seq_len=128, device="cpu", completion_len=32)
    with pytest.raises(HfMemkitError, match="positive integer"):
        _est(dict(max_length=128), trainer="dpo", device="cpu", completion_len=0)
