"""A plan's verdict is its chosen setup's own: `estimate_memory` of the plan's arguments, judged
against the plan's budget, says the same word, for every trainer (GRPO beside a colocated vLLM
included); a plan with colocated vLLM sets what vLLM needs to start; with nothing fitting with
its margin the plan takes a setup that fits at the centre and says `tight`."""

from __future__ import annotations

import warnings

import pytest
from transformers import LlamaConfig

import hf_memkit as mk
from tests.helpers import require

TINY = LlamaConfig(hidden_size=128, intermediate_size=344, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=4, vocab_size=1024)
# positions like today's long-context models: vLLM sizes one request at them when unset
LONG = LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                   num_attention_heads=8, num_key_value_heads=8, vocab_size=32000,
                   max_position_embeddings=131072)


def _quiet(fn, *a, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*a, **kw)


def _agrees(plan) -> None:
    again = _quiet(plan.estimate_again)
    assert again.budget == plan.budget
    assert again.verdict == plan.verdict, (again.explain(), plan.explain())
    assert again.fits is True and not again.refusals


@pytest.mark.parametrize("trainer, extra", [
    (None, {}),
    ("sft", {}),
    ("dpo", {}),
])
def test_the_chosen_setup_passes_its_own_estimate(trainer, extra):
    if trainer is not None:
        require("trl")
    plan = _quiet(mk.plan_training, TINY, seq_len=128, target_batch_size=8, device="T4",
                  trainer=trainer, **extra)
    assert plan.verdict == "fits"
    _agrees(plan)


def test_a_grpo_plan_beside_vllm_starts_and_passes_its_own_estimate():
    """vllm_max_model_length unset, vLLM would size one request at 131,072 positions and refuse
    to start; the plan sets it to prompt + completion and its estimate agrees."""
    require("trl")
    plan = _quiet(mk.plan_training, LONG, seq_len=512, target_batch_size=8, device="RTX-4090",
                  trainer="grpo", use_vllm=True, max_completion_length=256, num_generations=8)
    assert plan.training_args_kwargs["vllm_max_model_length"] == 512 + 256
    assert any("vllm_max_model_length=768" in n for n in plan.notes)
    assert not plan.estimate.refusals and plan.verdict == "fits"
    _agrees(plan)
    # the same run with vLLM's length left to the model: vLLM refuses to start
    unset = {k: v for k, v in plan.training_args_kwargs.items() if k != "vllm_max_model_length"}
    est = _quiet(mk.estimate_memory, LONG, unset, seq_len=512, device="RTX-4090",
                 trainer="grpo", max_memory=plan.budget)
    assert est.refusals and est.verdict == "does not fit" and est.fits is False


def test_with_no_setup_fitting_with_its_margin_the_plan_is_tight():
    pins = dict(per_device_train_batch_size=2, gradient_checkpointing=False, optim="adamw_torch",
                method="full")
    free = _quiet(mk.plan_training, TINY, seq_len=128, target_batch_size=2, device="T4", **pins)
    est = free.estimate_again()
    between = est.required + (est.upper - est.required) // 2
    plan = _quiet(mk.plan_training, TINY, seq_len=128, target_batch_size=2, device="T4",
                  max_memory=between, **pins)
    assert plan.verdict == "tight" and plan.estimate.verdict == "tight"
    assert any(n.startswith("tight:") and "expandable_segments:True" in n for n in plan.notes)
    assert "tight" in plan.explain() and "verdict='tight'" in repr(plan)
    _agrees(plan)
    with pytest.raises(mk.HfMemkitError, match="needs at least"):
        _quiet(mk.plan_training, TINY, seq_len=128, target_batch_size=2, device="T4",
               max_memory=est.required - 1, **pins)


MID = LlamaConfig(hidden_size=512, intermediate_size=1376, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=8, vocab_size=32000)
MID_ARGS = dict(per_device_train_batch_size=4, gradient_checkpointing=False,
                optim="adamw_torch", bf16=True)


def test_a_setup_that_misses_by_fragmentation_gets_expandable_segments(monkeypatch):
    """The expandable-segments rung comes before any slower setup: at a budget between the
    step's need with expandable segments and without, the plan keeps the setup, sets the
    variable (plan.env, its launch lines) and its own estimate, in that environment, agrees."""
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    plain = _quiet(mk.estimate_memory, MID, MID_ARGS, seq_len=512, device="A10G")
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    expandable = _quiet(mk.estimate_memory, MID, MID_ARGS, seq_len=512, device="A10G")
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    # the allocator model: one growing segment leaves less of the step's memory unusable
    assert expandable.breakdown["fragmentation"] < plain.breakdown["fragmentation"]
    assert expandable.upper < plain.upper
    between = (plain.upper + expandable.upper) // 2
    plan = _quiet(mk.plan_training, MID, seq_len=512, target_batch_size=4, device="A10G",
                  max_memory=between, method="full", **MID_ARGS)
    assert plan.chosen.allocator == "expandable_segments:True"
    assert plan.env == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert "expandable segments" in plan.chosen.label() and plan.verdict == "fits"
    assert any(n.startswith("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True") for n in plan.notes)
    assert plan.launch_commands()["torchrun"].startswith(
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True ")
    assert "environment" in plan.explain()
    top = plan.ladder[-1]   # the rung applied last, on top of the rest
    assert top["rung"].startswith("expandable segments") and top["saved"] > 0
    _agrees(plan)
    assert "PYTORCH_CUDA_ALLOC_CONF" not in __import__("os").environ   # left as it was
    again = mk.Plan.from_json(plan.to_json())
    assert again.env == plan.env
    bad = plan.to_dict()
    bad["candidates"][0]["allocator"] = "expandable_segments:True; rm -rf ~"
    with pytest.raises(mk.ConfigError, match="allocator"):
        mk.Plan.from_dict(bad)
    # the user's own choice of the option is kept: the rung is not tried
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")
    kept = _quiet(mk.plan_training, MID, seq_len=512, target_batch_size=4, device="A10G",
                  max_memory=between, method="full", **MID_ARGS)
    assert kept.chosen.allocator == "" and kept.env == {}
