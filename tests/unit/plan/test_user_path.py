"""The user's path through the planner (issue 15 items 1, 6, 7): what ``auto_training_args``
hands back (trained for real in tests/integration/test_auto_training_args_trains.py),
``Plan.apply_to`` onto arguments the user already has, and building arguments on a machine that
is not the plan's target."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, TrainingArguments

import hf_memkit as mk
from hf_memkit._units import GiB
from tests.helpers import require

TINY = LlamaConfig(hidden_size=128, intermediate_size=344, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, vocab_size=2000,
                   tie_word_embeddings=False, attention_dropout=0.0)
SEQ, TARGET = 128, 8
QUIET = dict(report_to=[], save_strategy="no", logging_steps=1, disable_tqdm=True,
             dataloader_num_workers=0)


def cpu(total: int = 8 * GiB):
    return mk.get_device("cpu").replace(total_memory=total, free_memory=total)


def quiet_plan(model, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return mk.plan_training(model, seq_len=SEQ, target_batch_size=TARGET, **kw)


def _lora_only_budget() -> int:
    """A budget where plan_training falls back to LoRA: no full setup fits."""
    return int(mk.profile_model(TINY).total_params * 4 * 3 * 0.9)


def test_auto_training_args_never_hands_a_lora_plan_to_an_unprepared_model():
    require("peft")
    budget = _lora_only_budget()
    assert quiet_plan(TINY, device=cpu(), max_memory=budget).chosen.method == "lora"
    model = AutoModelForCausalLM.from_config(TINY)
    with pytest.raises(mk.HfMemkitError) as err:
        mk.auto_training_args(model, seq_len=SEQ, target_batch_size=TARGET, device=cpu(),
                              max_memory=budget, output_dir="unused")
    msg = str(err.value)
    assert "as it is given" in msg and "plan.prepare(model)" in msg and "float32" in msg
    assert all(p.requires_grad for p in model.parameters())  # untouched: still full, no LoRA


def test_auto_training_args_refuses_a_method_the_model_is_not_ready_for():
    model = AutoModelForCausalLM.from_config(TINY)
    with pytest.raises(mk.HfMemkitError, match=r"method='qlora' needs it loaded"):
        mk.auto_training_args(model, seq_len=SEQ, target_batch_size=TARGET, device=cpu(),
                              method="qlora")


def test_a_bf16_plan_is_not_handed_to_an_fp32_model_as_pure_bf16():
    # on an A100 with a budget only pure bf16 fits: plan_training picks it (the model would be
    # reloaded in bf16); for an fp32 model as given, auto_training_args must not
    a100 = mk.get_device("A100-80GB")
    kw = dict(device=a100, method="full", micro_batch=1)
    # the least budget any AMP bf16 setup (fp32 weights) fits in, by bisection
    hi, lo = quiet_plan(TINY, bf16=True, **kw).estimate.upper, 0
    while hi - lo > 2**20:
        mid = (hi + lo) // 2
        try:
            quiet_plan(TINY, bf16=True, max_memory=mid, **kw)
            hi = mid
        except mk.HfMemkitError:
            lo = mid
    budget = lo  # no AMP setup fits; pure bf16 (half the weights) does
    assert quiet_plan(TINY, max_memory=budget, **kw).chosen.precision == "pure-bf16"
    model = AutoModelForCausalLM.from_config(TINY)  # fp32 weights
    with pytest.raises(mk.HfMemkitError, match="no pure bf16"):
        mk.auto_training_args(model, seq_len=SEQ, target_batch_size=TARGET, device=a100,
                              max_memory=budget, micro_batch=1, output_dir="unused")


@dataclasses.dataclass
class MyArgs(TrainingArguments):
    """A user's own subclass, as TRL's SFTConfig is one."""

    dataset_text_field: str = "text"


def test_apply_to_returns_the_same_class_with_planned_fields_and_the_users_others(tmp_path):
    p = quiet_plan(TINY, device=cpu(), activation_checkpointing=True)
    mine = MyArgs(output_dir=str(tmp_path), learning_rate=3e-5, dataset_text_field="prompt",
                  optim="adafactor", use_cpu=True, report_to=[], seed=7)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = p.apply_to(mine)
    assert type(out) is MyArgs and out is not mine
    assert (out.learning_rate, out.dataset_text_field, out.seed, out.output_dir) == (
        3e-5, "prompt", 7, str(tmp_path))
    for k, v in p.training_args_kwargs.items():
        got = getattr(out, k)
        assert getattr(got, "value", got) == v, k
    conflicts = [str(w.message) for w in caught if "apply_to" in str(w.message)]
    # one warning per field the user had set to something else: here only optim
    assert len(conflicts) == 1 and "optim='adafactor'" in conflicts[0]
    assert p.training_args_kwargs["optim"] in conflicts[0]
    assert mine.optim == "adafactor"  # the user's object is not modified


def test_apply_to_rejects_what_is_not_training_arguments():
    p = quiet_plan(TINY, device=cpu())
    with pytest.raises(mk.HfMemkitError, match=r"apply_to takes TrainingArguments.*got dict"):
        p.apply_to({"output_dir": "x"})


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_to_training_args_for_another_machine_explains_itself():
    p = quiet_plan(TINY, device="A100-80GB")
    assert p.training_args_kwargs["bf16"] or p.training_args_kwargs.get("tf32")
    with pytest.raises(mk.HfMemkitError) as err:
        p.to_training_args(output_dir="unused")
    msg = str(err.value)
    assert "A100-80GB" in msg and "no CUDA device" in msg and "to_json" in msg
    assert isinstance(err.value, ValueError)  # existing `except ValueError` keeps working
    # what the error offers works here: a plain dict, and the plan carried as JSON
    assert mk.Plan.from_json(p.to_json()).training_args_kwargs == p.training_args_kwargs


def test_the_suite_cannot_reach_the_network():
    import socket
    import urllib.request

    from tests.helpers import NetworkAccessError

    with pytest.raises(NetworkAccessError, match="huggingface.co"):
        urllib.request.urlopen("https://huggingface.co/api/models/gpt2", timeout=5)
    with pytest.raises(NetworkAccessError, match="1.1.1.1"):
        socket.create_connection(("1.1.1.1", 443), timeout=5)
    import os

    assert os.environ["HF_HUB_OFFLINE"] == "1"


def test_a_broken_optimum_install_is_explained_not_fatal(monkeypatch):
    # optimum 1.27 raises RuntimeError on import under transformers >= 4.49 (its own check);
    # that package cannot be installed beside transformers 5 here, so its import is made to
    # raise its message. A model without native SDPA (GPT-1) is planned with eager attention.
    import importlib.abc
    import sys

    from transformers import OpenAIGPTConfig

    class BrokenOptimum(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "optimum" or name.startswith("optimum."):
                raise RuntimeError("BetterTransformer requires transformers<4.49 but found "
                                   "5.17.0. `optimum.bettertransformer` is deprecated and will "
                                   "be removed in optimum v2.0.")
            return None

    for name in [m for m in sys.modules if m == "optimum" or m.startswith("optimum.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", [BrokenOptimum(), *sys.meta_path])
    cfg = OpenAIGPTConfig(n_embd=64, n_layer=2, n_head=4, vocab_size=500, n_positions=128)
    p = quiet_plan(cfg, device=cpu())
    note = next(n for n in p.notes if n.startswith("attention:"))
    assert "eager" in note and "RuntimeError" in note and "transformers<4.49" in note
    assert p.model_kwargs["attn_implementation"] == "eager"


def test_headroom_beside_max_memory_is_said_to_be_ignored():
    with pytest.warns(UserWarning, match=r"plan_training: headroom=0.3 is ignored because "
                                         r"max_memory='4GiB' is given"):
        p = mk.plan_training(TINY, seq_len=SEQ, target_batch_size=TARGET, device=cpu(),
                             headroom=0.3, max_memory="4GiB")
    assert p.budget == 4 * GiB
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # max_memory alone: nothing to say
        mk.plan_training(TINY, seq_len=SEQ, target_batch_size=TARGET, device=cpu(),
                         max_memory="4GiB")
    with pytest.warns(UserWarning, match="estimate_memory: headroom=0.3 is ignored"):
        est = mk.estimate_memory(TINY, {"per_device_train_batch_size": 1}, seq_len=SEQ,
                                 device=cpu(), headroom=0.3, max_memory="4GiB")
    assert est.budget == 4 * GiB


def test_a_config_the_model_code_refuses_is_bad_input_not_a_traceback(tmp_path, capsys):
    """A Llama sequence classifier without pad_token_id cannot take batches > 1: transformers'
    own code raises while hf_memkit traces it, and that is the user's config, said as such."""
    from hf_memkit.commands.main import main

    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=500,
                      architectures=["LlamaForSequenceClassification"])
    cfg.save_pretrained(tmp_path)
    code = main(["plan", str(tmp_path), "--gpu", "cpu", "--seq-len", "32", "--target-batch", "4"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert "LlamaForSequenceClassification's own code refused" in err
    assert "no padding token" in err and "pad_token_id" in err


@pytest.mark.parametrize("problem", ["multi_label_classification", "regression"])
def test_sequence_classification_labels_follow_the_problem_type(problem):
    """The traced labels are what the model's loss reads for its problem_type (BCE on one float
    per label, MSE on one float per sequence): the real model takes them, and the estimate runs."""
    from transformers import BertConfig, BertForSequenceClassification

    from hf_memkit._model.tasks import TASKS

    cfg = BertConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, vocab_size=500, problem_type=problem,
                     num_labels=3 if problem == "multi_label_classification" else 1,
                     architectures=["BertForSequenceClassification"])
    batch = {"input_ids": torch.zeros(2, 16, dtype=torch.long),
             **TASKS.get("sequence-classification").labels_for(cfg, 2, 16, 16)}
    out = BertForSequenceClassification(cfg)(**batch)
    out.loss.backward()  # the real model accepts these labels
    assert torch.isfinite(out.loss)
    est = mk.estimate_memory(cfg, {"per_device_train_batch_size": 2}, seq_len=16, device="cpu")
    assert est.peak_allocated > 0


def test_adafactor_on_an_empty_parameter():
    """A zero-size weight (BERT with type_vocab_size=0) is not a ZeroDivisionError: transformers'
    Adafactor keeps exp_avg_sq_row of shape[:-1] (0 entries) and exp_avg_sq_col of shape[:-2] +
    shape[-1:] (64 entries) for it, so one token-type row more adds one fp32 row entry."""
    from transformers import BertConfig

    kw = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              vocab_size=500, architectures=["BertForSequenceClassification"])
    args = {"per_device_train_batch_size": 2, "optim": "adafactor"}
    empty = mk.estimate_memory(BertConfig(type_vocab_size=0, **kw), args, seq_len=16, device="cpu")
    one = mk.estimate_memory(BertConfig(type_vocab_size=1, **kw), args, seq_len=16, device="cpu")
    assert one.breakdown["optimizer"] - empty.breakdown["optimizer"] == 4


