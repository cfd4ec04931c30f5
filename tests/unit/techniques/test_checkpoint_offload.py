"""Checkpoint offload (``activation_checkpointing_kwargs={"offload": True}``, and FSDP2's
``activation_checkpointing_offload``): checked arithmetically against the model's config, since
pinned host memory needs a GPU this machine does not have.

What the real run keeps (transformers ``_activation_checkpointing_enable``: ``save_on_cpu``
around ``torch.utils.checkpoint``): without offload every checkpointed layer's input ``X`` stays on
the device until that layer's backward; with it, only the input of the layer being recomputed
comes back. For a model with ``L`` layers whose step peaks in the backward:

* without offload the peak is at the last layer's recompute: ``C + L*X``;
* with offload each layer's backward frees no input but adds its gradients ``g``, so the peak
  moves to the first layer's recompute: ``C + X + (L-1)*g``;

so the peak drops by ``(L-1)*(X - g)`` (by ``(L-1)*X`` on an accumulating micro-step, whose
gradients already exist). Host: ``L`` pinned blocks, each ``X`` rounded up to a power of two
(torch's CachingHostAllocator).
"""

from __future__ import annotations

import functools
import inspect
import warnings

import pytest
import torch
from transformers import LlamaConfig

import hf_memkit as mk

H, I, L, V = 384, 512, 4, 256  # noqa: E741 - hidden, intermediate, layers, vocabulary
B, T = 4, 1024
CFG = LlamaConfig(hidden_size=H, intermediate_size=I, num_hidden_layers=L, num_attention_heads=6,
                  num_key_value_heads=6, vocab_size=V, tie_word_embeddings=False)
GPU = "A100-80GB"


def layer_input(itemsize: int) -> int:
    return B * T * H * itemsize


def layer_grads() -> int:
    """fp32 gradient bytes of one decoder layer: q, k, v, o, gate, up, down, two norms."""
    return (4 * H * H + 3 * H * I + 2 * H) * 4


def pinned(n: int) -> int:
    p = 1
    while p < n:
        p *= 2
    return p


def args(offload: bool, **extra) -> dict:
    kw = {"use_reentrant": extra.pop("use_reentrant", False)}
    if offload:
        kw["offload"] = True
    return {"per_device_train_batch_size": B, "activation_checkpointing": True,
            "activation_checkpointing_kwargs": kw, **extra}


@functools.cache
def estimate(offload: bool, device: str = GPU, stage: str = "train", **extra):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        e = mk.estimate_memory(CFG, args(offload, **extra), seq_len=T, device=device, stage=stage)
    assert not [w for w in caught if "offload" in str(w.message)], "offload is modelled"
    return e


@pytest.mark.parametrize("extra", [{}, {"use_reentrant": True}, {"bf16": True}],
                         ids=["fp32", "reentrant", "amp-bf16"])
def test_offload_frees_the_checkpointed_inputs_on_a_cuda_target(extra):
    plain, off = estimate(False, **extra), estimate(True, **extra)
    assert plain.peak_phase == off.peak_phase == "backward"
    x = layer_input(4)  # the residual stream is fp32 (fp32 weights; under autocast too)
    drop = plain.peak_allocated - off.peak_allocated
    assert drop == (L - 1) * (x - layer_grads()), (drop, x, layer_grads())
    assert plain.breakdown["activations"] > off.breakdown["activations"]
    assert plain.host_offloaded == 0
    assert off.host_offloaded == L * pinned(x) == L * 8 * 2**20  # 6 MiB -> 8 MiB blocks
    assert not any("not modelled" in n for n in off.notes)


def test_a_deep_model_extrapolated_in_depth_drops_the_same():
    deep = LlamaConfig(**{**CFG.to_dict(), "num_hidden_layers": 12})
    est = {}
    for off in (False, True):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            est[off] = mk.estimate_memory(deep, args(off), seq_len=T, device=GPU)
    assert est[True].traced_layers == (2, 3)  # traced at 2 and 3 blocks, extrapolated to 12
    assert est[False].peak_allocated - est[True].peak_allocated == \
        11 * (layer_input(4) - layer_grads())
    assert est[True].host_offloaded == 12 * pinned(layer_input(4))


