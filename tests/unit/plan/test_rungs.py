"""The planner's memory rungs (issue #14 item 6): Liger's fused head before checkpointing,
checkpoint offload after it and before pure bf16, and ``Plan.ladder`` / ``explain()`` saying
what each rung saved.

Liger's Triton kernels and pinned host copies cannot run here: plans are made for a catalog
A100, and Liger's presence on the machine is faked by an empty ``liger_kernel`` package on
``sys.path`` (what the planner checks before emitting ``use_liger_kernel``)."""

from __future__ import annotations

import warnings

import pytest
from transformers import GPT2Config, LlamaConfig, LlamaForCausalLM

import hf_memkit as mk
from hf_memkit._cuda.host import host_link_bandwidth
from hf_memkit._units import GiB
from tests.helpers import require

# a long sequence over a 32k vocabulary: the logits and the layer inputs both weigh
CFG = LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                  num_attention_heads=8, num_key_value_heads=8, vocab_size=32000,
                  max_position_embeddings=8192)
# 24 blocks: offload saves every block's input (24 x 16 MiB), well above what the allocator's
# terms move between the two setups (at 8 blocks the saving is within the allocator's share)
DEEP = LlamaConfig(**{**CFG.to_diff_dict(), "num_hidden_layers": 24})
SEQ = 8192
A100 = "A100-80GB"
BASE = dict(per_device_train_batch_size=1, bf16=True, optim="adamw_torch_fused")
CKPT = dict(gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False})
OFFLOAD = dict(gradient_checkpointing=True,
               gradient_checkpointing_kwargs={"use_reentrant": False, "offload": True})


def _quiet(fn, *a, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*a, **kw)


def estimate(cfg=CFG, **args) -> mk.MemoryEstimate:
    return _quiet(mk.estimate_memory, cfg, {**BASE, **args}, seq_len=SEQ, device=A100)


def plan(cfg=CFG, **kw) -> mk.Plan:
    kw.setdefault("method", "full")
    kw.setdefault("optim", "adamw_torch_fused")
    return _quiet(mk.plan_training, cfg, seq_len=SEQ, target_batch_size=1, device=A100, **kw)


@pytest.fixture(autouse=True)
def classic_allocator(monkeypatch):
    """The technique rungs under the allocator's defaults, chosen by the user: the planner's
    expandable-segments rung (tests/unit/plan/test_verdict_agrees.py) would otherwise keep a
    setup that misses by fragmentation before any slower rung."""
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")


@pytest.fixture
def liger_installed(tmp_path, monkeypatch):
    (tmp_path / "liger_kernel").mkdir()
    (tmp_path / "liger_kernel" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))


def _between(lower: mk.MemoryEstimate, higher: mk.MemoryEstimate) -> int:
    assert lower.upper < higher.upper
    return (lower.upper + higher.upper) // 2


def test_offload_is_planned_when_checkpointing_alone_does_not_fit():
    ckpt, off = estimate(DEEP, **CKPT), estimate(DEEP, **OFFLOAD)
    p = plan(DEEP, max_memory=_between(off, ckpt), bf16=True)
    ta = p.training_args_kwargs
    kwargs = ta.get("activation_checkpointing_kwargs", ta.get("gradient_checkpointing_kwargs"))
    assert kwargs == {"use_reentrant": False, "offload": True}
    assert p.estimate.device_used == off.device_used
    assert p.estimate.host_offloaded == off.host_offloaded > 0
    # transformers takes the emitted kwargs (offload is a real option of the installed version)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=4,
                                         vocab_size=128))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    assert model.is_gradient_checkpointing
    # what the plan says it costs: each layer input to the host and back over PCIe Gen4
    rung = {r["rung"]: r for r in p.ladder}["activation offloading"]
    assert rung["host_offloaded"] == off.host_offloaded
    assert rung["saved"] == ckpt.upper - off.upper > 0
    assert rung["time_factor"] > 1
    assert host_link_bandwidth(mk.get_device(A100)) == pytest.approx(0.8 * 32e9)


