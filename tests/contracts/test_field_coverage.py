"""Every field of the installed ``TrainingArguments`` and of every registered TRL trainer's config
(``SFTConfig``, ``DPOConfig``, ``GRPOConfig``, ``RLOOConfig``, ``KTOConfig``, ``RewardConfig``,
``DistillationConfig``) is modelled,
named in a 'not modelled' warning, or irrelevant to a step's device memory (issue 14, item 7).

The fields are enumerated from the installed classes, so a field that a new transformers or TRL
adds fails here until ``hf_memkit/_setup/coverage.py`` places it."""

from __future__ import annotations

import dataclasses
import tempfile
import warnings

import pytest
from transformers import LlamaConfig, TrainingArguments

import hf_memkit as mk
from hf_memkit._setup.coverage import (
    CLASSES,
    ENGINE_FIELDS,
    IRRELEVANT,
    SETUP_FIELDS,
    UNMODELLED,
    field_classes,
)
from hf_memkit._setup.setup import normalize_args
from hf_memkit._trainers import TRAINERS
from tests.helpers import require

TINY = LlamaConfig(hidden_size=64, intermediate_size=172, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, vocab_size=500,
                   tie_word_embeddings=False)
TRAINER_NAMES = TRAINERS.names()   # every registered trainer (a contract: a new one is checked)

# A non-default value of every unmodelled field (valid for the field's type).
NON_DEFAULT = {
    "torch_compile": True, "torch_compile_backend": "inductor",
    "torch_compile_mode": "reduce-overhead", "neftune_noise_alpha": 5.0,
    "torch_empty_cache_steps": 4, "label_smoothing_factor": 0.1, "use_cache": True,
    "bf16_full_eval": True, "fp16_full_eval": True, "eval_do_concat_batches": False,
    "include_for_metrics": ["inputs"], "batch_eval_metrics": True,
    "eval_use_gather_object": True, "auto_find_batch_size": True, "full_determinism": True,
    "parallelism_config": {"tp_size": 2}, "debug": "underflow_overflow", "weight_decay": 0.1,
    "model_init_kwargs": {"dtype": "bfloat16"}, "router_aux_loss_coef": 0.0,
    "eval_packing": True,
    "disable_dropout": False, "precompute_ref_batch_size": 64, "ld_alpha": 0.5,
    "cache_implementation": "static", "generation_kwargs": {"top_k": 50},
    "use_transformers_continuous_batching": True,
    "transformers_continuous_batching_config": {"num_blocks": 64},
    "use_transformers_paged": True,
    "vllm_model_impl": "transformers", "cast_lm_head_to_fp32": True,
    "max_tool_calling_iterations": 4,
    "teacher_model_name_or_path": "Qwen/Qwen2.5-1.5B-Instruct",
    "teacher_model_init_kwargs": {"dtype": "bfloat16"},
}

# ... where a trainer's config defaults it otherwise (GRPOConfig / RLOOConfig: dropout kept)
NON_DEFAULT_FOR = {("grpo", "disable_dropout"): True, ("rloo", "disable_dropout"): True,
                   ("distillation", "disable_dropout"): True}


def _config_class(trainer: str) -> type:
    if trainer != "trainer":
        require("trl")
    return TRAINERS.get(trainer).config_type()


def _field_warnings(args, **kw) -> tuple[list[str], tuple[str, ...]]:
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        setup = normalize_args(args, **kw)
    return [str(w.message) for w in rec if "hf_memkit does not model" in str(w.message)], \
        setup.unmodelled


@pytest.mark.parametrize("trainer", TRAINER_NAMES)
def test_every_installed_field_is_in_exactly_one_class(trainer):
    cls = _config_class(trainer)
    classes = field_classes(trainer)
    gaps = []
    for f in dataclasses.fields(cls):
        where = [c for c in CLASSES if f.name in classes[c]]
        if len(where) != 1:
            gaps.append(f"{cls.__name__}.{f.name} is in {' and '.join(where) or 'no class'}: "
                        "place it once in hf_memkit/_setup/coverage.py (UNMODELLED with what it changes, "
                        "or an IRRELEVANT group with the reason; modelled fields come from the "
                        "registries)")
    assert not gaps, "\n".join(gaps)


def test_every_listed_field_exists_in_an_installed_class():
    """No stale names: a field a library removed is dropped from the lists too."""
    require("trl")
    installed = {f.name for t in TRAINER_NAMES
                 for f in dataclasses.fields(TRAINERS.get(t).config_type())}
    listed = {*UNMODELLED, *SETUP_FIELDS, *ENGINE_FIELDS,
              *(f for group in IRRELEVANT.values() for f in group)}
    assert sorted(listed - installed) == []


@pytest.mark.parametrize("trainer", TRAINER_NAMES)
def test_each_unmodelled_field_set_warns_naming_it(trainer):
    _config_class(trainer)
    unmodelled = field_classes(trainer)["unmodelled"]
    assert sorted(unmodelled - NON_DEFAULT.keys()) == [], "add a sample value to NON_DEFAULT"
    for name in sorted(unmodelled):
        entry = UNMODELLED.get(name)
        value = NON_DEFAULT_FOR.get((trainer, name), NON_DEFAULT[name])
        args = {name: value, **{k: v[0] for k, v in
                                            (entry.when if entry else {}).items()}}
        messages, named = _field_warnings(args, trainer=trainer)
        mine = [m for m in messages if m.startswith(f"hf_memkit does not model {name}:")]
        assert len(mine) == 1 and mine[0].endswith("; the estimate ignores it"), (name, messages)
        assert any(u.startswith(f"{name}:") for u in named), (name, named)


