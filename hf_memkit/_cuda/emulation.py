"""Trace what a CUDA target runs, on CPU fake tensors (``emulate_cuda``): CUDA's autocast policy
(``autocast``), the SDPA kernel CUDA would pick (``sdpa``), and CUDA's fused dropout.

The trace runs on this machine's CPU (``_trace.step``), where torch takes CPU code paths that allocate
differently from CUDA (docs/stack-facts.md#cpu-and-cuda-kernel-differences):

* **SDPA.** ``sdpa_kernel`` follows aten/src/ATen/native/transformers/cuda/sdp_utils.cpp
  (``select_sdp_backend``, ``can_use_flash_attention``, ``can_use_mem_efficient_attention``,
  ``check_cudnn_tensor_shapes``, ``priority_order``), and the trace calls that kernel's aten op
  (``_scaled_dot_product_flash_attention`` / ``_efficient_attention`` / ``_cudnn_attention``),
  whose meta kernels and autograd formulas save exactly what CUDA saves for backward: the output,
  the log-sum-exp rows and the philox RNG state (no attention matrix, dropout or not). The math
  fallback materialises the attention matrix, with CUDA's bool dropout mask.
* **Dropout.** ``at::dropout`` (aten/src/ATen/native/Dropout.cpp) takes ``native_dropout`` when
  ``is_fused_kernel_acceptable`` (CUDA, 0 < p < 1): output + a 1-byte bool mask. On CPU it
  takes ``_dropout_impl``: a noise tensor of the input's dtype kept for backward (4 bytes per
  element in fp32).

Optimizer temporaries (foreach on CUDA, single-tensor on CPU, fused) are modelled per device kind
in ``_optimizers``.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch

from .._errors import HfMemkitError
from .autocast import cast_eligible, cuda_autocast
from .collectives import SequenceSplit, around_attention
from .sdpa import SdpaCall, sdpa_kernel
from .target import CudaTarget


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


class _FusedAttention(torch.autograd.Function):
    """A fused CUDA attention kernel's memory: the forward's outputs from the kernel's own aten op
    (meta shapes: output, log-sum-exp, RNG state); saved for backward as the aten autograd
    formula saves them (tools/autograd/derivatives.yaml: query, key, value, output, logsumexp,
    philox seed/offset, the bias); the backward allocates the gradients and the kernel's own
    temporaries (flash_attn/flash_api.cpp ``mha_bwd``: ``softmax_d`` [B, H, S_q rounded to 128]
    fp32, ``dq_accum`` [B, S_q rounded, H, head_dim rounded] fp32, and for GQA ``dk_expanded`` /
    ``dv_expanded`` [B, S_k, H, D]; the memory-efficient backward keeps the same fp32 row
    statistics and grad-q accumulator)."""

    @staticmethod
    def forward(ctx, q, k, v, mask, kernel, dropout, causal, scale, grad,  # noqa: D102
                split=None):
        aten = torch.ops.aten
        fwd, ctx.split_backward, keep = split.attention_bytes(
            tuple(q.shape), k.shape[1], q.element_size()) if split is not None else (0, 0, 0)
        # a split sequence's buffers (_cuda.collectives): alive while the kernel runs, and
        # what the attention saves beyond the local kernel's own
        in_flight = torch.empty(fwd, dtype=torch.uint8) if fwd else None
        kept = torch.empty(keep, dtype=torch.uint8) if keep else None
        if kernel == "flash":
            outs = aten._scaled_dot_product_flash_attention(q, k, v, dropout, causal, False,
                                                            scale=scale)
            saved = (outs[0], outs[1], outs[6], outs[7])
        elif kernel == "efficient":
            outs = aten._scaled_dot_product_efficient_attention(q, k, v, mask, grad, dropout,
                                                                causal, scale=scale)
            saved = tuple(outs[:4])
        else:
            outs = aten._scaled_dot_product_cudnn_attention(q, k, v, mask, grad, dropout,
                                                            causal, False, scale=scale)
            saved = (outs[0], outs[1], outs[6], outs[7])
        ctx.kernel = kernel
        del in_flight
        ctx.save_for_backward(q, k, v, mask, *saved, kept)
        return saved[0]

    @staticmethod
    def backward(ctx, grad_out):  # noqa: D102
        q, k, v, mask = ctx.saved_tensors[:4]
        b, h, s_q, d = q.shape
        temps = []
        if ctx.kernel in ("flash", "efficient"):
            s_rounded = _round_up(s_q, 128)
            temps.append(torch.empty(b, h, s_rounded, dtype=torch.float32))
            temps.append(torch.empty(b, s_rounded, h, _round_up(d, 32 if d <= 128 else 64),
                                     dtype=torch.float32))
        if k.shape[1] != h:
            temps += [torch.empty(b, k.shape[2], h, d, dtype=k.dtype) for _ in range(2)]
        if ctx.split_backward:
            temps.append(torch.empty(ctx.split_backward, dtype=torch.uint8))
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        dmask = None
        if ctx.kernel == "efficient" and ctx.needs_input_grad[3]:
            # attention_backward.cu: a bias that requires grad gets grad_bias of the bias's full
            # (expanded) shape, its last dim padded to 16, allocated with dq, dk and dv
            dmask = torch.empty(*mask.shape[:-1], _round_up(mask.shape[-1], 16),
                                dtype=mask.dtype)[..., :mask.shape[-1]]
        del temps
        return dq, dk, dv, dmask, None, None, None, None, None, None


def _bool_mask_to_float(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """sdp_utils ``convert_boolean_attn_mask``: a new additive mask of the query dtype."""
    return torch.zeros(mask.shape, dtype=dtype).masked_fill_(mask.logical_not(), -math.inf)


def _math_attention(q, k, v, mask, dropout, causal, scale, enable_gqa):
    """aten ``_scaled_dot_product_attention_math`` with CUDA's dropout (bool mask). fp16 and bf16
    inputs are computed in fp32 unless ``torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp``
    is on (off by default): the attention matrix and the copies of q, k, v the products save are
    fp32, and the attention weights the op also returns are cast back (then dropped)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    origin = q.dtype
    if origin in (torch.float16, torch.bfloat16) and \
            not torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed():
        q, k, v = q.float(), k.float(), v.float()
    if enable_gqa and k.shape[-3] != q.shape[-3]:
        rep = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(rep, dim=-3), v.repeat_interleave(rep, dim=-3)
    root = math.sqrt(scale)
    attn = (q * root) @ (k * root).transpose(-2, -1)
    if causal:
        keep = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
        attn = attn + _bool_mask_to_float(keep, attn.dtype)
    if mask is not None:  # in place where the result keeps attn's dtype, as aten's add_
        same = torch.promote_types(attn.dtype, mask.dtype) == attn.dtype
        attn = attn.add_(mask) if same else attn + mask
    attn = torch.softmax(attn, -1)
    if dropout > 0:
        attn = torch.ops.aten.native_dropout(attn, dropout, True)[0]
    weights = attn.to(origin)  # the op's second output, which F.scaled_dot_product_attention drops
    del weights
    return (attn @ v).to(origin)


