"""Plans trained for real through ``transformers.Trainer`` on CPU: the tightest full plan under
its budget on a simulated device (``hf_memkit.testing.simulate``), the simulated budget really
failing when exceeded, and LoRA / QLoRA plans training."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, Trainer

import hf_memkit as mk
from hf_memkit._run.synthetic import SyntheticTextDataset
from hf_memkit._units import GiB
from hf_memkit.testing.simulate import SimulatedMemoryBudget
from tests.helpers import require
from tests.unit.plan.test_plan_training import SEQ, TINY, _full_need, plan


def _train_under_budget(p: mk.Plan, tmp_path, steps=2):
    model = AutoModelForCausalLM.from_config(TINY, **{k: v for k, v in p.model_kwargs.items()
                                                      if k == "attn_implementation"})
    model = p.prepare(model)
    args = p.to_training_args(output_dir=str(tmp_path), max_steps=steps, report_to=[],
                              save_strategy="no", logging_strategy="no", disable_tqdm=True,
                              dataloader_num_workers=0)
    data = SyntheticTextDataset(vocab_size=TINY.vocab_size, seq_len=SEQ, num_samples=64)
    trainer = Trainer(model=model, args=args, train_dataset=data)
    existing = [t for t in list(model.parameters()) + list(model.buffers())]
    with SimulatedMemoryBudget(p.budget, existing=existing) as sim:
        trainer.train()
    return sim, trainer


@pytest.mark.slow
def test_tightest_full_plan_runs_under_its_budget(tmp_path):
    # the smallest budget a full fine-tuning setup fits in: the simulated device must not OOM,
    # and the measured peak must stay below the budget
    budgets = [int(_full_need() * f) for f in (0.5, 0.35)]
    for budget in budgets:
        p = plan(max_memory=budget)
        sim, _ = _train_under_budget(p, tmp_path)
        assert sim.ooms == 0
        assert sim.peak <= p.budget, (sim.peak, p.budget, p.chosen.label())
        assert sim.peak == pytest.approx(p.chosen.peak_allocated, rel=0.05)


@pytest.mark.slow
def test_simulated_budget_really_fails_when_exceeded(tmp_path):
    p = plan(64 * GiB)
    with pytest.raises(torch.OutOfMemoryError, match="CUDA out of memory"):
        _train_under_budget(p.__class__.from_dict({**p.to_dict(),
                                                    "budget": int(p.chosen.peak_allocated * 0.7)}),
                            tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["lora", "qlora"])
def test_lora_and_qlora_plans_train_through_the_trainer(method, tmp_path):
    require("peft")
    if method == "qlora":
        require("bitsandbytes")
    p = plan(method=method)
    assert p.chosen.method == method and p.peft_config is not None
    if method == "qlora":
        assert p.model_kwargs["quantization_config"].load_in_4bit
        AutoModelForCausalLM.from_config(TINY).save_pretrained(tmp_path / "base")
        model = AutoModelForCausalLM.from_pretrained(tmp_path / "base", **p.model_kwargs)
    else:
        model = AutoModelForCausalLM.from_config(TINY)
    model = p.prepare(model)
    trainable = sum(x.numel() for x in model.parameters() if x.requires_grad)
    assert 0 < trainable < 0.2 * sum(x.numel() for x in model.parameters())
    args = p.to_training_args(output_dir=str(tmp_path / "out"), max_steps=2, report_to=[],
                              save_strategy="no", disable_tqdm=True, logging_steps=1)
    data = SyntheticTextDataset(vocab_size=TINY.vocab_size, seq_len=SEQ, num_samples=64)
    trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