@pytest.mark.parametrize("trainer", TRAINER_NAMES)
def test_default_configs_warn_about_nothing(trainer):
    """An instance of the installed class left at its defaults sets nothing unmodelled (the
    instance's values, e.g. ``debug=[]`` for the field default "", count as the default)."""
    cls = _config_class(trainer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        inst = cls(output_dir=tempfile.gettempdir(), use_cpu=True, report_to=[])
    assert _field_warnings(inst) == ([], ())
    assert _field_warnings({}, trainer=trainer) == ([], ())


def test_training_arguments_instances_warn_once_per_field():
    """Through a real ``TrainingArguments`` (its ``__post_init__`` normalises values)."""
    out = tempfile.gettempdir()
    for name in ("torch_empty_cache_steps", "label_smoothing_factor", "use_cache",
                 "bf16_full_eval", "include_for_metrics", "debug", "auto_find_batch_size"):
        ta = TrainingArguments(output_dir=out, use_cpu=True, report_to=[],
                               **{name: NON_DEFAULT[name]})
        messages, named = _field_warnings(ta)
        assert [m.split(":")[0] for m in messages] == [f"hf_memkit does not model {name}"]
        assert [u.split(":")[0] for u in named] == [name]


def test_a_condition_limits_the_warning():
    """weight_decay costs memory only where torch adds it out of place (foreach SGD, Adagrad,
    RMSprop: torch/optim/sgd.py ``_multi_tensor_sgd``); AdamW decays the weights in place."""
    assert _field_warnings({"weight_decay": 0.1}) == ([], ())
    assert _field_warnings({"weight_decay": 0.1, "optim": "sgd"})[1][0].startswith("weight_decay")
    assert _field_warnings({"weight_decay": 0.0, "optim": "sgd"}) == ([], ())


def test_the_public_estimate_warns_too():
    with pytest.warns(UserWarning, match="does not model torch_empty_cache_steps: "):
        est = mk.estimate_memory(TINY, {"torch_empty_cache_steps": 2}, seq_len=16, device="cpu")
    assert est.device_used > 0


def _used(args, **kw) -> int:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return mk.estimate_memory(TINY, args, seq_len=32, device="A100-80GB", **kw).device_used


def test_modelled_fields_change_the_estimate_or_the_setup():
    modelled = field_classes("trainer")["modelled"]
    base = {"per_device_train_batch_size": 2}
    changes = {"per_device_train_batch_size": 8, "activation_checkpointing": True,
               "gradient_accumulation_steps": 4, "optim": "sgd"}
    assert set(changes) <= modelled
    before = _used(base)
    for name, value in changes.items():
        assert _used({**base, name: value}) != before, name
    for name, value, attr in (("max_grad_norm", 0.0, "max_grad_norm"),
                              ("optim_target_modules", ["q_proj"], "optim_args"),
                              ("prediction_loss_only", True, "prediction_loss_only")):
        assert name in modelled
        assert getattr(normalize_args({name: value}), attr) != \
            getattr(normalize_args({}), attr), name


@pytest.mark.parametrize("trainer,name,value", [
    ("sft", "packing", True), ("sft", "pad_to_multiple_of", 64),
    ("dpo", "precompute_ref_log_probs", True), ("dpo", "use_weighting", True),
    ("kto", "precompute_ref_log_probs", True), ("kto", "loss_type", "apo_zero_unpaired"),
    ("reward", "center_rewards_coefficient", 0.01), ("distillation", "beta", 0.5)])
def test_modelled_trl_fields_change_the_setup(trainer, name, value):
    _config_class(trainer)
    assert name in field_classes(trainer)["modelled"]
    plain = normalize_args({}, trainer=trainer).trainer
    assert normalize_args({name: value}, trainer=trainer).trainer != plain


IRRELEVANT_SAMPLE = {"logging_steps": 7, "seed": 3, "learning_rate": 1e-3,
                     "dataloader_num_workers": 2, "dataloader_pin_memory": False,
                     "save_steps": 11, "report_to": ["tensorboard"], "ddp_bucket_cap_mb": 5,
                     "lr_scheduler_type": "cosine", "adam_beta2": 0.95}


def test_irrelevant_fields_leave_device_used_unchanged():
    irrelevant = field_classes("trainer")["irrelevant"]
    assert set(IRRELEVANT_SAMPLE) <= irrelevant
    base = {"per_device_train_batch_size": 2}
    before = _used(base)
    for name, value in IRRELEVANT_SAMPLE.items():
        assert _used({**base, name: value}) == before, name


@pytest.mark.parametrize("trainer,name,value", [
    ("sft", "dataset_text_field", "content"), ("sft", "truncation_mode", "keep_end"),
    ("dpo", "beta", 0.5), ("dpo", "use_cache", True),
    ("kto", "desirable_weight", 2.0), ("kto", "beta", 0.5)])
def test_irrelevant_trl_fields_leave_device_used_unchanged(trainer, name, value):
    _config_class(trainer)
    assert name in field_classes(trainer)["irrelevant"]
    base = {"per_device_train_batch_size": 2, "max_length": 32}
    assert _used({**base, name: value}, trainer=trainer) == _used(base, trainer=trainer)