_F = torch.nn.functional
_SDPA, _DROPOUT = _F.scaled_dot_product_attention, _F.dropout


class CudaOps:
    """Routes ``F.scaled_dot_product_attention`` to the kernel CUDA would pick and ``F.dropout``
    to CUDA's fused dropout while entered (both are looked up on ``torch.nn.functional`` at call
    time by transformers and ``nn.Dropout``; a patch, unlike a TorchFunctionMode, also holds
    during checkpoint recomputation inside the backward)."""

    def __init__(self, target: CudaTarget, split: SequenceSplit | None = None):
        self.target = target
        self.split = split             # the sequence split over ranks (CP / SP), if any
        self.kernels: list[str] = []   # the kernel of each SDPA call, in order
        self.dropout = False           # CUDA's fused dropout ran (0 < p < 1, training)

    def __enter__(self) -> CudaOps:
        _F.scaled_dot_product_attention, _F.dropout = self._sdpa, self._dropout
        return self

    def __exit__(self, *exc: Any) -> None:
        _F.scaled_dot_product_attention, _F.dropout = _SDPA, _DROPOUT

    def _sdpa(self, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
              enable_gqa=False):
        if q.dim() != 4:
            return _SDPA(q, k, v, attn_mask, dropout_p, is_causal, scale=scale,
                         enable_gqa=enable_gqa)
        autocast = torch.is_autocast_enabled("cpu")
        if autocast:  # scaled_dot_product_attention is lower_precision_fp on CUDA
            lower = torch.get_autocast_dtype("cpu")
            q, k, v, attn_mask = (cast_eligible(t, lower) for t in (q, k, v, attn_mask))
        with torch.autocast("cpu", enabled=False) if autocast else contextlib.nullcontext():
            if attn_mask is not None and attn_mask.dtype == torch.bool:
                attn_mask = _bool_mask_to_float(attn_mask, q.dtype)
            grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
            unit = all(t.stride(-1) == 1 for t in (q, k, v, attn_mask) if t is not None)
            call = SdpaCall(q.dtype, q.shape[-1], v.shape[-1], q.shape[1], k.shape[1],
                            q.shape[2], k.shape[2], attn_mask is not None, float(dropout_p),
                            bool(is_causal), bool(enable_gqa), grad, unit)
            kernel = sdpa_kernel(self.target, call)
            self.kernels.append(kernel)
            if kernel == "math" and self.split is not None:
                raise HfMemkitError(
                    f"{'context' if self.split.kind == 'ring' else 'sequence'} parallelism needs "
                    "CUDA's flash, memory-efficient or cuDNN attention, but this call "
                    f"({call.dtype}, head size {call.head_dim}, mask "
                    f"{'given' if call.has_mask else 'none'}) takes the math kernel on this GPU; "
                    "use bf16/fp16 and no attention mask")
            if kernel == "math":
                return _math_attention(q, k, v, attn_mask, dropout_p, is_causal, scale,
                                       enable_gqa)
            if attn_mask is not None and kernel == "efficient":
                # attention.cu preprocess_mask: expand, then pad the last dim to 16 (pad_bias)
                b, h, s_q, s_k = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
                attn_mask = attn_mask.expand(b, h, s_q, s_k)
                if s_k % 16:
                    attn_mask = torch.nn.functional.pad(
                        attn_mask, (0, 16 - s_k % 16))[..., :s_k]
            return _FusedAttention.apply(q, k, v, attn_mask, kernel, float(dropout_p),
                                         bool(is_causal), scale, grad, self.split)


    def _dropout(self, input, p=0.5, training=True, inplace=False):  # noqa: A002 - F.dropout's
        """``at::dropout`` on CUDA: ``native_dropout`` (bool mask) when 0 < p < 1 and not in
        place."""
        if training and 0 < p < 1 and not inplace and input.numel() > 0:
            self.dropout = True
            return torch.ops.aten.native_dropout(input, p, True)[0]
        return _DROPOUT(input, p, training, inplace)


@contextlib.contextmanager
def emulate_cuda(target: CudaTarget | None,
                 split: SequenceSplit | None = None) -> Iterator[CudaOps | None]:
    """Trace as ``target`` runs (None: this CPU, unchanged); ``split``: each attention call is
    one rank's share of a sequence split over ranks (``_cuda.collectives``)."""
    if target is None:
        with around_attention(split) if split is not None else contextlib.nullcontext():
            yield None
        return
    with cuda_autocast(), CudaOps(target, split) as ops:
        yield ops