# -- apply_to onto any subclass; Plan.from_json checks what it reads (issue 28) -------------------


class OwnInit(TrainingArguments):
    """A user's subclass with its own ``__init__`` of another signature (not a dataclass's):
    ``dataclasses.replace`` cannot call it (TypeError: the required ``team`` is missing)."""

    def __init__(self, team: str, **kw):
        super().__init__(**kw)
        self.team = team


@dataclasses.dataclass
class WithState(TrainingArguments):
    """A subclass with a field the user sets after construction (``init=False``)."""

    run_tag: str = dataclasses.field(default="", init=False)


@pytest.fixture(scope="module")
def cpu_plan():
    return quiet_plan(TINY, device=cpu(), activation_checkpointing=True)


def _fields(args) -> dict:
    return {f.name: getattr(getattr(args, f.name), "value", getattr(args, f.name))
            for f in dataclasses.fields(args)}


def test_apply_to_a_subclass_with_its_own_init_and_init_false_fields(cpu_plan, tmp_path):
    own = OwnInit("vision", output_dir=str(tmp_path), use_cpu=True, seed=3)
    with pytest.raises(TypeError):          # what apply_to did before: replace calls __init__
        dataclasses.replace(own, per_device_train_batch_size=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = cpu_plan.apply_to(own)
    assert type(out) is OwnInit and out.team == "vision" and out.seed == 3
    # no planned field was set by the user: no "replaced" warning (defaults of the nearest
    # class that builds with output_dir alone, TrainingArguments)
    assert not [w for w in caught if "apply_to" in str(w.message)]
    stateful = WithState(output_dir=str(tmp_path), use_cpu=True)
    stateful.run_tag = "ablation-7"
    out2 = cpu_plan.apply_to(stateful)
    assert type(out2) is WithState and out2.run_tag == "ablation-7"
    assert dataclasses.replace(stateful).run_tag == ""   # replace resets it
    for out_ in (out, out2):
        for k, v in cpu_plan.training_args_kwargs.items():
            assert _fields(out_)[k] == v, k
        # derived as construction derives them: the old name mirrors the planned checkpointing
        assert out_.gradient_checkpointing is True and out_.device.type == "cpu"
    assert stateful.activation_checkpointing is False     # the user's object is unchanged


def test_apply_to_trl_config_equals_building_it_with_the_planned_fields(cpu_plan, tmp_path):
    """TRL's SFTConfig (a dataclass subclass with its own __post_init__): the copy re-derived
    by apply_to has every field a fresh construction with the planned values has."""
    require("trl")
    from trl import SFTConfig

    mine = SFTConfig(output_dir=str(tmp_path), use_cpu=True, packing=True, max_length=SEQ,
                     learning_rate=2e-5, report_to=[])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = cpu_plan.apply_to(mine)
        built = dataclasses.replace(mine, **{k: v for k, v in cpu_plan.training_args_kwargs.items()
                                             if k in _fields(mine)})
    assert type(out) is SFTConfig and _fields(out) == _fields(built)
    assert (out.packing, out.learning_rate) == (True, 2e-5)
    assert out.mixed_precision == built.mixed_precision


@pytest.mark.parametrize("tamper, words", [
    (lambda d: d["training_args_kwargs"].update(per_device_train_batch_size=-1),
     ["training_args_kwargs.per_device_train_batch_size", "-1", "positive integer"]),
    (lambda d: d["model_kwargs"].update(dtype="load"),
     ["model_kwargs.dtype", "'load'", "float32, float16, bfloat16, auto"]),
    (lambda d: d["model_kwargs"].update(attn_implementation="someone/hub-kernel"),
     ["model_kwargs.attn_implementation", "'someone/hub-kernel'", "eager, sdpa"]),
    (lambda d: d["model_kwargs"].update(trust_remote_code=True),
     ["model_kwargs.trust_remote_code", "allowed: attn_implementation, dtype"]),
    (lambda d: d.update(seq_len="128"), ["seq_len", "'128'", "positive integer"]),
    (lambda d: d.update(budgett=1), ["budgett", "unknown field", "did you mean `budget`"]),
    (lambda d: d["training_args_kwargs"].update(bf16="yes please"),
     ["training_args_kwargs.bf16", "'yes please'", "true/false"]),
    (lambda d: d["training_args_kwargs"].update(per_device_train_batch_size=1),
     ["training_args_kwargs.per_device_train_batch_size", "is not the chosen setup's",
      "plan_training(..., per_device_train_batch_size=1)"]),
    (lambda d: d["training_args_kwargs"].update(optim="adamw_nonsense"),
     ["training_args_kwargs", "adamw_nonsense"]),
    (lambda d: [c.update(chosen=False) for c in d["candidates"]],
     ["candidates: 0 are marked chosen", "exactly one"]),
    (lambda d: d["candidates"][0].update(micro_batch=0),
     ["candidates[0].micro_batch", "positive integer", "got 0"]),
    (lambda d: d.pop("budget"), ["missing field(s): budget"]),
])
def test_from_json_checks_what_it_reads(cpu_plan, tamper, words):
    import json

    d = json.loads(cpu_plan.to_json())
    tamper(d)
    with pytest.raises(mk.HfMemkitError) as err:
        mk.Plan.from_json(json.dumps(d))
    msg = str(err.value)
    assert "the plan JSON" in msg and "plan.to_json()" in msg      # the fix: make it again
    for w in words:
        assert w in msg, (w, msg)


def test_from_json_of_what_is_not_a_plan(cpu_plan):
    with pytest.raises(mk.HfMemkitError, match="does not parse.*plan.to_json"):
        mk.Plan.from_json("{not json")
    with pytest.raises(mk.HfMemkitError, match="expected a JSON object.*got list"):
        mk.Plan.from_json("[1, 2]")
    # both forms that to_json writes still load, and dtypes read back as torch dtypes
    for full in (True, False):
        back = mk.Plan.from_json(cpu_plan.to_json(full=full))
        assert back.training_args_kwargs == cpu_plan.training_args_kwargs
    bf16 = quiet_plan(TINY, device="A100-80GB", method="full", bf16=True, micro_batch=1)
    if "dtype" in bf16.model_kwargs:
        assert mk.Plan.from_json(bf16.to_json()).model_kwargs["dtype"] in (
            torch.float32, torch.float16, torch.bfloat16)


# -- a plan file is shared: it never says where the run's results go (issue 47) ------------------

@pytest.mark.parametrize("field, value", [
    ("push_to_hub", True), ("hub_model_id", "someone/stolen"), ("hub_token", "hf_secret123"),
    ("report_to", ["wandb"]), ("output_dir", "/tmp/elsewhere")])
def test_from_json_refuses_where_results_go(cpu_plan, field, value):
    import json

    d = json.loads(cpu_plan.to_json())
    d["training_args_kwargs"][field] = value
    with pytest.raises(mk.HfMemkitError) as err:
        mk.Plan.from_json(json.dumps(d))
    msg = str(err.value)
    assert f"training_args_kwargs.{field}:" in msg and "a plan file does not say where" in msg
    assert f"plan.to_training_args({field}=...)" in msg
    assert "hf_secret123" not in msg                         # a token is never echoed


def test_the_callers_output_dir_wins_and_a_plan_file_leaves_results_to_the_caller(tmp_path):
    p = quiet_plan(TINY, device=cpu(), output_dir=str(tmp_path / "planned"), report_to="wandb",
                   push_to_hub=True, hub_model_id="me/tiny")
    assert p.training_args_kwargs["output_dir"] == str(tmp_path / "planned")
    mine = str(tmp_path / "mine")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert p.to_training_args(output_dir=mine, use_cpu=True, report_to=[],
                                  push_to_hub=False).output_dir == mine
    # the file it writes holds none of them, and reads back without them
    for full in (True, False):
        d = p.to_dict(full=full)
        for k in ("output_dir", "report_to", "push_to_hub", "hub_model_id"):
            assert k not in d["training_args_kwargs"] and k not in \
                d["chosen"]["training_args_kwargs"]
    back = mk.Plan.from_json(p.to_json())
    args = back.to_training_args(output_dir=mine, use_cpu=True)
    assert (args.output_dir, args.push_to_hub, args.hub_model_id) == (mine, False, None)
    assert args.report_to in ([], "none", ["none"])
    # apply_to keeps where the user's own arguments send results
    own = TrainingArguments(output_dir=mine, use_cpu=True, report_to=[])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = p.apply_to(own)
    assert (out.output_dir, out.push_to_hub, out.report_to) == (mine, False, [])


def test_from_json_of_deeply_nested_text_is_a_clear_error():
    with pytest.raises(mk.HfMemkitError, match="nests too deep to read"):
        mk.Plan.from_json("[" * 100000 + "]" * 100000)
