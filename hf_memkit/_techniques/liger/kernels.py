"""Liger kernels' memory on fake tensors: what ``use_liger_kernel=True`` patches into a model, as
autograd Functions that allocate and save exactly what Liger's do.

Liger's kernels are Triton kernels (they cannot run on a CPU, fake tensors included); their Python
wrappers decide every allocation, so each Function below follows its wrapper line by line and
replaces the kernel launch by nothing (the kernels write into buffers the wrapper allocated, or
in place). Read from liger-kernel 0.8.5 (``liger_kernel/``), the version transformers 5.23's
``integrations/liger.py`` hands ``TrainingArguments.liger_kernel_config`` to, as keyword
arguments of ``transformers/monkey_patch.py::_apply_liger_kernel_to_instance`` (no config: the
``apply_liger_kernel_to_<model_type>`` defaults: rope, rms_norm, swiglu/geglu and
fused_linear_cross_entropy on, cross_entropy off).

* RMSNorm: ``ops/rms_norm.py`` ``LigerRMSNormFunction`` / ``rms_norm_forward`` /
  ``rms_norm_backward``: output Y like X, RSTD [rows] fp32 (llama and gemma casting modes);
  saves X, W, RSTD; the backward writes dX into dY (``in_place``, the default of every patch here)
  and reduces a [sm_count, H] fp32 partial dW.
* SwiGLU / GEGLU: ``ops/swiglu.py`` ``LigerSiLUMulFunction`` and ``ops/geglu.py``
  ``LigerGELUMulFunction``: c = empty_like(a); saves a, b (not silu(a)); the backward writes the
  gradients into a and b.
* RoPE: ``ops/rope.py`` ``LigerRopeFunction`` / ``rope_forward``: rotates q and k in place in
  their own dtype (no fp32 promotion), saves cos and sin.
* Fused linear cross-entropy: ``ops/fused_linear_cross_entropy.py``
  ``fused_linear_cross_entropy_forward`` (reached through ``transformers/model/<type>.py``
  ``lce_forward`` -> ``model/loss_utils.py::LigerForCausalLMLoss``): the [tokens x vocab] logits
  are made ``chunk_size`` rows at a time, their gradient computed in the forward; saves only
  grad_input [tokens, H] and grad_weight [V, H] for the backward.
* Cross-entropy: ``ops/cross_entropy.py`` ``LigerCrossEntropyFunction``: the gradient is written
  into the (upcast) logits, which are saved; no log-softmax copy.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections.abc import Mapping
from types import MethodType
from typing import Any

import torch

IGNORE_INDEX = -100
# The apply_liger_kernel_to_<model_type> functions emulated here, with their keyword defaults
# (transformers/monkey_patch.py). "mlp" is swiglu (SiLU) or geglu (GELU, Gemma).
DEFAULTS = {"rope": True, "cross_entropy": False, "fused_linear_cross_entropy": True,
            "rms_norm": True, "swiglu": True, "geglu": True}
MODEL_TYPES: dict[str, dict[str, Any]] = {
    "llama": {"mlp": "swiglu", "qk_norm": False, "gemma": False, "ce": True},
    "mistral": {"mlp": "swiglu", "qk_norm": False, "gemma": False, "ce": False},
    "qwen2": {"mlp": "swiglu", "qk_norm": False, "gemma": False, "ce": True},
    "qwen3": {"mlp": "swiglu", "qk_norm": True, "gemma": False, "ce": True},
    "gemma": {"mlp": "geglu", "qk_norm": False, "gemma": True, "ce": True},
}
# apply_liger_kernel_to_mistral's cross_entropy switch sets modeling_mistral.CrossEntropyLoss,
# which transformers 5's Mistral no longer uses ("ce": False: no effect).

# SMs per compute capability, the largest of the catalog's GPUs of each (the [sm_count, H] fp32
# partial dW of rms_norm_backward; a few MiB at most)
SM_COUNT = {(7, 0): 80, (7, 5): 40, (8, 0): 108, (8, 6): 84, (8, 9): 142, (9, 0): 132}


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def flce_chunk_size(tokens: int, hidden: int, vocab: int, chunk_mem_const: int = 1) -> int:
    """``fused_linear_cross_entropy_forward``: rows of logits made at once."""
    inc_factor = _cdiv(vocab, chunk_mem_const * hidden)
    return min(_next_pow2(_cdiv(tokens, inc_factor)), tokens)


class RMSNormFn(torch.autograd.Function):
    """``LigerRMSNormFunction`` (``ensure_contiguous``; ``rms_norm_forward``/``_backward``)."""

    @staticmethod
    def forward(ctx, x, w, in_place: bool, sm_count: int):  # noqa: D102
        x = x.contiguous()
        shape = x.shape
        x2 = x.view(-1, shape[-1])
        y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
        rstd = torch.empty(x2.shape[0], dtype=torch.float32, device=x.device)
        ctx.in_place, ctx.sm_count, ctx.shape = in_place, sm_count, shape
        ctx.save_for_backward(x2, w, rstd)
        return y.view(shape)

    @staticmethod
    def backward(ctx, dy):  # noqa: D102
        dy = dy.contiguous().view(-1, ctx.shape[-1])
        x, w, rstd = ctx.saved_tensors
        dw = None
        partial = torch.empty(ctx.sm_count, x.shape[1], dtype=torch.float32, device=x.device) \
            if ctx.needs_input_grad[1] else None
        dx = dy if ctx.in_place else torch.zeros_like(dy)
        if partial is not None:
            dw = partial.sum(dim=0).to(w.dtype)
            del partial
        return dx.view(ctx.shape), dw, None, None


class GatedMulFn(torch.autograd.Function):
    """``LigerSiLUMulFunction`` and ``LigerGELUMulFunction`` (same buffers): the activation and
    the product in one kernel; a and b saved; their gradients written into them."""

    @staticmethod
    def forward(ctx, a, b):  # noqa: D102
        a, b = a.contiguous(), b.contiguous()
        shape = a.shape
        a2, b2 = a.view(-1, shape[-1]), b.view(-1, shape[-1])
        c = torch.empty_like(a2)
        ctx.shape = shape
        ctx.save_for_backward(a2, b2)
        return c.view(shape)

    @staticmethod
    def backward(ctx, dc):  # noqa: D102
        dc = dc.contiguous()
        a, b = ctx.saved_tensors
        return a.view(ctx.shape), b.view(ctx.shape)


class RopeFn(torch.autograd.Function):
    """``LigerRopeFunction``: ``rope_forward`` transposes q and k back to their physical
    [B, S, H, D] layout, makes them contiguous (no copy for q_proj(x).view().transpose()) and
    rotates them in place; cos and sin are saved."""

    @staticmethod
    def forward(ctx, q, k, cos, sin):  # noqa: D102
        if cos.ndim == 2:
            cos, sin = cos.unsqueeze(0), sin.unsqueeze(0)
        q, k = q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous()
        cos, sin = cos.contiguous(), sin.contiguous()
        ctx.save_for_backward(cos, sin)
        return q.transpose(1, 2), k.transpose(1, 2)

    @staticmethod
    def backward(ctx, dq, dk):  # noqa: D102
        dq, dk = dq.transpose(1, 2).contiguous(), dk.transpose(1, 2).contiguous()
        return dq.transpose(1, 2), dk.transpose(1, 2), None, None


def liger_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """``transformers/rope.py::liger_rotary_pos_emb`` (cos, sin as the model passes them)."""
    return RopeFn.apply(q, k, cos, sin)


def _flce_chunks(x, weight, target, grad_input, grad_weight, chunk: int, cc_major: int) -> None:
    """The chunk loop of ``fused_linear_cross_entropy_forward`` (no bias, no token scaling)."""
    bt = x.shape[0]
    autocast = torch.is_autocast_enabled("cpu")  # the trace's stand-in for CUDA autocast
    # _can_use_mm_out: grad is off inside Function.forward; same dtypes; no autocast cast
    use_mm_out = x.dtype == weight.dtype and (
        not autocast or x.dtype == torch.get_autocast_dtype("cpu"))
    storage = torch.empty(chunk, weight.shape[0], dtype=x.dtype, device=x.device) \
        if use_mm_out else None
    for start in range(0, bt, chunk):
        end = min(start + chunk, bt)
        x_chunk = x[start:end]
        if storage is not None:
            logits = storage[: end - start]
            torch.mm(x_chunk, weight.t(), out=logits)
        else:
            logits = x_chunk @ weight.t()          # autocast: a bf16/fp16 copy of weight.t()
        logits = logits.contiguous()
        grad_logits = logits                       # liger_cross_entropy_kernel: in place
        del logits
        if grad_input is not None:
            if use_mm_out and grad_logits.dtype == grad_input.dtype:
                torch.mm(grad_logits, weight, out=grad_input[start:end])
            else:
                grad_input[start:end] = grad_logits @ weight
        if grad_weight is not None:
            half = grad_logits.dtype in (torch.float16, torch.bfloat16)
            if cc_major >= 8 and half and grad_weight.dtype in (torch.float32, grad_logits.dtype):
                # torch.addmm(grad_weight, grad_logits.t(), input_chunk, out=grad_weight): in
                # place; input_chunk cast to the gradient's dtype first
                input_chunk = x_chunk.to(grad_logits.dtype) if x_chunk.dtype != grad_logits.dtype \
                    else x_chunk
                del input_chunk
            else:  # legacy path: a [V, H] fp32 temporary per chunk
                grad_weight += torch.mm(grad_logits.t(), x_chunk).float()
        del grad_logits, x_chunk
    del storage


class FusedLinearCrossEntropyFn(torch.autograd.Function):
    """``LigerFusedLinearCrossEntropyFunction`` with reduction "mean" / "sum" (the Trainer's):
    gradients computed in the forward, only they are saved (``amp_custom_fwd``: the forward runs
    under the caller's autocast)."""

    @staticmethod
    def forward(ctx, x, weight, target, cc_major: int):  # noqa: D102
        bt, hidden = x.shape
        chunk = flce_chunk_size(bt, hidden, weight.shape[0])
        needs = x.requires_grad
        grad_input = torch.zeros_like(x)
        grad_weight = torch.zeros_like(weight) if needs and weight.requires_grad else None
        loss_1d = torch.zeros(bt, dtype=torch.float32, device=x.device)
        n_non_ignore = (target != IGNORE_INDEX).sum()   # .item() in Liger
        del n_non_ignore
        _flce_chunks(x, weight, target, grad_input if needs else None, grad_weight, chunk,
                     cc_major)
        loss = torch.sum(loss_1d)
        del loss_1d
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        ctx.has_weight_grad = grad_weight is not None
        ctx.save_for_backward(grad_input.detach(),
                              grad_weight.detach() if grad_weight is not None else None)
        return loss

    @staticmethod
    def backward(ctx, grad_output):  # noqa: D102
        # fused_linear_cross_entropy_backward: scaled in place by grad_output (no allocation)
        grad_input, grad_weight = ctx.saved_tensors
        return grad_input, grad_weight if ctx.has_weight_grad else None, None, None


class CrossEntropyFn(torch.autograd.Function):
    """``LigerCrossEntropyFunction``: the loss per row in the input's dtype; the gradient written
    into the input, which is saved."""

    @staticmethod
    def forward(ctx, x, target):  # noqa: D102
        if x.stride(-1) != 1:
            x = x.contiguous()
        loss_1d = torch.zeros(x.shape[0], dtype=x.dtype, device=x.device)
        n_non_ignore = (target != IGNORE_INDEX).sum()
        del n_non_ignore
        loss = torch.sum(loss_1d)
        ctx.save_for_backward(x.detach())
        return loss

    @staticmethod
    def backward(ctx, grad_output):  # noqa: D102
        (x,) = ctx.saved_tensors
        return x, None


def liger_cross_entropy(input, target, weight=None, size_average=None,  # noqa: A002
                        ignore_index=IGNORE_INDEX, reduce=None, reduction="mean", **_):
    """``transformers/functional.py::liger_cross_entropy`` in place of F.cross_entropy."""
    return CrossEntropyFn.apply(input, target)


# -- patching the fake model, as apply_liger_kernel_to_<model_type>(model=...) does -------------


def _rms_norm_forward(self, hidden_states):
    """``LigerRMSNorm.forward`` bound to the model's own norm (``_patch_rms_norm_module``)."""
    return RMSNormFn.apply(hidden_states, self.weight, True, self._liger_sm_count)


def _gated_mlp_forward(self, x):
    """``LigerSwiGLUMLP.forward`` / ``LigerGEGLUMLP.forward`` (``_patch_swiglu_module``,
    ``_patch_geglu_module``)."""
    return self.down_proj(GatedMulFn.apply(self.gate_proj(x), self.up_proj(x)))


@contextlib.contextmanager
def _swapped(module: Any, name: str, value: Any):
    """Liger patches module globals for the whole process; the trace scopes the patch to the
    patched model's own calls (re-entered by checkpoint recomputation)."""
    old = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, old)


def _with_liger_rope(attn: torch.nn.Module) -> None:
    """``modeling_<type>.apply_rotary_pos_emb = liger_rotary_pos_emb``, for this attention."""
    modeling = sys.modules[type(attn).__module__]
    forward = attn.forward

    def patched(*args, **kwargs):
        with _swapped(modeling, "apply_rotary_pos_emb", liger_rotary_pos_emb):
            return forward(*args, **kwargs)

    attn.forward = patched


def _flce_loss(self, hidden_states, labels, num_items_in_batch=None, shift_labels=None):
    """``model/loss_utils.py::LigerForCausalLMLoss`` -> ``fixed_fused_linear_cross_entropy``."""
    if shift_labels is None:
        labels = torch.nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)
        shift_labels = labels[..., 1:].contiguous()
    hidden = hidden_states.view(-1, self.config.hidden_size)
    loss = FusedLinearCrossEntropyFn.apply(hidden, self.lm_head.weight, shift_labels.view(-1),
                                           self._liger_cc_major)
    return loss / num_items_in_batch if num_items_in_batch is not None else loss


