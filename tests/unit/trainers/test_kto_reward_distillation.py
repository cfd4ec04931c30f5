"""TRL's KTOTrainer, RewardTrainer and DistillationTrainer as registered trainers (issue 44, item
6): detected from their configs, their batches, reference / teacher models and refusals as TRL
1.16's trainers have them. The checks against real runs of the trainers, measured
independently, are in tests/integration/test_trl_measured_more.py."""

from __future__ import annotations

import warnings

import pytest

from tests.helpers import require

require("trl")

import trl  # noqa: E402
from transformers import LlamaConfig  # noqa: E402

import hf_memkit as mk  # noqa: E402
from hf_memkit._errors import ConfigError, HfMemkitError  # noqa: E402
from hf_memkit._trainers import trainer_of_args  # noqa: E402

CFG = LlamaConfig(hidden_size=128, intermediate_size=344, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=32000,
                  tie_word_embeddings=False)
RM = LlamaConfig(**{**{k: v for k, v in CFG.to_dict().items() if k not in ("id2label", "label2id")},
                    "num_labels": 1, "pad_token_id": 0})
FP32 = dict(bf16=False, gradient_checkpointing=False)


def _est(args, cfg=CFG, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return mk.estimate_memory(cfg, args, device="cpu", **kw)


@pytest.mark.parametrize("cls,kind", [(trl.KTOConfig, "kto"), (trl.RewardConfig, "reward"),
                                      (trl.DistillationConfig, "distillation")])
def test_the_configs_name_their_trainers(cls, kind, tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = cls(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    assert trainer_of_args(args) == kind
    assert trainer_of_args({}, kind) == kind


def test_trainers_still_not_modelled_are_refused_without_naming_the_new_ones():
    with pytest.raises(HfMemkitError) as exc:
        trainer_of_args({}, "orpo")
    text = str(exc.value)
    assert "ORPOTrainer" in text and "'kto' (KTOTrainer)" in text
    assert "KTO and" not in text and "online DPO, PPO" in text


def test_kto_reference_follows_ktotrainer():
    """KTOTrainer.__init__: a frozen copy without PEFT, the PEFT policy's adapters disabled,
    none with precompute_ref_log_probs; a user's ref_model is a copy."""
    import peft

    args = dict(per_device_train_batch_size=2, max_length=128, **FP32)
    weights = mk.profile_model(CFG).param_bytes
    copy = _est(args, trainer="kto")
    pre = _est({**args, "precompute_ref_log_probs": True}, trainer="kto")
    lora = _est(args, trainer="kto", peft_config=peft.LoraConfig(r=8, target_modules=["q_proj"]))
    assert copy.breakdown["weights"] - pre.breakdown["weights"] == pre.breakdown["weights"]
    assert weights <= pre.breakdown["weights"] < weights * 1.001
    assert lora.breakdown["weights"] < weights * 1.01
    own = _est({**args, "precompute_ref_log_probs": True}, trainer="kto", ref_model=True)
    assert own.breakdown["weights"] == copy.breakdown["weights"]


def test_kto_feeds_one_row_per_example_where_dpo_feeds_two():
    args = dict(per_device_train_batch_size=4, max_length=128, precompute_ref_log_probs=True,
                **FP32)
    kto = _est(args, trainer="kto")
    dpo2 = _est({**args, "per_device_train_batch_size": 2}, trainer="dpo")
    assert kto.breakdown["activations"] == pytest.approx(dpo2.breakdown["activations"], rel=0.02)
    assert any("KL row" in n for n in kto.notes)


def test_kto_refuses_what_ktotrainer_refuses():
    with pytest.raises(ConfigError, match="micro-batch of 1"):
        _est(dict(per_device_train_batch_size=1, max_length=64), trainer="kto")
    _est(dict(per_device_train_batch_size=1, max_length=64, loss_type="apo_zero_unpaired"),
         trainer="kto")
    with pytest.raises(ConfigError, match="train_sampling_strategy='random'"):
        _est(dict(per_device_train_batch_size=2, max_length=64,
                  train_sampling_strategy="random"), trainer="kto")


def test_reward_stacks_chosen_and_rejected_rows_of_a_one_output_classifier():
    args = dict(max_length=128, **FP32)
    rm2 = _est({**args, "per_device_train_batch_size": 2}, RM, trainer="reward",
               task="sequence-classification")
    plain4 = _est({"per_device_train_batch_size": 4, **FP32}, RM, seq_len=128,
                  task="sequence-classification")
    # 2 pairs = 4 rows: a plain Trainer's step over 4 rows of the same classifier, padded
    assert rm2.breakdown["activations"] == pytest.approx(plain4.breakdown["activations"],
                                                         rel=0.05)
    assert rm2.seq_len == 128                  # max_length: the longest row kept
    assert any("chosen and a rejected row" in n for n in rm2.notes)


def test_reward_refuses_a_model_rewardtrainer_refuses():
    args = dict(per_device_train_batch_size=2, max_length=64, **FP32)
    with pytest.raises(HfMemkitError, match="task='sequence-classification'"):
        _est(args, trainer="reward")                          # a causal LM
    with pytest.raises(HfMemkitError, match="num_labels=2"):
        _est(args, LlamaConfig(**{**CFG.to_dict(), "pad_token_id": 0}), trainer="reward",
             task="sequence-classification")


def test_distillation_holds_the_teacher_and_generates():
    import peft

    args = dict(per_device_train_batch_size=2, max_completion_length=32, **FP32)
    weights = mk.profile_model(CFG).param_bytes
    e = _est(args, trainer="distillation", seq_len=32)
    assert {"generate (prefill)", "generate (decode)", "forward", "backward"} <= \
        set(e.phase_peaks)
    # the teacher: a second copy of the student's weights (DistillationTrainer keeps it)
    assert 2 * weights <= e.breakdown["weights"] < 2 * weights * 1.001
    lora = _est(args, trainer="distillation", seq_len=32,
                peft_config=peft.LoraConfig(r=8, target_modules=["q_proj"]))
    assert 2 * weights <= lora.breakdown["weights"] < 2 * weights * 1.01
    assert any("teacher" in n for n in e.notes)


def test_distillation_generates_the_accumulated_prompts_at_once():
    """_prepare_inputs: one generation of per_device_train_batch_size x
    gradient_accumulation_steps prompts, then micro-steps over its slices."""
    base = dict(per_device_train_batch_size=2, max_completion_length=32, **FP32)
    one = _est(base, trainer="distillation", seq_len=32)
    four = _est({**base, "gradient_accumulation_steps": 4}, trainer="distillation", seq_len=32)
    kv = lambda e: e.phase_peaks["generate (decode)"] - e.phase_peaks["generate (prefill)"]  # noqa: E731
    assert four.phase_peaks["generate (decode)"] > one.phase_peaks["generate (decode)"]
    assert kv(four) > 2 * kv(one)


def test_distillation_refuses_a_beta_outside_zero_one():
    with pytest.raises(ConfigError, match="beta"):
        _est(dict(per_device_train_batch_size=2, max_completion_length=16, beta=1.5),
             trainer="distillation", seq_len=16)


def test_distillation_on_cuda_projects_tiles_without_cpu_temporaries(monkeypatch):
    """On CUDA, TRL's divergence folds are Triton kernels working in place and a bf16
    projection writes its fp32 tile directly (``divergence_fold``); traced with the CPU path
    instead, each projection also holds an fp32 copy of its bf16 weight chunk ([vocab x
    hidden] here: one chunk) and the folds' fp32 tile temporaries."""
    import contextlib

    from hf_memkit._trainers.distillation import DistillStep

    args = dict(per_device_train_batch_size=2, max_completion_length=64, bf16=True,
                gradient_checkpointing=False)

    def cuda():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return mk.estimate_memory(CFG, args, device="H100-80GB", trainer="distillation",
                                      seq_len=64)

    fold = cuda()
    monkeypatch.setattr(DistillStep, "kernels", lambda self, target: contextlib.nullcontext())
    cpu_path = cuda()
    fp32_chunk = CFG.vocab_size * CFG.hidden_size * 4
    assert cpu_path.phase_peaks["backward"] - fold.phase_peaks["backward"] >= fp32_chunk


def test_distillation_completion_len_is_the_longest_completion_generated():
    """TRL pads a generation batch's completions to its longest and generates until every row
    stops: a longest completion of 16 under a cap of 64 is the step of a cap of 16."""
    base = dict(per_device_train_batch_size=2, **FP32)
    given = _est({**base, "max_completion_length": 64}, trainer="distillation", seq_len=32,
                 completion_len=16)
    capped = _est({**base, "max_completion_length": 16}, trainer="distillation", seq_len=32)
    assert given.peak_allocated == capped.peak_allocated
    assert "estimated at 16, the longest completion given" in given.notes[0]
