"""CUDA's autocast policy, run by CPU autocast while a CUDA target is traced (``cuda_autocast``).

CPU and CUDA autocast cast different op lists (aten/src/ATen/autocast_mode.cpp:
``TORCH_LIBRARY_IMPL(aten, Autocast, m)`` for CUDA from the ``AT_FORALL_*`` lists, and
``TORCH_LIBRARY_IMPL(aten, AutocastCPU, m)``). CUDA runs softmax, log_softmax, layer_norm,
exp, pow, ... in fp32 (``fp32`` / ``fp32_set_opt_dtype``); CPU leaves them in bf16/fp16. While
a CUDA target is traced, ``cuda_autocast`` registers Python kernels on the ``AutocastCPU``
dispatch key for every op where the two policies differ, implementing CUDA's policy
(``WrapFunction_`` in aten/src/ATen/autocast_mode.h); the registration is removed on exit.
Lower-precision casts of ops both devices list (linear, matmul, bmm, ...) stay with torch's own
kernel, so the autocast weight cache (``cached_cast``) behaves as on CUDA.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch

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


def cast_eligible(x: Any, dtype: torch.dtype) -> Any:
    """``x`` (or each of a list/tuple) cast to ``dtype`` where autocast would cast it."""
    if _eligible(x) and x.dtype != dtype:
        return x.to(dtype)
    if isinstance(x, (list, tuple)):
        return type(x)(cast_eligible(v, dtype) for v in x)
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
                return op(*cast_eligible(args, lower), **{k: cast_eligible(v, lower) for k, v in kwargs.items()})
            if policy == "fp32":
                return op(*cast_eligible(args, torch.float32),
                          **{k: cast_eligible(v, torch.float32) for k, v in kwargs.items()})
            if policy == "promote":
                to = _widest(args, kwargs, lower)
                return op(*cast_eligible(args, to), **{k: cast_eligible(v, to) for k, v in kwargs.items()})
            if policy == "append_dtype":  # norm(x, p, ...) computed in fp32
                return op(*cast_eligible(args, torch.float32), **kwargs)
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
