"""estimate_memory against an independent measurement: the RSS of a real Trainer run in a child
process (``hf_memkit.testing.groundtruth.measure_trainer_peak``)."""

from __future__ import annotations

import pytest
from transformers import BertConfig, GPT2Config

import hf_memkit as mk
from hf_memkit.testing.groundtruth import measure_trainer_peak
from tests.unit.estimate.test_estimate_memory import LLAMA

MEASURED = [
    ("llama-fp32-accum2-adamw", LLAMA, "causal-lm",
     dict(per_device_train_batch_size=2, gradient_accumulation_steps=2, optim="adamw_torch"), 256,
     None),
    ("gpt2-eager-bnb8bit", GPT2Config(n_embd=128, n_layer=3, n_head=4, vocab_size=4000,
                                      n_positions=256), "causal-lm",
     dict(per_device_train_batch_size=4, optim="adamw_bnb_8bit"), 256, "eager"),
    ("bert-cls-bf16-ckpt-adafactor", BertConfig(hidden_size=128, num_hidden_layers=3,
                                                num_attention_heads=4, intermediate_size=512,
                                                vocab_size=4000), "sequence-classification",
     dict(per_device_train_batch_size=8, optim="adafactor", bf16=True,
          gradient_checkpointing=True), 128, None),
]


@pytest.mark.slow
@pytest.mark.parametrize("name,config,task,args,seq,attn", MEASURED, ids=[m[0] for m in MEASURED])
def test_estimate_matches_measured_cpu_peak(name, config, task, args, seq, attn):
    predicted = mk.estimate_memory(config, args, seq_len=seq, device="cpu", task=task,
                                   attn_implementation=attn).peak_allocated
    measured = measure_trainer_peak({"config": config.to_dict(), "task": task, "args": args,
                                     "seq_len": seq, "attn_implementation": attn})["peak"]
    assert predicted == pytest.approx(measured, rel=0.03), (predicted, measured)
