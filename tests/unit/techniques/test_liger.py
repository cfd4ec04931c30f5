"""``use_liger_kernel`` on CUDA targets (hf_memkit._techniques.liger.technique, hf_memkit._techniques.liger.kernels).

Every expected difference is worked out by hand from the config and liger-kernel 0.8.5's wrappers
(``ops/fused_linear_cross_entropy.py``, ``ops/rms_norm.py``, ``ops/swiglu.py``,
``ops/cross_entropy.py``) against what the model's own code keeps, never read back from the
estimator. Shorthand: T tokens (batch x seq), H hidden, INTER intermediate, V vocabulary, fp32 (no
autocast, so no weight-cache copies) on an A100 (compute capability 8.0).

The tolerance, TOL = 64 KiB, covers the per-token bookkeeping the formulas leave out: the fused
loss's ``loss_1d`` (T x 4 B = 8 KiB), the padded and shifted labels it builds
(``LigerForCausalLMLoss``: B x (S+1) x 8 B and T x 8 B, 16 KiB each) and the labels the model's
own loss keeps for ``nll_loss`` (T x 8 B), plus scalars. Every term of the formulas is 2 MiB or
more, and the differences are 20 MiB to 700 MiB.
"""

from __future__ import annotations

import warnings

import pytest
from transformers import LlamaConfig, Phi3Config

import hf_memkit as mk
from hf_memkit._errors import HfMemkitError
from hf_memkit._techniques.liger import kernels as liger

KiB, MiB = 1024, 1024 * 1024
TOL = 64 * KiB
B, S, H, INTER, V, LAYERS = 4, 512, 256, 688, 32000, 2
T = B * S
CFG = LlamaConfig(hidden_size=H, intermediate_size=INTER, num_hidden_layers=LAYERS,
                  num_attention_heads=4, num_key_value_heads=4, vocab_size=V)
GPU = "A100-80GB"

LOGITS = T * V * 4            # one fp32 [T, V] tensor
GRAD_IN = T * H * 4           # FLCE's grad_input [T, H], saved for the backward
GRAD_W = V * H * 4            # FLCE's grad_weight [V, H] (and the lm_head's own gradient)
# chunk_size = min(next_pow2(ceil(T / ceil(V / H))), T) = next_pow2(ceil(2048 / 125)) = 32
CHUNK = 32
# per layer, LlamaMLP keeps silu(gate) for the product's backward; Liger's SiLU-mul does not
MLP_SAVED = LAYERS * T * INTER * 4
# per RMSNorm (2 per layer + the final one), LlamaRMSNorm keeps x * rsqrt(var) [T, H] for the
# weight's gradient; Liger keeps x and RSTD [T] (as the model keeps x and rsqrt(var) [T, 1])
NORM_SAVED = (2 * LAYERS + 1) * T * H * 4
KERNELS_OFF = {"rope": False, "rms_norm": False, "swiglu": False}


def _peak(**extra) -> mk.MemoryEstimate:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a modelled technique is not warned about
        return mk.estimate_memory(CFG, {"per_device_train_batch_size": B, **extra}, seq_len=S,
                                  device=GPU)


@pytest.fixture(scope="module")
def plain() -> mk.MemoryEstimate:
    return _peak()


def test_chunk_size_follows_liger():
    assert liger.flce_chunk_size(T, H, V) == CHUNK
    assert liger.flce_chunk_size(4 * 4096, 4096, 32000) == 2048  # the example in Liger's comment
    assert liger.flce_chunk_size(8, 4096, 1000) == 8              # never more than the tokens


def test_model_without_liger_peaks_on_three_logits_tensors(plain):
    """The model's own loss: the backward starts with the log-softmax output, its gradient and
    the logits' gradient alive, three fp32 [T, V] tensors."""
    assert plain.peak_phase == "backward"
    assert plain.peak_allocated > 3 * LOGITS


def test_fused_linear_cross_entropy_alone(plain):
    """Liger's FLCE (other kernels off) peaks inside its chunk loop at the end of the forward:
    grad_input + grad_weight, the [CHUNK, V] logits buffer (fp32 params without autocast:
    ``_can_use_mm_out``), and, on the fp32 legacy dW path, a [V, H] product per chunk. The
    layers' activations are the same on both sides, so they cancel."""
    e = _peak(use_liger_kernel=True, liger_kernel_config=KERNELS_OFF)
    assert e.peak_phase == "forward"
    liger_head = GRAD_IN + GRAD_W + CHUNK * V * 4 + GRAD_W
    assert abs((plain.peak_allocated - e.peak_allocated) - (3 * LOGITS - liger_head)) <= TOL


