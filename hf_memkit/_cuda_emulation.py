"""Trace what a CUDA target runs, on CPU fake tensors: CUDA's autocast policy, the SDPA kernel CUDA
would pick, and CUDA's fused dropout.

The trace runs on this machine's CPU (``_trace``), where torch takes CPU code paths that allocate
differently from CUDA (../shared/DESIGN.md, stack facts):

* **Autocast.** CPU and CUDA autocast cast different op lists (aten/src/ATen/autocast_mode.cpp:
  ``TORCH_LIBRARY_IMPL(aten, Autocast, m)`` for CUDA from the ``AT_FORALL_*`` lists, and
  ``TORCH_LIBRARY_IMPL(aten, AutocastCPU, m)``). CUDA runs softmax, log_softmax, layer_norm,
  exp, pow, ... in fp32 (``fp32`` / ``fp32_set_opt_dtype``); CPU leaves them in bf16/fp16. While
  a CUDA target is traced, ``cuda_autocast`` registers Python kernels on the ``AutocastCPU``
  dispatch key for every op where the two policies differ, implementing CUDA's policy
  (``WrapFunction_`` in aten/src/ATen/autocast_mode.h); the registration is removed on exit.
  Lower-precision casts of ops both devices list (linear, matmul, bmm, ...) stay with torch's own
  kernel, so the autocast weight cache (``cached_cast``) behaves as on CUDA.
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
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ._sdpa_kernels import SdpaCall, sdpa_kernel

# -- the target ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class CudaTarget:
    """What of a CUDA target changes the trace: its compute capability (SDPA kernel rules) and
    whether torch prefers cuDNN attention there (sdp_utils.cpp ``check_prefer_cudnn_attention``:
    sm90 / sm100 / sm103 with cuDNN > 9.15, which torch wheels ship from CUDA 13 on; "CUDA <= 12.9
    wheels ship with older cuDNN")."""

    compute_capability: tuple[int, int] = (8, 0)
    prefers_cudnn: bool = False

    @classmethod
    def of(cls, compute_capability: tuple[int, int] | None,
           cuda_version: str | None) -> CudaTarget:
        cc = tuple(compute_capability) if compute_capability else (8, 0)
        major = _major(cuda_version)
        prefers = major is not None and major >= 13 and cc in ((9, 0), (10, 0), (10, 3))
        return cls(cc, prefers)  # type: ignore[arg-type]


def _major(version: str | None) -> int | None:
    try:
        return int(str(version).split(".")[0])
    except (TypeError, ValueError):
        return None


# -- autocast: CUDA's policy on the AutocastCPU key ---------------------------------------------

# aten/src/ATen/autocast_mode.cpp. Only where CUDA's policy differs from CPU's.
# AT_FORALL_LOWER_PRECISION_FP entries that AutocastCPU does not list:
CUDA_LOWER_ONLY = ("addmv", "addr", "einsum", "mv", "chain_matmul", "linalg_multi_dot",
                   "convolution", "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell", "lstm_cell",
                   "gru_cell", "rnn_tanh_cell", "rnn_relu_cell",
                   "_scaled_dot_product_flash_attention")
# AT_FORALL_FP32 entries that AutocastCPU does not list as fp32:
CUDA_FP32_ONLY = ("acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2",
                  "log1p", "reciprocal", "rsqrt", "sinh", "tan", "pow.Tensor_Scalar",
                  "pow.Tensor_Tensor", "pow.Scalar", "softplus", "layer_norm",
                  "native_layer_norm", "group_norm", "frobenius_norm.dim", "nuclear_norm",
                  "nuclear_norm.dim", "cosine_similarity", "dist", "pdist", "renorm",
                  "logsumexp", "rms_norm", "upsample_nearest1d", "upsample_nearest2d",
                  "upsample_nearest3d", "upsample_linear1d", "upsample_bilinear2d",
                  "upsample_bicubic2d", "upsample_trilinear3d", "_upsample_nearest_exact1d",
                  "_upsample_nearest_exact2d", "_upsample_nearest_exact3d",
                  "_upsample_bilinear2d_aa", "_upsample_bicubic2d_aa")
# AT_FORALL_FP32_SET_OPT_DTYPE (CPU lists only prod, as plain fp32):
CUDA_FP32_SET_OPT_DTYPE = ("prod", "prod.dim_int", "softmax.int", "log_softmax.int", "cumprod",
                           "cumsum", "linalg_vector_norm", "linalg_matrix_norm",
                           "linalg_matrix_norm.str_ord", "sum", "sum.dim_IntList")
# AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE (fp32_append_dtype):
CUDA_FP32_APPEND_DTYPE = ("norm.Scalar", "norm.ScalarOpt_dim")
# AT_FORALL_PROMOTE:
CUDA_PROMOTE = ("addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot",
                "grid_sampler", "index_put", "tensordot", "scatter_add")
# binary_cross_entropy_banned: CUDA autocast raises (use binary_cross_entropy_with_logits)
CUDA_BANNED = ("binary_cross_entropy",)
# AutocastCPU entries CUDA does not list (CUDA falls through: no cast, composite ops decompose
# with autocast still on, e.g. cross_entropy_loss -> log_softmax (fp32) + nll_loss (fp32)).
CPU_ONLY = ("cross_entropy_loss", "stack", "cat", "index_copy", "avg_pool3d", "polar",
            "quantile", "nanquantile", "stft", "trace", "view_as_complex", "max_pool3d",
            "adaptive_avg_pool3d", "reflection_pad1d", "reflection_pad2d", "replication_pad1d",
            "replication_pad2d", "replication_pad3d", "ctc_loss.IntList", "ctc_loss.Tensor",
            "_native_multi_head_attention", "mkldnn_rnn_layer")

_AC = torch._C.DispatchKey.AutocastCPU


def _no_autocast():
    return torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(_AC))