def test_an_accumulating_micro_step_drops_every_input_but_one():
    plain = estimate(False, gradient_accumulation_steps=2)
    off = estimate(True, gradient_accumulation_steps=2)
    assert plain.peak_phase == off.peak_phase == "backward (accumulating)"
    assert plain.peak_allocated - off.peak_allocated == (L - 1) * layer_input(4)
    assert off.host_offloaded == L * pinned(layer_input(4))  # per micro-batch, blocks reused


def test_eval_offloads_nothing():
    assert estimate(True, stage="eval").host_offloaded == 0
    assert estimate(True, stage="eval").peak_allocated == estimate(False, stage="eval").peak_allocated


def test_a_cpu_target_changes_nothing_and_says_so():
    plain, off = estimate(False, device="cpu"), estimate(True, device="cpu")
    assert off.peak_allocated == plain.peak_allocated
    assert off.host_offloaded == 0
    note = [n for n in off.notes if "activation offloading" in n]
    assert len(note) == 1 and "changes nothing on a cpu target" in note[0]
    assert "pin_memory=True requires a CUDA or other accelerator backend" in note[0]
    assert not any("activation offloading" in n for n in plain.notes)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only failure the note quotes")
def test_the_cpu_note_quotes_what_transformers_raises_here():
    from transformers import LlamaForCausalLM

    tiny = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=2, vocab_size=64)
    model = LlamaForCausalLM(tiny)
    model.activation_checkpointing_enable(offload=True)
    model.train()
    ids = torch.zeros(1, 8, dtype=torch.long)
    with pytest.raises(RuntimeError, match="pin_memory=True requires a CUDA or other accelerator"):
        model(input_ids=ids, labels=ids)


def test_transformers_still_offloads_with_save_on_cpu_around_checkpoint():
    """The trace mirrors this code; a change in transformers must be looked at."""
    from transformers import PreTrainedModel
    from transformers.modeling_layers import GradientCheckpointingLayer

    src = inspect.getsource(PreTrainedModel._activation_checkpointing_enable)
    assert "save_on_cpu(pin_memory=True" in src and "checkpoint(function" in src
    layer_src = inspect.getsource(GradientCheckpointingLayer.__init_subclass__)
    assert "_gradient_checkpointing_func(partial(forward, self, **kwargs), *args)" in layer_src


FSDP = {"per_device_train_batch_size": B, "bf16": True, "fsdp": True,
        "fsdp_config": {"version": 2, "activation_checkpointing": True,
                        "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}}


def _fsdp(**over):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return mk.estimate_memory(CFG, {**FSDP, **over}, seq_len=T, device=GPU, num_gpus=2)


def test_fsdp_offload_from_accelerate_launch_is_modelled(monkeypatch):
    monkeypatch.delenv("FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD", raising=False)
    plain = _fsdp()
    assert "checkpoint_offload" not in {u.name for u in plain.setup.techniques}
    monkeypatch.setenv("FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD", "true")
    off = _fsdp()
    assert {"checkpoint_offload", "activation_checkpointing"} <= {
        u.name for u in off.setup.techniques}
    # FSDP2 computes in the gathered bf16 parameters: bf16 layer inputs, 3 MiB -> 4 MiB blocks
    assert off.host_offloaded == plain.host_offloaded + L * pinned(layer_input(2))
    assert 0 < plain.peak_allocated - off.peak_allocated <= (L - 1) * layer_input(2)
    # accelerate needs fsdp_config's own activation checkpointing for it
    no_ac = {**FSDP["fsdp_config"], "activation_checkpointing": False}
    assert "checkpoint_offload" not in {u.name for u in _fsdp(fsdp_config=no_ac).setup.techniques}


def test_an_fsdp_config_key_transformers_ignores_is_warned(monkeypatch):
    monkeypatch.delenv("FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD", raising=False)
    cfg = {**FSDP["fsdp_config"], "activation_checkpointing_offload": True}
    with pytest.warns(UserWarning, match=r"activation_checkpointing_offload.*does not pass it"):
        e = mk.estimate_memory(CFG, {**FSDP, "fsdp_config": cfg}, seq_len=T, device=GPU,
                               num_gpus=2)
    assert "checkpoint_offload" not in {u.name for u in e.setup.techniques}