def _lce_forward(self, input_ids=None, attention_mask=None, labels=None, logits_to_keep=0,
                 skip_logits=None, **kwargs):
    """``transformers/model/<type>.py::lce_forward``: with labels in training (or
    ``skip_logits``, the Trainer's eval with prediction_loss_only) the fused loss; otherwise the
    model's own forward (lm_head + loss_function)."""
    shift_labels = kwargs.get("shift_labels")
    if skip_logits is None:
        skip_logits = self.training and (labels is not None or shift_labels is not None)
    with self._liger_ce():
        if not skip_logits:
            return type(self).forward(self, input_ids=input_ids, attention_mask=attention_mask,
                                      labels=labels, logits_to_keep=logits_to_keep, **kwargs)
        from transformers.modeling_outputs import CausalLMOutputWithPast

        num_items = kwargs.pop("num_items_in_batch", None)
        kwargs.pop("shift_labels", None)
        outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        hidden = outputs[0]
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        loss = _flce_loss(self, hidden[:, keep, :], labels, num_items, shift_labels)
        return CausalLMOutputWithPast(loss=loss, logits=None,
                                      past_key_values=outputs.past_key_values)


def _plain_forward(self, *args, **kwargs):
    with self._liger_ce():
        return type(self).forward(self, *args, **kwargs)