def _eligible(t: Any) -> bool:
    """autocast_mode.h ``is_eligible``: a defined floating tensor that is not double."""
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64


def _cast(x: Any, dtype: torch.dtype) -> Any:
    if _eligible(x) and x.dtype != dtype:
        return x.to(dtype)
    if isinstance(x, (list, tuple)):
        return type(x)(_cast(v, dtype) for v in x)
    return x


def _widest(args: tuple, kwargs: dict, lower: torch.dtype) -> torch.dtype:
    """autocast_mode.h ``promote_type``: fp32 if any eligible argument is fp32, else lower."""
    flat = list(args) + list(kwargs.values())
    flat = [v for x in flat for v in (x if isinstance(x, (list, tuple)) else [x])]
    return torch.float32 if any(_eligible(t) and t.dtype == torch.float32 for t in flat) \
        else lower


def _policy_kernel(op: Any, policy: str):
    dtype_pos = next((i for i, a in enumerate(op._schema.arguments)
                      if a.name == "dtype" and not a.kwarg_only), None)

    def kernel(*args, **kwargs):
        lower = torch.get_autocast_dtype("cpu")
        if policy == "banned":
            raise RuntimeError(
                f"{op.name()} is unsafe to autocast on CUDA (torch raises there: "
                "binary_cross_entropy_banned); use binary_cross_entropy_with_logits / "
                "BCEWithLogitsLoss, which is safe under autocast")
        with _no_autocast():
            if policy == "lower":
                return op(*_cast(args, lower), **{k: _cast(v, lower) for k, v in kwargs.items()})
            if policy == "fp32":
                return op(*_cast(args, torch.float32),
                          **{k: _cast(v, torch.float32) for k, v in kwargs.items()})
            if policy == "promote":
                to = _widest(args, kwargs, lower)
                return op(*_cast(args, to), **{k: _cast(v, to) for k, v in kwargs.items()})
            if policy == "append_dtype":  # norm(x, p, ...) computed in fp32
                return op(*_cast(args, torch.float32), **kwargs)
            if policy == "set_opt_dtype" and args and _eligible(args[0]):
                if dtype_pos is not None and len(args) > dtype_pos:
                    if args[dtype_pos] is None:
                        args = args[:dtype_pos] + (torch.float32,) + args[dtype_pos + 1:]
                elif kwargs.get("dtype") is None:
                    kwargs = {**kwargs, "dtype": torch.float32}
            return op(*args, **kwargs)

    return kernel


def _fallthrough_kernel(op: Any):
    """What an op without a CUDA autocast kernel does: composite ops decompose with autocast on
    (their parts get CUDA's policy), the rest run uncast."""
    composite = torch._C._dispatch_has_kernel_for_dispatch_key(
        op.name(), torch._C.DispatchKey.CompositeImplicitAutograd)

    def kernel(*args, **kwargs):
        if composite:
            return op.decompose(*args, **kwargs)
        with _no_autocast():
            return op(*args, **kwargs)

    return kernel


def _overload(name: str) -> Any | None:
    base, _, ov = name.partition(".")
    packet = getattr(torch.ops.aten, base, None)
    return getattr(packet, ov or "default", None) if packet is not None else None


