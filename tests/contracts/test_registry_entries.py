"""Contracts every registry entry keeps, run over every entry (as peft runs its config tests over
every config class): a new technique, engine, trainer, method, optimizer, task or GPU is checked
here by being registered, with no test of its own needed for these rules.

* techniques: switched on by their fields, each changes the trace key (a new trace, never a
  cached one); what the planner emits for it reads back as on / off, and pins the same choice;
* engines: what each rung emits reads back as that rung's sharding, and a setup's sharding
  round-trips through ``to_dict``;
* trainers: the setup reads back its trainer, round-trips through ``to_dict``, and models only
  fields its config class has (``test_field_coverage`` classifies every other field);
* methods, optimizers, tasks, GPUs: the facts the planner and the CLI read are well-formed.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import pytest
import transformers

from hf_memkit._device.catalog import GPUS, lookup
from hf_memkit._engines import ENGINES, EmitContext, Sharding
from hf_memkit._errors import HfMemkitError
from hf_memkit._methods import METHODS, method_choices
from hf_memkit._model.tasks import TASKS
from hf_memkit._optimizers import OPTIMIZERS, TARGET_MODULES_ARG, OptimizerContext, ParamInfo
from hf_memkit._setup.fields import config_field_names
from hf_memkit._setup.setup import TrainingSetup, normalize_args
from hf_memkit._techniques import TECHNIQUES, Flag
from hf_memkit._trainers import TRAINERS
from tests.helpers import require

BASE = {"per_device_train_batch_size": 2}


def _read(args: dict[str, Any], **kw: Any) -> TrainingSetup:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # unmodelled techniques warn by design
        return normalize_args({**BASE, **args}, **kw)


def _merge(*emits: dict[str, Any]) -> dict[str, Any]:
    """Emitted fields merged as the planner merges them (dict values into dict values)."""
    out: dict[str, Any] = {}
    for e in emits:
        for k, v in e.items():
            out[k] = {**out[k], **v} if isinstance(v, dict) and isinstance(out.get(k), dict) \
                else v
    return out


def _switch_on(t: Any) -> dict[str, Any]:
    """The fields that switch ``t`` on: the planner's emit (with what it requires), or for a
    single-field flag a truthy value of that field."""
    if isinstance(t, Flag):
        return {t.name: 1}
    needed = [TECHNIQUES.get(n) for n in t.requires] + [t]
    return _merge(*(r.emit(True, {}) for r in sorted(needed, key=lambda r: r.ladder)))


@pytest.mark.parametrize("name", TECHNIQUES.names())
def test_a_technique_switched_on_changes_the_trace_key(name):
    t = TECHNIQUES.get(name)
    on = _read(_switch_on(t))
    assert on.uses(name) is not None, f"{name}: its own fields do not switch it on"
    assert on.trace_key() != _read({}).trace_key()
    assert t.fields and t.what, f"{name}: say which fields switch it on and what it changes"


@pytest.mark.parametrize("name", [t.name for t in TECHNIQUES if t.searched])
def test_a_searched_technique_round_trips_emit_and_read(name):
    t = TECHNIQUES.get(name)
    emitted_on = _switch_on(t)
    emitted_off = _merge(*(TECHNIQUES.get(n).emit(True, {}) for n in t.requires),
                         t.emit(False, {}))
    assert _read(emitted_on).uses(name) is not None
    assert _read(emitted_off).uses(name) is None
    # a plan's arguments given back as the user's pins pin the same choice
    assert t.pinned(emitted_on) is True and t.pinned(emitted_off) is False


def _rungs():
    return [(e.name, r) for e in ENGINES for r in e.rungs()]


@pytest.mark.parametrize(("engine", "rung"), _rungs(), ids=[r.name for _, r in _rungs()])
def test_what_an_engine_emits_reads_back_as_its_rung(engine, rung):
    precision = (rung.precisions or ("bf16",))[0]
    ctx = EmitContext(ranks=4, micro_batch=2, grad_accum=2, precision=precision,
                      checkpointing=True, hidden=64, layer_class="LlamaDecoderLayer",
                      max_grad_norm=1.0, dims=rung.dims.over(4))
    emitted = ENGINES.get(engine).emit(rung, ctx)
    setup = _read({**emitted, precision: True, "gradient_accumulation_steps": 2}, num_gpus=4)
    sh = setup.sharding
    assert (sh.engine, sh.world_size) == (engine, 4)
    if rung.stage:
        assert sh.stage == rung.stage
    assert (sh.offload_params, sh.offload_optimizer) == (rung.offload_params,
                                                         rung.offload_optimizer)
    assert setup.engine is ENGINES.get(engine) and rung.label and sh.label()
    assert Sharding(**sh.to_dict()) == sh


@pytest.mark.parametrize("name", TRAINERS.names())
def test_a_trainer_reads_back_and_round_trips(name):
    kind = TRAINERS.get(name)
    if kind.extra:
        require(kind.extra)
    setup = _read({}, trainer=name)
    assert setup.trainer_kind is kind
    assert TrainingSetup.from_dict(setup.to_dict()) == setup
    assert kind.modelled_fields() <= config_field_names(kind.config_type())
    shape = kind.shape(setup.trainer_options, 2, 16)
    assert shape.rows >= 2 and shape.tokens >= 16


@pytest.mark.parametrize("name", METHODS.names())
def test_a_method_is_reachable_and_describes_its_own_models(name):
    m = METHODS.get(name)
    assert set(m.selected_by) - {"auto"} <= set(method_choices())
    assert m.describes(m.adapters, m.quant_bits)
    assert (m.peft_config("causal-lm") is not None) == m.adapters


PARAMS = [ParamInfo(64 * 32, (64, 32), 4, linear="model.layers.0.mlp.up_proj"),
          ParamInfo(64, (64,), 4)]


@pytest.mark.parametrize("name", OPTIMIZERS.names())
@pytest.mark.parametrize("device_kind", ["cuda", "cpu"])
def test_an_optimizer_states_its_memory_or_refuses_the_device(name, device_kind):
    """Its state and step temporaries on the device (a CUDA-only optimizer refuses a CPU by
    name, never with a bare error), and the facts the planner and accelerate read."""
    p = OPTIMIZERS.get(name)
    ctx = OptimizerContext(device_kind=device_kind,  # GaLore / APOLLO read optim_target_modules
                           optim_args={TARGET_MODULES_ARG: '["up_proj"]'})
    try:
        mem = p.estimate(PARAMS, ctx)
    except HfMemkitError as exc:
        assert device_kind != "cuda" and f"`{name}`" in str(exc)
    else:
        assert mem.state >= 0 and mem.transient >= 0
    assert p.source and p.step_cost > 0 and p.accelerate_recipe()["class"]


@pytest.mark.parametrize("name", TASKS.names())
def test_a_task_names_a_real_head_and_batched_labels(name):
    task = TASKS.get(name)
    assert hasattr(transformers, task.auto_class)
    for v in task.labels_for(None, 3, 16, 8).values():
        assert v.shape[0] == 3


@pytest.mark.parametrize("name", GPUS.names())
def test_a_gpu_is_found_by_its_names(name):
    spec = GPUS.get(name)
    assert all(lookup(a) is spec for a in (spec.name, *spec.aliases))
    assert spec.memory > 0 and spec.memory_bandwidth > 0
    assert all(f.name for f in dataclasses.fields(spec))