def resolve_switches(model_type: str, config: Mapping[str, Any]) -> dict[str, bool]:
    """The switches ``_apply_liger_kernel_to_instance(model, **config)`` ends up with: the apply
    function's defaults, overridden by the config keys its signature has."""
    kind = MODEL_TYPES[model_type]
    keys = ("rope", "cross_entropy", "fused_linear_cross_entropy", "rms_norm", kind["mlp"])
    out = {k: bool(config.get(k, DEFAULTS[k])) for k in keys}
    out["mlp"] = out.pop(kind["mlp"])
    return out


def apply_liger(model: torch.nn.Module, config: Mapping[str, Any], *,
                compute_capability: tuple[int, int], skip_logits: bool | None = None) -> bool:
    """Patch the fake ``model`` as Liger would; False (and a warning) where Liger patches a model
    type this emulation does not cover. Raises ValueError as Liger's assert does."""
    model_type = str(getattr(model.config, "model_type", ""))
    if model_type not in MODEL_TYPES:
        _warn_unemulated(model_type)
        return False
    kind, sw = MODEL_TYPES[model_type], resolve_switches(model_type, config)
    if sw["cross_entropy"] and sw["fused_linear_cross_entropy"]:
        raise ValueError("cross_entropy and fused_linear_cross_entropy cannot both be True.")
    base = getattr(model, model.base_model_prefix, model)
    norms = [base.norm] if sw["rms_norm"] else []
    for layer in base.layers:
        if sw["mlp"]:
            layer.mlp.forward = MethodType(_gated_mlp_forward, layer.mlp)
        if sw["rms_norm"]:
            norms += [layer.input_layernorm, layer.post_attention_layernorm]
            if kind["qk_norm"]:
                norms += [layer.self_attn.q_norm, layer.self_attn.k_norm]
        if sw["rope"]:
            _with_liger_rope(layer.self_attn)
    for norm in norms:
        norm._liger_sm_count = SM_COUNT.get(tuple(compute_capability), 132)
        norm.forward = MethodType(_rms_norm_forward, norm)
    ce = sw["cross_entropy"] and kind["ce"]
    model._liger_ce = (lambda: _swapped(torch.nn.functional, "cross_entropy",
                                        liger_cross_entropy)) if ce else contextlib.nullcontext
    if sw["fused_linear_cross_entropy"]:
        model._liger_cc_major = int(compute_capability[0])
        lce = _lce_forward if skip_logits is None else \
            (lambda self, *a, **k: _lce_forward(self, *a, skip_logits=skip_logits, **k))
        model.forward = MethodType(lce, model)
    elif ce:
        model.forward = MethodType(_plain_forward, model)
    return True