def test_default_liger_adds_rms_norm_and_swiglu_savings(plain):
    """transformers' default (liger_kernel_config None): every kernel of
    apply_liger_kernel_to_llama's defaults. RoPE saves nothing in fp32 (both keep the rotated
    q and k for attention and cos/sin; Liger rotates in place)."""
    e = _peak(use_liger_kernel=True)
    liger_head = GRAD_IN + 2 * GRAD_W + CHUNK * V * 4
    expected = 3 * LOGITS - liger_head + MLP_SAVED + NORM_SAVED
    assert abs((plain.peak_allocated - e.peak_allocated) - expected) <= TOL
    assert e.peak_allocated < plain.peak_allocated / 2


def test_switching_off_fused_linear_cross_entropy_keeps_the_logits(plain):
    """fused_linear_cross_entropy=False: the logits and the model's loss stay; only the RMSNorm
    and SwiGLU savings remain."""
    e = _peak(use_liger_kernel=True, liger_kernel_config={"fused_linear_cross_entropy": False})
    assert e.peak_phase == "backward"
    assert e.peak_allocated > 3 * LOGITS
    assert abs((plain.peak_allocated - e.peak_allocated) - (MLP_SAVED + NORM_SAVED)) <= TOL
    # and with every kernel off, nothing changes
    none = _peak(use_liger_kernel=True, liger_kernel_config={
        **KERNELS_OFF, "fused_linear_cross_entropy": False})
    assert none.peak_allocated == plain.peak_allocated


def test_liger_cross_entropy_writes_the_gradient_into_the_logits(plain):
    """cross_entropy=True (FLCE off): the logits are made, but the loss keeps them as their own
    gradient (no log-softmax copy, no new gradient): the backward peaks at lm_head's backward
    with one [T, V] tensor plus the head's input and weight gradients."""
    e = _peak(use_liger_kernel=True, liger_kernel_config={
        **KERNELS_OFF, "fused_linear_cross_entropy": False, "cross_entropy": True})
    expected = 3 * LOGITS - (LOGITS + GRAD_IN + GRAD_W)
    assert abs((plain.peak_allocated - e.peak_allocated) - expected) <= TOL


def test_both_cross_entropy_kernels_is_refused_as_liger_does():
    with pytest.raises(HfMemkitError, match="liger_kernel_config.*cannot both be True"):
        _peak(use_liger_kernel=True, liger_kernel_config={"cross_entropy": True})


def test_cpu_target_is_refused_with_the_fix():
    with pytest.raises(HfMemkitError) as info:
        mk.estimate_memory(CFG, {"per_device_train_batch_size": B, "use_liger_kernel": True},
                           seq_len=S, device="cpu")
    msg = str(info.value)
    assert "use_liger_kernel" in msg and "Triton" in msg and "GPU" in msg
    assert "Drop use_liger_kernel" in msg and "device=" in msg


def test_rope_is_patched_in_checkpoint_recomputation_too(monkeypatch):
    """Liger patches modeling_llama.apply_rotary_pos_emb for the whole process; the trace scopes
    it to each attention's calls, which the checkpointed backward re-enters."""
    calls = []
    real = liger.RopeFn.apply
    monkeypatch.setattr(liger.RopeFn, "apply", lambda *a: calls.append(1) or real(*a))
    _peak(use_liger_kernel=True, activation_checkpointing=True, bf16=True)
    assert len(calls) == 2 * LAYERS  # forward + recomputation, per layer
    import transformers.models.llama.modeling_llama as ml
    assert ml.apply_rotary_pos_emb is not liger.liger_rotary_pos_emb  # restored


def test_a_model_type_liger_patches_but_hf_memkit_does_not_emulate_is_warned():
    cfg = Phi3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=4, vocab_size=500,
                     pad_token_id=0)
    with pytest.warns(UserWarning, match="Liger patches `phi3`"):
        mk.estimate_memory(cfg, {"per_device_train_batch_size": 2, "use_liger_kernel": True},
                           seq_len=32, device=GPU)
