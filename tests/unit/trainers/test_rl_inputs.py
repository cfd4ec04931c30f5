"""GRPO / RLOO fields that TRL (or vLLM, or the trace) refuses are refused before anything is
traced, all at once, naming TRL's rule (issue "GRPO/RLOO plans what TRL refuses"): fewer than
2 generations, a generation batch that splits a prompt's group, generation_batch_size beside
steps_per_generation, completion lengths out of range, vLLM's share outside (0, 1], counts
below 1. The planner keeps to per-device batches TRL accepts instead of refusing the user."""

from __future__ import annotations

import warnings

import pytest

from tests.helpers import require

trl = require("trl")

import hf_memkit as mk  # noqa: E402
import hf_memkit._estimate.activations as activations  # noqa: E402
import hf_memkit._estimate.assemble as assemble  # noqa: E402
from hf_memkit._errors import ConfigError  # noqa: E402
from hf_memkit.commands.main import main  # noqa: E402
from tests.unit.trainers.test_sft_and_dpo import CFG, FP32  # noqa: E402

RL = dict(per_device_train_batch_size=2, num_generations=2, max_completion_length=32, **FP32)
PLAN = dict(seq_len=48, device="cpu", trainer="grpo", max_completion_length=32, **FP32)


def _no_trace(mp: pytest.MonkeyPatch) -> None:
    """Any trace of the model fails the test: the checks come before it."""
    def trace(*a, **kw):
        raise AssertionError("traced the model before refusing the inputs")

    mp.setattr(activations, "trace_excess", trace)
    mp.setattr(assemble, "trace_excess", trace)


@pytest.fixture
def untraced(monkeypatch):
    _no_trace(monkeypatch)


