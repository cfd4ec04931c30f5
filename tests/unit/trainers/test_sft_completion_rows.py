"""Pre-tokenized SFT rows that carry a ``completion_mask`` (``hf-memkit train``'s rows, the GPU
harness's completion-only case): the mask reaches TRL, whose collator then labels the
completion alone when ``completion_only_loss=True`` and every token when it is False."""

from __future__ import annotations

from tests.helpers import require

require("trl")

import torch  # noqa: E402
import trl  # noqa: E402
from transformers import LlamaForCausalLM  # noqa: E402

from hf_memkit._trainers import TRAINERS  # noqa: E402
from hf_memkit._trainers.data import token_rows  # noqa: E402
from tests.unit.trainers.test_sft_and_dpo import CFG  # noqa: E402

PROMPT, COMPLETION = 12, 4


def _rows(n: int = 4) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    n_tok = PROMPT + COMPLETION
    return [{"input_ids": torch.randint(3, CFG.vocab_size, (n_tok,), generator=g),
             "completion_mask": (torch.arange(n_tok) >= PROMPT).long()} for _ in range(n)]


def _first_batch(tmp_path, completion_only: bool) -> dict:
    args = trl.SFTConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, max_length=64,
                         completion_only_loss=completion_only, report_to=[], use_cpu=True,
                         bf16=False, gradient_checkpointing=False)
    trainer = TRAINERS.get("sft").build(model=LlamaForCausalLM(CFG), args=args, rows=_rows(),
                                        data_collator=None, processing_class=None, callbacks=[],
                                        oom_guard=False)
    return next(iter(trainer.get_train_dataloader()))


def test_token_rows_keep_the_completion_mask_as_ints():
    rows = token_rows(_rows(1))
    assert rows[0]["completion_mask"] == [0] * PROMPT + [1] * COMPLETION
    assert all(isinstance(t, int) for t in rows[0]["input_ids"])
    assert token_rows([{"input_ids": [5, 6]}]) == [{"input_ids": [5, 6]}]


def test_trl_labels_only_the_completion_when_asked(tmp_path):
    batch = _first_batch(tmp_path / "only", True)
    labels, ids = batch["labels"], batch["input_ids"]
    assert labels.shape == (2, PROMPT + COMPLETION)
    assert (labels[:, :PROMPT] == -100).all()
    assert torch.equal(labels[:, PROMPT:], ids[:, PROMPT:])
    every = _first_batch(tmp_path / "all", False)["labels"]
    assert (every != -100).all()
