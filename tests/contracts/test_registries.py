"""The registries (optimizers, engines, techniques, methods, tasks) and the checks written once:
what a new entry gets by construction, and what reads the registries."""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import LlamaConfig

import hf_memkit as mk
from hf_memkit._engines import ENGINES, all_rungs
from hf_memkit._estimate import TraceCache, estimate_for
from hf_memkit._methods import METHODS, method_choices
from hf_memkit._model.spec import resolve_model
from hf_memkit._model.tasks import TASKS, task_choices
from hf_memkit._optimizers import get_optimizer_profile, planner_optimizers, supported_optimizers
from hf_memkit._plan import PlanRequest, engine_choices
from hf_memkit._setup.setup import normalize_args
from hf_memkit._techniques import TECHNIQUES, Technique, register
from hf_memkit.commands.main import build_parser

TINY = LlamaConfig(hidden_size=64, intermediate_size=172, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, vocab_size=500,
                   tie_word_embeddings=False)
EXTRA = 1 << 18  # fp32 elements the dummy technique keeps alive: 1 MiB


class KeepExtra(Technique):
    """A dummy technique: every forward leaves a 1 MiB tensor alive, 7 host bytes per token."""

    name = "dummy_keep_extra"
    fields = ("disable_tqdm",)
    what = "keeps an extra 1 MiB tensor alive"

    def read(self, explicit, get):
        return {"on": True} if explicit.get("disable_tqdm") else None

    def trace_hook(self, model, options, *, stage, adapters, target=None):
        def hook(module, args, output):
            module._dummy_extra = torch.empty(EXTRA, dtype=torch.float32)
        model.register_forward_hook(hook)

    def host_bytes(self, spec, setup, seq_len, options, compute_dtype):
        return 7 * seq_len


@pytest.fixture
def dummy_technique():
    t = register(KeepExtra())
    yield t
    TECHNIQUES.unregister(t.name)


def test_a_new_technique_gets_its_own_trace_cache_entry(dummy_technique):
    spec = resolve_model(TINY)
    dev = mk.get_device("cpu")
    plain = normalize_args({"per_device_train_batch_size": 2})
    with_dummy = normalize_args({"per_device_train_batch_size": 2, "disable_tqdm": True})
    assert {u.name for u in with_dummy.techniques} == {"dummy_keep_extra"}
    assert plain.trace_key() != with_dummy.trace_key()

    cache = TraceCache()
    a = estimate_for(spec, plain, dev, seq_len=32, cache=cache)
    entries = len(cache)
    b = estimate_for(spec, with_dummy, dev, seq_len=32, cache=cache)
    assert len(cache) == entries + 1                 # traced anew, not served the plain trace
    # the hook's tensor is alive from the end of the forward: the peak grows by exactly it
    assert b.peak_allocated - a.peak_allocated == 4 * EXTRA
    fresh = estimate_for(spec, with_dummy, dev, seq_len=32)   # no cache at all
    assert fresh.peak_allocated == b.peak_allocated
    assert (a.host_offloaded, b.host_offloaded) == (0, 7 * 32)  # its host bytes are reported


def test_settings_that_do_not_change_the_trace_share_it():
    spec = resolve_model(TINY)
    dev = mk.get_device("cpu")
    cache = TraceCache()
    for optim in ("adamw_torch", "adafactor", "sgd"):
        for accum in (2, 4, 8):
            setup = normalize_args({"per_device_train_batch_size": 2, "optim": optim,
                                    "gradient_accumulation_steps": accum, "max_grad_norm": 0.5})
            estimate_for(spec, setup, dev, seq_len=32, cache=cache)
    assert len(cache) == 1
    # a step that does not accumulate is traced as it runs, one micro-step (its allocator
    # replay differs), and then equals estimate_memory's answer without a cache
    one = normalize_args({"per_device_train_batch_size": 2, "gradient_accumulation_steps": 1})
    cached = estimate_for(spec, one, dev, seq_len=32, cache=cache)
    assert len(cache) == 2
    assert cached.device_used == estimate_for(spec, one, dev, seq_len=32).device_used


def test_unmodelled_techniques_are_registry_entries_that_warn():
    unmodelled = [t for t in TECHNIQUES if not t.modelled]
    assert {t.name for t in unmodelled} >= {"torch_compile", "neftune_noise_alpha"}
    with pytest.warns(UserWarning, match="torch_compile"):
        setup = normalize_args({"torch_compile": True})
    assert any("torch.compile" in u for u in setup.unmodelled)