def policy_table() -> dict[str, str]:
    """aten op name -> the CUDA policy the trace applies on the AutocastCPU key."""
    table = {n: "lower" for n in CUDA_LOWER_ONLY}
    table.update({n: "fp32" for n in CUDA_FP32_ONLY})
    table.update({n: "set_opt_dtype" for n in CUDA_FP32_SET_OPT_DTYPE})
    table.update({n: "append_dtype" for n in CUDA_FP32_APPEND_DTYPE})
    table.update({n: "promote" for n in CUDA_PROMOTE})
    table.update({n: "fallthrough" for n in CPU_ONLY})
    table.update({n: "banned" for n in CUDA_BANNED})
    return table


@contextlib.contextmanager
def cuda_autocast() -> Iterator[None]:
    """While active, CPU autocast follows CUDA's op policy (in the autocast dtype it is entered
    with, bf16 or fp16)."""
    lib = torch.library.Library("aten", "IMPL")
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*[Oo]verrid.*")
            for name, policy in policy_table().items():
                op = _overload(name)
                if op is None:  # not in this torch build
                    continue
                kernel = _fallthrough_kernel(op) if policy == "fallthrough" else \
                    _policy_kernel(op, policy)
                lib.impl(name, kernel, "AutocastCPU")
        yield
    finally:
        lib._destroy()


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
    def forward(ctx, q, k, v, mask, kernel, dropout, causal, scale, grad):  # noqa: D102
        aten = torch.ops.aten
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
        ctx.save_for_backward(q, k, v, mask, *saved)
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
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        del temps
        return dq, dk, dv, None, None, None, None, None, None


def _bool_mask_to_float(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """sdp_utils ``convert_boolean_attn_mask``: a new additive mask of the query dtype."""
    return torch.zeros(mask.shape, dtype=dtype).masked_fill_(mask.logical_not(), -math.inf)


def _math_attention(q, k, v, mask, dropout, causal, scale, enable_gqa):
    """aten ``_scaled_dot_product_attention_math`` with CUDA's dropout (bool mask)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if enable_gqa and k.shape[-3] != q.shape[-3]:
        rep = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(rep, dim=-3), v.repeat_interleave(rep, dim=-3)
    root = math.sqrt(scale)
    attn = (q * root) @ (k * root).transpose(-2, -1)
    if causal:
        keep = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
        attn = attn + _bool_mask_to_float(keep, attn.dtype)
    if mask is not None:
        attn = attn + mask
    attn = torch.softmax(attn, -1)
    if dropout > 0:
        attn = torch.ops.aten.native_dropout(attn, dropout, True)[0]
    return attn @ v


_F = torch.nn.functional
_SDPA, _DROPOUT = _F.scaled_dot_product_attention, _F.dropout


class CudaOps:
    """Routes ``F.scaled_dot_product_attention`` to the kernel CUDA would pick and ``F.dropout``
    to CUDA's fused dropout while entered (both are looked up on ``torch.nn.functional`` at call
    time by transformers and ``nn.Dropout``; a patch, unlike a TorchFunctionMode, also holds
    during checkpoint recomputation inside the backward)."""

    def __init__(self, target: CudaTarget):
        self.target = target
        self.kernels: list[str] = []   # the kernel of each SDPA call, in order

    def __enter__(self) -> CudaOps:
        _F.scaled_dot_product_attention, _F.dropout = self._sdpa, _dropout
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
            q, k, v, attn_mask = (_cast(t, lower) for t in (q, k, v, attn_mask))
        with torch.autocast("cpu", enabled=False) if autocast else contextlib.nullcontext():
            if attn_mask is not None and attn_mask.dtype == torch.bool:
                attn_mask = _bool_mask_to_float(attn_mask, q.dtype)
            grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
            call = SdpaCall(q.dtype, q.shape[-1], v.shape[-1], q.shape[1], k.shape[1],
                            q.shape[2], k.shape[2], attn_mask is not None, float(dropout_p),
                            bool(is_causal), bool(enable_gqa), grad)
            kernel = sdpa_kernel(self.target, call)
            self.kernels.append(kernel)
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
                                         bool(is_causal), scale, grad)


def _dropout(input, p=0.5, training=True, inplace=False):  # noqa: A002 - F.dropout's names
    """``at::dropout`` on CUDA: ``native_dropout`` (bool mask) when 0 < p < 1 and not in place."""
    if training and 0 < p < 1 and not inplace and input.numel() > 0:
        return torch.ops.aten.native_dropout(input, p, True)[0]
    return _DROPOUT(input, p, training, inplace)


@contextlib.contextmanager
def emulate_cuda(target: CudaTarget | None) -> Iterator[CudaOps | None]:
    """Trace as ``target`` runs (None: this CPU, unchanged)."""
    if target is None:
        yield None
        return
    with cuda_autocast(), CudaOps(target) as ops:
        yield ops
