"""What ``auto_training_args`` hands back trains: two steps through ``transformers.Trainer`` on
CPU for a plain model as given, a PEFT model with its own adapters, and arguments applied onto the
user's own ``TrainingArguments`` subclass."""

from __future__ import annotations

import warnings

import torch
from transformers import AutoModelForCausalLM, Trainer

import hf_memkit as mk
from hf_memkit._run.synthetic import SyntheticTextDataset
from tests.helpers import require
from tests.unit.plan.test_user_path import (
    QUIET,
    SEQ,
    TARGET,
    TINY,
    MyArgs,
    _lora_only_budget,
    cpu,
)


def _train(model, args, steps=2):
    data = SyntheticTextDataset(vocab_size=TINY.vocab_size, seq_len=SEQ, num_samples=32)
    trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def test_auto_training_args_for_a_plain_model_trains_it_as_given(tmp_path):
    model = AutoModelForCausalLM.from_config(TINY, attn_implementation="eager")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = mk.auto_training_args(model, seq_len=SEQ, target_batch_size=TARGET,
                                     device=cpu(), output_dir=str(tmp_path), max_steps=2,
                                     **QUIET)
    assert args.per_device_train_batch_size * args.gradient_accumulation_steps == TARGET
    assert model.config._attn_implementation == "sdpa"  # the plan's kernel, set in place
    losses = _train(model, args)
    assert len(losses) == 2 and all(map(torch.isfinite, torch.tensor(losses)))


def test_auto_training_args_plans_a_peft_model_with_its_own_adapters(tmp_path):
    peft = require("peft")
    model = peft.get_peft_model(AutoModelForCausalLM.from_config(TINY),
                                peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # a budget the full fine-tune does not fit: the model's own LoRA does
        args = mk.auto_training_args(model, seq_len=SEQ, target_batch_size=TARGET,
                                     device=cpu(), max_memory=_lora_only_budget(),
                                     output_dir=str(tmp_path), max_steps=2, **QUIET)
        plan = mk.plan_training(model, seq_len=SEQ, target_batch_size=TARGET, device=cpu(),
                                max_memory=_lora_only_budget(), method="lora")
    # the plan estimates the adapters the model has (r=4 on q/v), not the planner's default
    assert plan.peft_config.r == 4
    assert [n for n, p in model.named_parameters() if p.requires_grad] == trainable
    # not wrapped a second time: one adapter on q and v of each of the 2 layers
    assert sum(n.endswith("lora_A.default") for n, _ in model.named_modules()) == 4
    assert len(_train(model, args)) == 2


def test_auto_training_args_applies_onto_base_args(tmp_path):
    model = AutoModelForCausalLM.from_config(TINY)
    base = MyArgs(output_dir=str(tmp_path), learning_rate=1e-3, use_cpu=True, max_steps=2,
                  **QUIET)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = mk.auto_training_args(model, base_args=base, seq_len=SEQ,
                                     target_batch_size=TARGET, device=cpu(), seed=11)
    assert type(args) is MyArgs
    assert (args.learning_rate, args.seed, args.max_steps) == (1e-3, 11, 2)
    assert args.per_device_train_batch_size * args.gradient_accumulation_steps == TARGET
    assert len(_train(model, args)) == 2