def _warn_unemulated(model_type: str) -> None:
    if model_type in LIGER_PATCHES:
        warnings.warn(f"use_liger_kernel: Liger patches `{model_type}` models, but hf_memkit "
                      f"emulates its kernels only for {', '.join(sorted(MODEL_TYPES))}; this "
                      "estimate traces the model without them (Liger usually saves memory, so "
                      "it errs high)", stacklevel=4)


# liger-kernel 0.8.5's MODEL_TYPE_TO_APPLY_LIGER_FN keys beyond MODEL_TYPES (causal LMs); types
# outside it are left unpatched by Liger itself ("no Liger kernels supported"), as here
LIGER_PATCHES = frozenset({
    "deepseek_v2", "deepseek_v3", "deepseek_v4", "gemma2", "gemma3_text", "gemma3", "gemma4_text",
    "gemma4", "glm4", "glm4v", "glm4v_moe", "gpt_oss", "internvl", "llama4_text", "llama4",
    "llava", "granite", "mllama", "mllama_text_model", "ministral", "mixtral", "muse_glimmer",
    "nemotron", "olmo2", "pixtral", "olmo3", "qwen3_moe", "qwen2_vl", "qwen2_vl_text",
    "qwen2_5_vl", "qwen2_5_vl_text", "qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe",
    "qwen3_5_moe_text", "qwen3_vl", "qwen3_vl_text", "qwen3_vl_moe", "qwen3_vl_moe_text",
    "smollm3", "phi3", "paligemma", "falcon_h1", "smolvlm", "hunyuan_v1_dense", "hunyuan_v1_moe",
    "exaone4"})