def test_checkpointing_new_name_wins_through_its_entry():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        off = normalize_args({"activation_checkpointing": False, "gradient_checkpointing": True})
        on = normalize_args({"gradient_checkpointing": True,
                             "gradient_checkpointing_kwargs": {"use_reentrant": True}})
    assert not off.checkpointing
    assert on.checkpointing and on.uses("activation_checkpointing").option("use_reentrant")


def test_optimizer_profiles_carry_what_the_planner_needs():
    for name in supported_optimizers():
        p = get_optimizer_profile(name)
        assert p.source and p.step_cost > 0
        assert p.accelerate_recipe()["class"]
    assert planner_optimizers("cpu")[0] == "adamw_torch_fused"
    assert "paged_adamw_8bit" in planner_optimizers("cuda")
    assert "paged_adamw_8bit" not in planner_optimizers("cpu")
    assert get_optimizer_profile("adamw_torch_fused").shardable
    assert not get_optimizer_profile("adafactor").shardable
    assert get_optimizer_profile("adafactor").accelerate_recipe() == {
        "class": "transformers.Adafactor",
        "kwargs": {"scale_parameter": False, "relative_step": False}}


def test_engines_and_their_rungs():
    assert engine_choices() == ["auto", "ddp", "fsdp", "fsdp-full-shard", "fsdp-shard-grad-op",
                                "fsdp-offload", "deepspeed", "zero2", "zero3", "zero3-offload"]
    rungs = all_rungs()
    for e in ENGINES:   # a stage by name names rungs of that engine
        assert all(set(names) <= {r.name for r in e.rungs()} for names in e.stages.values())
    assert [r for r in rungs if rungs[r].offload] == ["fsdp-offload", "zero3-offload-opt",
                                                      "zero3-offload"]
    for r in rungs.values():
        assert r.engine in ENGINES
    assert ENGINES.get("fsdp").owns_checkpointing and not ENGINES.get("ddp").owns_checkpointing


def test_methods_form_the_ladder():
    # the LoRA family by measured speed: QLoRA (1.56x LoRA's step time) before an 8-bit base
    assert METHODS.names() == ["full", "lora", "qlora", "fsdp-qlora", "lora-8bit"]
    assert [m.slowdown for m in METHODS] == sorted(m.slowdown for m in METHODS)
    assert method_choices() == ["auto", "full", "lora", "qlora"]
    assert [m.name for m in METHODS if "lora" in m.selected_by] == ["lora", "lora-8bit"]


def test_tasks_registry_builds_heads_and_labels():
    assert TASKS.get("seq-cls").name == "sequence-classification"
    assert "causal-lm" in task_choices() and "qa" in task_choices()
    labels = TASKS.get("question-answering").labels_for(None, 3, 16, 16)
    assert set(labels) == {"start_positions", "end_positions"}
    assert labels["start_positions"].shape == (3,)
    assert TASKS.get("seq2seq-lm").labels_for(None, 2, 16, 8)["labels"].shape == (2, 8)


def test_cli_choices_read_the_registries():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices
    plan = {a.dest: a for a in sub["plan"]._actions}
    assert list(plan["method"].choices) == method_choices()
    assert list(plan["engine"].choices) == engine_choices()
    assert list(plan["task"].choices) == task_choices()


def test_plan_request_names_the_field_of_each_problem():
    req = PlanRequest(TINY, seq_len=0, target_batch_size=10, device="A100-80GB", num_gpus=4,
                      method="dora", engine="zero", headroom=1.5,
                      constraints={"micro_btach": 2})
    fields = {p.field for p in req.problems()}
    assert fields == {"seq_len", "method", "engine", "headroom", "micro_btach",
                      "target_batch_size"}
    ok = PlanRequest(TINY, seq_len=64, target_batch_size=8, device="A100-80GB", num_gpus=4,
                     constraints={"per_device_train_batch_size": 2,
                                  "gradient_accumulation_steps": 3})
    (p,) = ok.problems()
    assert p.field == "gradient_accumulation_steps" and "set it to 1" in p.message


def test_plan_request_partial_skips_unknown_fields():
    req = PlanRequest(seq_len=None, target_batch_size=None, num_gpus=None, partial=True)
    assert req.problems() == []
