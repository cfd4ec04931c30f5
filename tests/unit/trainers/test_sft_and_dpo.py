"""TRL trainers (issue #14): SFTTrainer and DPOTrainer estimated as they run (reference model,
chosen + rejected rows, padding-free, CUDA tiles, refusals, plans onto SFTConfig). The checks
against real TRL runs measured independently are in tests/integration/test_trl_measured.py."""

from __future__ import annotations

import warnings

import pytest

from tests.helpers import require

require("trl")

import trl  # noqa: E402
from transformers import LlamaConfig  # noqa: E402

import hf_memkit as mk  # noqa: E402
from hf_memkit._errors import HfMemkitError  # noqa: E402

CFG = LlamaConfig(hidden_size=128, intermediate_size=344, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=32000,
                  tie_word_embeddings=False)
FP32 = dict(bf16=False, gradient_checkpointing=False)


def _est(args, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return mk.estimate_memory(CFG, args, device="cpu", **kw)


def test_dpo_reference_model_weights_follow_dpotrainer():
    import peft

    args = dict(per_device_train_batch_size=1, max_length=128, **FP32)
    weights = mk.profile_model(CFG).param_bytes
    copy = _est(args, trainer="dpo")
    pre = _est({**args, "precompute_ref_log_probs": True}, trainer="dpo")
    lora = _est(args, trainer="dpo", peft_config=peft.LoraConfig(r=8, target_modules=["q_proj"]))
    # the copy: the policy's weights (and buffers) once more
    assert copy.breakdown["weights"] - pre.breakdown["weights"] == pre.breakdown["weights"]
    assert weights <= pre.breakdown["weights"] < weights * 1.001
    assert copy.peak_allocated - pre.peak_allocated >= weights
    assert lora.breakdown["weights"] < weights * 1.01   # the adapters disabled: no copy
    assert any("reference model" in n for n in copy.notes)
    # a user's own ref_model is held even with precompute_ref_log_probs
    own = _est({**args, "precompute_ref_log_probs": True}, trainer="dpo", ref_model=True)
    assert own.breakdown["weights"] == copy.breakdown["weights"]


def test_dpo_micro_batch_is_chosen_plus_rejected_rows():
    args = dict(max_length=128, **FP32)
    dpo = _est({**args, "per_device_train_batch_size": 2}, trainer="dpo")
    sft4 = _est({**args, "per_device_train_batch_size": 4}, trainer="sft")
    # 2 examples = 4 rows: at least the activations of SFT's 4 rows
    assert dpo.breakdown["activations"] >= 0.9 * sft4.breakdown["activations"]


def test_sft_config_instance_and_dict_defaults_agree():
    """SFTConfig turns bf16 and checkpointing on in __post_init__: a dict of its fields with
    trainer='sft' gets the same defaults."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = trl.SFTConfig(output_dir="unused", use_cpu=True, per_device_train_batch_size=2,
                            max_length=128)
    a = _est(cfg)
    b = _est({"per_device_train_batch_size": 2, "max_length": 128}, trainer="sft")
    assert a.setup.amp == b.setup.amp == "bf16"
    assert a.setup.checkpointing and b.setup.checkpointing
    assert a.peak_allocated == b.peak_allocated


def test_padding_free_counts_tokens_not_padded_rows():
    args = dict(per_device_train_batch_size=4, max_length=None, **FP32)
    free = _est({**args, "padding_free": True}, trainer="sft", seq_len=128)
    padded = _est(args, trainer="sft", seq_len=128)
    assert free.setup.trainer.option("padding_free")
    assert any("padding-free" in n for n in free.notes)
    # one row of 512 tokens carries the same activations as 4 rows of 128, to a few percent
    assert free.peak_allocated == pytest.approx(padded.peak_allocated, rel=0.05)
    # packing with the bfd strategy turns padding-free on, as SFTTrainer does
    packed = _est({**args, "max_length": 128, "packing": True}, trainer="sft")
    assert packed.setup.trainer.option("padding_free")


def test_cuda_target_folds_tiles_without_fp32_temporaries():
    """On CUDA TRL's Triton kernels fold each tile in place: the SFT head's peak is far below
    the CPU fold's, whose torch ops create fp32 [tokens x vocab] temporaries; and below the
    plain Trainer's full logits (the error flips sign, as the issue says)."""
    args = dict(per_device_train_batch_size=4, max_length=512, **FP32)
    cpu = _est(args, trainer="sft")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cuda = mk.estimate_memory(CFG, args, device="A100-80GB", trainer="sft")
        plain = mk.estimate_memory(CFG, {k: v for k, v in args.items() if k != "max_length"},
                                   seq_len=512, device="A100-80GB")
    tile = 4 * 511 * 32000 * 4       # one fp32 [tokens x vocab] tile
    assert cpu.peak_allocated - cuda.peak_allocated > 2 * tile
    assert cuda.peak_allocated < plain.peak_allocated
    from trl.kernels import chunked_logprob as cl

    assert cl._forward_tile.__name__ == "_forward_tile"   # the emulation is undone


def _orpo_config():
    from trl.experimental.orpo import ORPOConfig

    return ORPOConfig(output_dir="unused", use_cpu=True)


@pytest.mark.parametrize("make", [_orpo_config, lambda: "orpo", lambda: "online_dpo"])
def test_unmodelled_trl_trainers_are_refused_by_name(make):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        arg = make()
    kw = {"trainer": arg} if isinstance(arg, str) else {}
    with pytest.raises(HfMemkitError) as exc:
        _est(arg if not isinstance(arg, str) else None, seq_len=64, **kw)
    msg = str(exc.value)
    assert "not modelled" in msg and "'sft'" in msg and "'dpo'" in msg
    assert ("ORPO" in msg) or ("OnlineDPO" in msg)
    assert "'grpo'" in msg and "'rloo'" in msg   # modelled ones are listed


def test_seq_len_is_required_without_max_length_and_ref_model_only_for_dpo():
    with pytest.raises(HfMemkitError, match="seq_len is required"):
        _est({"per_device_train_batch_size": 1})
    with pytest.raises(HfMemkitError, match="ref_model is a DPOTrainer / KTOTrainer setting"):
        _est({"max_length": 64}, trainer="sft", ref_model=True)
    with pytest.raises(HfMemkitError, match="not a SFTConfig field"):
        _est({"max_lenght": 64}, trainer="sft")


def test_plan_for_sft_applies_onto_a_users_sft_config():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = mk.plan_training(CFG, seq_len=256, target_batch_size=4, device="cpu",
                                trainer="sft", max_memory="2GiB")
        user = trl.SFTConfig(output_dir="mine", use_cpu=True, packing=True,
                             learning_rate=1e-5)
        out = plan.apply_to(user)
        built = plan.to_training_args(output_dir="built")
    assert plan.estimate.setup.trainer.name == "sft"
    assert type(out) is trl.SFTConfig and type(built) is trl.SFTConfig
    assert out.packing and out.learning_rate == 1e-5 and out.output_dir == "mine"
    assert out.max_length == 256 == built.max_length
    assert out.per_device_train_batch_size == plan.training_args_kwargs[
        "per_device_train_batch_size"]


def test_adapters_keep_the_dtype_of_the_peft_model_given():
    """A peft model whose adapters are already bf16 (``autocast_adapter_dtype=False``, or TRL
    having cast them) is estimated with bf16 adapter states, as the real model holds them."""
    import peft
    import torch
    from transformers import LlamaForCausalLM

    base = LlamaForCausalLM(CFG).to(torch.bfloat16)
    cfg = peft.LoraConfig(r=16, target_modules=["q_proj", "v_proj"])
    own = peft.get_peft_model(base, cfg, autocast_adapter_dtype=False)
    real = sum(p.nbytes for p in own.parameters() if p.requires_grad)
    assert {p.dtype for p in own.parameters() if p.requires_grad} == {torch.bfloat16}
    args = dict(per_device_train_batch_size=1, **FP32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mine = mk.estimate_memory(own, args, seq_len=64, device="cpu")
        fresh = mk.estimate_memory(LlamaForCausalLM(CFG).to(torch.bfloat16), args, seq_len=64,
                                   device="cpu", peft_config=cfg)  # peft's default: fp32
    # fp32 adapters hold twice the bytes: in the weights, and in AdamW's two moments
    assert fresh.breakdown["weights"] - mine.breakdown["weights"] == real
    assert fresh.breakdown["optimizer"] - mine.breakdown["optimizer"] == 2 * real


def test_zero3_lora_on_a_16bit_base_keeps_adapters_in_its_dtype():
    """TRL wraps a 16-bit base with ``autocast_adapter_dtype=False`` under ZeRO-3: the estimate
    trains the adapters in bf16, as the real peft call makes them."""
    import peft
    import torch
    from transformers import LlamaForCausalLM

    from hf_memkit._estimate.phases import trained_spec
    from hf_memkit._model.spec import resolve_model
    from hf_memkit._setup.setup import normalize_args

    cfg = peft.LoraConfig(r=16, target_modules=["q_proj", "v_proj"])
    real = peft.get_peft_model(LlamaForCausalLM(CFG).to(torch.bfloat16), cfg,
                               autocast_adapter_dtype=False)
    spec = resolve_model(CFG, dtype=torch.bfloat16, peft_config=cfg)
    ds = {"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        zero3 = normalize_args({"bf16": True, "deepspeed": ds}, num_gpus=2, trainer="sft")
        ddp = normalize_args({"bf16": True}, num_gpus=2, trainer="sft")
    sizes = {p.itemsize for p in trained_spec(spec, zero3).states()[1]}
    assert sizes == {p.element_size() for p in real.parameters() if p.requires_grad} == {2}
    assert {p.itemsize for p in trained_spec(spec, ddp).states()[1]} == {4}  # peft's fp32