def test_offload_is_not_planned_where_checkpointing_fits():
    p = plan(max_memory=estimate(**CKPT).upper + GiB // 4, bf16=True)
    assert p.chosen.checkpointing and "checkpoint_offload" not in p.chosen.techniques


def test_offload_comes_before_pure_bf16():
    """With a budget that pure bf16 (no fp32 master weights) and offload both fit, and
    checkpointing alone does not, the plan keeps mixed precision and offloads: pure bf16
    changes numerics, offload only costs time."""
    cfg = LlamaConfig(hidden_size=512, intermediate_size=1408, num_hidden_layers=24,
                      num_attention_heads=8, num_key_value_heads=8, vocab_size=8000,
                      max_position_embeddings=16384)
    args = dict(BASE, **CKPT)

    def est(**kw):
        return _quiet(mk.estimate_memory, cfg, {**args, **kw}, seq_len=16384, device=A100,
                      dtype="bfloat16" if kw.get("bf16") is False else None)

    ckpt, off, pure = est(), est(gradient_checkpointing_kwargs=OFFLOAD[
        "gradient_checkpointing_kwargs"]), est(bf16=False)
    assert pure.upper < off.upper < ckpt.upper
    p = _quiet(mk.plan_training, cfg, seq_len=16384, target_batch_size=1, device=A100,
               method="full", optim="adamw_torch_fused", max_memory=off.upper + 1)
    assert p.chosen.precision == "bf16" and "checkpoint_offload" in p.chosen.techniques
    assert p.estimate.device_used == off.device_used


def test_offload_is_never_tried_on_a_cpu_target_or_against_a_pin():
    on_cpu = _quiet(mk.plan_training, CFG, seq_len=512, target_batch_size=1, device="cpu",
                    method="full")
    assert not any("checkpoint_offload" in c.techniques for c in on_cpu.candidates)
    pinned_off = plan(gradient_checkpointing_kwargs={"use_reentrant": False}, bf16=True,
                      max_memory=estimate(**CKPT).upper + 1)
    assert not any("checkpoint_offload" in c.techniques for c in pinned_off.candidates)
    # pinned kwargs configure checkpointing; they do not switch it off
    assert any(c.checkpointing for c in pinned_off.candidates)
    pinned_on = plan(gradient_checkpointing_kwargs={"offload": True}, bf16=True)
    assert all("checkpoint_offload" in c.techniques for c in pinned_on.candidates
               if c.checkpointing)


def test_fsdp_rungs_offload_checkpoints_through_the_trainers_checkpointing():
    """transformers maps no fsdp_config key onto accelerate's checkpoint offload, so an FSDP
    candidate that offloads checkpoints with the Trainer's own checkpointing (its
    ``activation_checkpointing_kwargs``), and FSDP's config then leaves checkpointing out."""
    from hf_memkit._plan.emit import trainer_checkpointing

    p = _quiet(mk.plan_training, "Llama-3.1-8B", seq_len=4096, target_batch_size=8,
               device="H100-80GB", num_gpus=8, method="full")
    sharded = [c for c in p.candidates if c.parallel.startswith("fsdp")]
    offloading = [c for c in sharded if "checkpoint_offload" in c.techniques]
    assert offloading and all(trainer_checkpointing(c) for c in offloading)
    assert not any(trainer_checkpointing(c) for c in sharded if c not in offloading)


def test_liger_comes_before_checkpointing(liger_installed):
    """Liger's fused cross-entropy drops the [tokens x vocab] logits at no predicted cost;
    checkpointing recomputes the forward. With a budget Liger alone fits, the plan takes Liger
    and no checkpointing."""
    liger, ckpt = estimate(use_liger_kernel=True), estimate(**CKPT)
    assert liger.upper < estimate().upper
    p = plan(max_memory=max(liger.upper, ckpt.upper) + 1, bf16=True)
    assert p.training_args_kwargs["use_liger_kernel"] is True
    assert not p.chosen.checkpointing
    assert p.estimate.device_used == liger.device_used
    assert [r["rung"] for r in p.ladder] == ["Liger kernels"]
    assert p.ladder[0]["saved"] == estimate().upper - liger.upper
    assert "what each rung saved" in p.explain()


def test_liger_is_not_tried_without_the_package_nor_for_models_it_does_not_patch(
        liger_installed, monkeypatch):
    gpt2 = GPT2Config(n_embd=256, n_layer=2, n_head=4, vocab_size=32000, n_positions=1024)
    p = _quiet(mk.plan_training, gpt2, seq_len=1024, target_batch_size=1, device=A100,
               method="full")
    assert not any("use_liger_kernel" in c.techniques for c in p.candidates)
    assert any("does not support Liger" in n for n in p.notes)
    monkeypatch.setattr("importlib.util.find_spec",
                        lambda name, *a: None if name == "liger_kernel" else _spec(name, *a))
    p = plan(bf16=True)
    assert not any("use_liger_kernel" in c.techniques for c in p.candidates)
    assert any("pip install liger-kernel" in n for n in p.notes)


def _spec(name, *a):
    import importlib.machinery

    return importlib.machinery.PathFinder.find_spec(name)


def test_the_ladder_adds_up_from_the_plain_setup(liger_installed):
    """Every rung's saving is the difference of two independent estimates of the emitted
    arguments with and without it, from the bottom rung up."""
    p = plan(max_memory=estimate(**OFFLOAD, use_liger_kernel=True).upper + 1, bf16=True,
             use_liger_kernel=True, gradient_checkpointing=True)
    rungs = [r["rung"] for r in p.ladder]
    assert rungs == ["Liger kernels", "checkpointing", "activation offloading"]
    steps = [estimate(), estimate(use_liger_kernel=True),
             estimate(use_liger_kernel=True, **CKPT),
             estimate(use_liger_kernel=True, **OFFLOAD)]
    for r, before, after in zip(p.ladder, steps[:-1], steps[1:], strict=True):
        assert r["device_used"] == after.device_used
        assert r["must_fit"] == after.upper
        assert r["saved"] == before.upper - after.upper
    # the last row is the chosen setup's own figure, as the plan's summary shows it
    assert p.ladder[-1]["must_fit"] == p.estimate.upper
    back = mk.Plan.from_json(p.to_json())
    assert back.ladder == p.ladder


def test_trl_keeps_only_liger_layer_kernels():
    """SFTTrainer turns Liger's fused linear cross-entropy off (its own fused head replaces the
    model's forward) and refuses it when asked for explicitly, as TRL 1.16 does."""
    require("trl")
    sft = dict(BASE, max_length=SEQ, use_liger_kernel=True)
    layers = dict(sft, liger_kernel_config={"fused_linear_cross_entropy": False})
    est = _quiet(mk.estimate_memory, CFG, sft, device=A100, trainer="sft")
    assert est.device_used == _quiet(mk.estimate_memory, CFG, layers, device=A100,
                                     trainer="sft").device_used
    # the layer kernels lower the step's tensors (by ~200 MB here); device_used was within
    # 0.2 MB of the plain run's, its fragmentation making up the difference
    assert est.peak_allocated < _quiet(mk.estimate_memory, CFG, dict(BASE, max_length=SEQ),
                                       device=A100, trainer="sft").peak_allocated
    with pytest.raises(mk.HfMemkitError, match="fused_linear_cross_entropy"):
        _quiet(mk.estimate_memory, CFG,
               dict(sft, liger_kernel_config={"fused_linear_cross_entropy": True}),
               device=A100, trainer="sft")