def _est(args, *, trainer="grpo", **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return mk.estimate_memory(CFG, args, seq_len=48, device="cpu", trainer=trainer, **kw)


def _plan(**kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return mk.plan_training(CFG, **{**PLAN, **kw})


def _refused(call, *says) -> ConfigError:
    with pytest.raises(ConfigError) as exc:
        call()
    for s in says:
        assert s in str(exc.value), (s, str(exc.value))
    return exc.value


# -- estimate_memory ---------------------------------------------------------------------------

@pytest.mark.parametrize("trainer,g", [("grpo", 0), ("grpo", 1), ("grpo", -8), ("rloo", 1)])
def test_fewer_than_two_generations_are_refused(untraced, trainer, g):
    config = "GRPOConfig" if trainer == "grpo" else "RLOOConfig"
    _refused(lambda: _est({**RL, "num_generations": g}, trainer=trainer),
             f"`num_generations` must be an integer >= 2, got {g}",
             f"{config} refuses fewer than 2 generations per prompt")


def test_a_generation_batch_that_splits_a_group_is_refused_with_trls_rule():
    with pytest.MonkeyPatch.context() as mp:
        _no_trace(mp)
        err = _refused(
            lambda: _est({**RL, "per_device_train_batch_size": 3, "num_generations": 8}),
            "generation_batch_size (3) must be divisible by num_generations (8)",
            "per_device_train_batch_size 3 x 1 process(es) x 1", "multiple of 8")
    assert len(err.problems) == 1
    # 3 rows x 2 processes x 4 accumulation steps: a generation batch of 24, whole groups of 8
    e = _est({**RL, "per_device_train_batch_size": 3, "num_generations": 8,
              "gradient_accumulation_steps": 4}, num_gpus=2)
    assert any(n.startswith("generation: 12 rows") for n in e.notes), e.notes


@pytest.mark.parametrize("extra,says", [
    (dict(generation_batch_size=4, steps_per_generation=2),
     ["generation_batch_size=4 and steps_per_generation=2 are both set",
      "can not be both configured at the same time"]),
    (dict(generation_batch_size=3),          # 2 rows x 1 process do not divide it, nor does 2
     ["generation_batch_size (3) must be divisible by the global batch size (2)",
      "generation_batch_size (3) must be divisible by num_generations (2)"]),
    (dict(steps_per_generation=1, num_generations=4),
     ["generation_batch_size (2) must be divisible by num_generations (4)",
      "x 1 (steps_per_generation)"]),
])
def test_grpoconfigs_generation_batch_rules(untraced, extra, says):
    _refused(lambda: _est({**RL, **extra}), *says)


@pytest.mark.parametrize("length", [10**12, 2**24 + 1, 0, -1, None])
def test_a_completion_length_out_of_range_is_refused(untraced, length):
    _refused(lambda: _est({**RL, "max_completion_length": length}),
             "`max_completion_length` must be a positive number of tokens, at most 16777216",
             f"got {length!r}")


@pytest.mark.parametrize("share", [0, -0.5, 1.5])
def test_vllm_share_outside_zero_one_is_refused(untraced, share):
    _refused(lambda: _est({**RL, "use_vllm": True, "vllm_gpu_memory_utilization": share}),
             "`vllm_gpu_memory_utilization` must be a fraction of the GPU's memory in (0, 1]")


@pytest.mark.parametrize("name,value", [("num_iterations", 0), ("steps_per_generation", 0),
                                        ("generation_batch_size", -4),
                                        ("vllm_tensor_parallel_size", 0),
                                        ("vllm_max_model_length", 0)])
def test_counts_below_one_are_refused(untraced, name, value):
    _refused(lambda: _est({**RL, name: value}),
             f"`{name}` must be a positive integer", f"got {value}")


def test_every_problem_is_said_at_once(untraced):
    err = _refused(lambda: _est({**RL, "num_generations": 1, "max_completion_length": 0,
                                 "vllm_gpu_memory_utilization": 0, "num_iterations": 0}))
    assert [p.split("`")[1] for p in err.problems] == [
        "num_generations", "max_completion_length", "vllm_gpu_memory_utilization",
        "num_iterations"]


def test_a_config_instance_is_checked_too(untraced):
    """A GRPOConfig has run its own __post_init__ (both derived fields set, no refusal of
    that), but not the rules TRL leaves to later: those are refused on the instance, bools
    included."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = trl.GRPOConfig(output_dir="unused", use_cpu=True, report_to=[], **RL)
    args.max_completion_length, args.vllm_gpu_memory_utilization = 0, True
    args.num_iterations = 0
    err = _refused(lambda: _est(args), "got 0", "got True (bool)")
    assert len(err.problems) == 3


# -- plan_training -----------------------------------------------------------------------------

def test_the_plan_refuses_bad_fields_at_once_and_alone(untraced):
    err = _refused(lambda: _plan(target_batch_size=8, num_generations=1,
                                 max_completion_length=0),
                   "`num_generations` must be an integer >= 2",
                   "`max_completion_length` must be a positive number of tokens")
    assert len(err.problems) == 2


def test_a_colocated_vllm_share_of_zero_is_refused_before_planning(untraced):
    err = _refused(lambda: mk.plan_training(
        CFG, seq_len=64, target_batch_size=16, trainer="grpo", use_vllm=True,
        max_completion_length=64, num_generations=8, device="RTX-4090",
        vllm_gpu_memory_utilization=0), "`vllm_gpu_memory_utilization` must be")
    assert "server mode" not in str(err) and len(err.problems) == 1


@pytest.mark.parametrize("pins,says", [
    (dict(generation_batch_size=6, num_generations=4),
     "generation_batch_size (6) must be divisible by num_generations (4)"),
    (dict(generation_batch_size=8, steps_per_generation=2, num_generations=4),
     "are both set"),
    (dict(per_device_train_batch_size=3, steps_per_generation=1, num_generations=8),
     "generation_batch_size (3) must be divisible by num_generations (8)"),
])
def test_a_plan_refuses_pins_trl_refuses(untraced, pins, says):
    target = 24 if pins.get("per_device_train_batch_size") == 3 else 8
    _refused(lambda: _plan(target_batch_size=target, **pins), says)


def test_the_plan_searches_only_per_device_batches_trl_accepts():
    """generation_batch_size=4 pinned: TRL needs per-device batch x processes to divide it, so
    of the divisors of 8 only 1, 2 and 4 are searched (8 would be chosen otherwise)."""
    plan = _plan(target_batch_size=8, num_generations=4, generation_batch_size=4)
    assert plan.training_args_kwargs["per_device_train_batch_size"] in (1, 2, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = plan.to_training_args(output_dir="unused", use_cpu=True, report_to=[])
    assert isinstance(args, trl.GRPOConfig) and args.generation_batch_size == 4  # TRL takes it


def test_a_pinned_steps_per_generation_decides_the_groups_not_the_target():
    """steps_per_generation=3: the generation batch is per-device batch x 3, so a target of 4
    with groups of 6 is planned (per-device batch 2 or 4), not refused."""
    plan = _plan(target_batch_size=4, num_generations=6, steps_per_generation=3)
    kw = plan.training_args_kwargs
    assert kw["per_device_train_batch_size"] * 3 % 6 == 0


# -- the command line --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("tiny_llama")
    CFG.save_pretrained(d)
    return str(d)


@pytest.mark.parametrize("argv,says", [
    (["estimate", "--batch", "3", "num_generations=8"],
     "generation_batch_size (3) must be divisible by num_generations (8)"),
    (["estimate", "--batch", "2", "num_generations=1"], "`num_generations` must be"),
    (["estimate", "--batch", "2", "max_completion_length=-1"], "`max_completion_length`"),
    (["plan", "--target-batch", "8", "vllm_gpu_memory_utilization=0"],
     "`vllm_gpu_memory_utilization` must be"),
    (["plan", "--target-batch", "8", "num_iterations=0"], "`num_iterations` must be"),
])
def test_the_cli_exits_2_naming_the_rule(untraced, model_dir, capsys, argv, says):
    cmd, *rest = argv
    length = [] if any(a.startswith("max_completion_length=") for a in rest) else \
        ["max_completion_length=32"]
    assert main([cmd, model_dir, "--gpu", "cpu", "--trainer", "grpo", "--seq-len", "48",
                 *length, *rest]) == 2
    assert says in capsys.readouterr().err
