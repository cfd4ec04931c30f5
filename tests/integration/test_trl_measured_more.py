"""TRL's KTOTrainer, RewardTrainer and DistillationTrainer estimated as they run, checked against
real runs of the TRL trainers measured independently (``hf_memkit.testing.groundtruth``, RSS
method, in a child process; the trainers built by ``hf_memkit.testing.groundtruth_pref``): the
median error over a few shapes within 3%, each within 5% (the bar of
``bench/estimator_trl.py``)."""

from __future__ import annotations

import statistics
import warnings

from tests.helpers import require

require("trl")
require("peft")

import hf_memkit as mk  # noqa: E402
from hf_memkit.testing.groundtruth import measure_trainer_peak  # noqa: E402
from tests.unit.trainers.test_sft_and_dpo import CFG, FP32  # noqa: E402

LORA = dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
RM_TASK = "sequence-classification"
RM = {**{k: v for k, v in CFG.to_dict().items() if k not in ("id2label", "label2id")},
      "num_labels": 1, "pad_token_id": 0}


def _errors(kind: str, shapes: list[tuple[dict, int, dict]], *, config: dict | None = None,
            task: str | None = None) -> list[tuple[float, int, int]]:
    """(relative error, estimate, measured) of each ``(args, seq_len, extra)`` shape: the
    estimate of ``kind`` beside a real run of the TRL trainer."""
    import peft
    from transformers import LlamaConfig

    config = config or CFG.to_dict()
    out = []
    for args, seq, extra in shapes:
        lora = extra.get("lora")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            e = mk.estimate_memory(LlamaConfig(**config), args, device="cpu", trainer=kind,
                                   task=task, peft_config=peft.LoraConfig(**lora) if lora else None,
                                   seq_len=extra.get("estimate_seq", seq))
        spec = {"config": config, "args": args, "seq_len": seq, "trainer": kind, "lora": lora,
                **({"task": task} if task else {})}
        m = measure_trainer_peak(spec)
        out.append((e.peak_allocated / m["peak"] - 1, e.peak_allocated, m["peak"]))
    return out


def _assert_bar(errors: list[tuple[float, int, int]]) -> None:
    errs = [abs(err) for err, _, _ in errors]
    assert statistics.median(errs) < 0.03, errors
    assert max(errs) < 0.05, errors


def test_kto_estimates_match_real_kto_trainer_runs():
    """A frozen reference copy and precomputed reference log-probs (none held); the PEFT
    policy's adapters as the reference are measured by bench/estimator_trl.py."""
    errors = _errors("kto", [
        (dict(per_device_train_batch_size=2, max_length=128, **FP32), 128, {}),
        (dict(per_device_train_batch_size=2, max_length=256, precompute_ref_log_probs=True,
              **FP32), 256, {})])
    _assert_bar(errors)
    # the copy's weights matter: without them the first estimate would be 8% under
    weights = mk.profile_model(CFG).param_bytes
    err, est, measured = errors[0]
    assert (est - weights) / measured - 1 < -0.05


def test_reward_estimates_match_real_reward_trainer_runs():
    """fp32 and a LoRA classifier (bf16 with checkpointing: bench/estimator_trl.py)."""
    errors = _errors("reward", [
        (dict(per_device_train_batch_size=2, max_length=128, **FP32), 128, {}),
        (dict(per_device_train_batch_size=4, max_length=128, **FP32), 128,
         {"lora": {**LORA, "task_type": "SEQ_CLS"}})], config=RM, task=RM_TASK)
    _assert_bar(errors)


def test_distillation_estimates_match_real_distillation_trainer_runs():
    """The student generates (its KV cache), then trains against a teacher it holds: a JSD
    (beta 0.5: two passes over the tiles) with accumulation, and reverse KL (the default)."""
    errors = _errors("distillation", [
        (dict(per_device_train_batch_size=2, max_completion_length=32, **FP32), 32, {}),
        (dict(per_device_train_batch_size=2, gradient_accumulation_steps=2,
              max_completion_length=16, beta=0.5, **FP32), 32, {})])
    _assert_bar(errors)
    weights = mk.profile_model(CFG).param_bytes
    err, est, measured = errors[0]
    assert (est - weights) / measured - 1 < -0.10     # the teacher's weights are held
