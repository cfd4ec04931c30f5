"""FSDP + QLoRA in the plan's search space (issue #24): the FSDP-QLoRA recipes (Answer.AI /
bitsandbytes' ``fsdp_qlora``, PEFT's "Use PEFT QLoRA and FSDP") shard a 4-bit base stored in bf16
across the ranks, e.g. 70B on two 24 GB cards. The per-rank states of the plan are checked
against a hand count from the config (``tests.helpers.qlora_hand_count``)."""

from __future__ import annotations

import warnings

import pytest
import torch

import hf_memkit as mk
from hf_memkit._engines import all_rungs
from hf_memkit._methods import METHODS, ladder
from tests.helpers import qlora_hand_count, require

KiB = 1024


def test_fsdp_qlora_only_on_rungs_that_shard_a_4bit_base():
    m = METHODS.get("fsdp-qlora")
    assert [r.name for r in all_rungs().values() if m.allows_rung(r)] == \
        ["fsdp-grad-op", "fsdp-full", "fsdp-offload"]
    # plain QLoRA stays on one GPU or replicas; the ladder tries it first
    assert not any(METHODS.get("qlora").allows_rung(r) for r in all_rungs().values()
                   if not r.replica)
    names = [x.name for x in ladder("qlora")]
    assert names.index("qlora") < names.index("fsdp-qlora")


def test_70b_on_two_24gb_cards_plans_fsdp_qlora_when_nothing_else_fits():
    require("peft")
    require("bitsandbytes")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p = mk.plan_training("Llama-3.1-70B", seq_len=512, target_batch_size=16,
                             device="RTX-4090", num_gpus=2, host_memory="64GiB")
    c = p.chosen
    assert c.method == "fsdp-qlora" and c.parallel.startswith("fsdp")
    assert not any(x.fits for x in p.candidates if x.method != "fsdp-qlora")
    # the recipe: packed 4-bit weights stored in bf16, the model loaded in bf16, FSDP2 + bf16
    qc = p.model_kwargs["quantization_config"]
    assert qc.load_in_4bit and qc.bnb_4bit_quant_storage == torch.bfloat16
    assert p.model_kwargs["dtype"] == torch.bfloat16
    ta = p.training_args_kwargs
    assert ta["fsdp"] is True and ta["bf16"] is True
    assert p.peft_config is not None

    hand = qlora_hand_count(mk.profile_model("Llama-3.1-70B").config, p.peft_config.r, 2)
    est = p.estimate
    if ta["fsdp_config"]["cpu_offload"]:
        # CPUOffloadPolicy: the sharded base, adapters, their gradients and AdamW state on the
        # host; the absmax blocks (quant_state, no parameter) stay on the device, whole
        assert est.model_states == pytest.approx(hand["constants"], abs=KiB)
        assert est.host_offloaded == pytest.approx(hand["sharded"] + hand["states"] / 2,
                                                   abs=4 * KiB)
    else:
        assert est.model_states == pytest.approx(
            hand["sharded"] + hand["constants"] + hand["states"] / 2, abs=4 * KiB)
    assert est.device_used <= p.budget


def test_fsdp_qlora_loads_and_prepares_as_the_recipe(tmp_path):
    """A real 4-bit load with the method's quantization config and dtype (bitsandbytes runs on
    CPU), prepared by the method: packed weights in bf16 storage (what FSDP can shard), the rest
    of the base bf16 and frozen (no k-bit upcast), fp32 adapters the only trainable tensors."""
    require("peft")
    require("bitsandbytes")
    import transformers

    from hf_memkit._run.synthetic import tiny_llama_config

    m = METHODS.get("fsdp-qlora")
    dev = mk.get_device("RTX-4090")
    transformers.LlamaForCausalLM(tiny_llama_config()).save_pretrained(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_pretrained(
            tmp_path, quantization_config=m.quantization_config(dev),
            dtype=m.model_load_dtype("bf16", dev))
        model = m.prepare(model, m.peft_config("causal-lm"), checkpointing=False)
    kinds = {}
    for name, p in model.named_parameters():
        kind = "4bit" if type(p).__name__ == "Params4bit" else \
            "adapter" if "lora_" in name else "base"
        kinds.setdefault(kind, set()).add((p.dtype, p.requires_grad))
    assert kinds["4bit"] == {(torch.bfloat16, False)}
    assert kinds["base"] == {(torch.bfloat16, False)}
    assert kinds["adapter"] == {(torch.float32, True)}
