"""Which SDPA kernel CUDA runs for a call: aten/src/ATen/native/transformers/cuda/sdp_utils.cpp
(``select_sdp_backend``, ``can_use_flash_attention``, ``can_use_mem_efficient_attention``,
``check_cudnn_tensor_shapes``, ``check_cudnn_dropout``, ``priority_order``). A pure function of
the call's shapes and dtypes and the target (``_cuda.target.CudaTarget``), so it is tested
rule by rule without a GPU."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .target import CudaTarget

HALF = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class SdpaCall:
    """The properties of one scaled_dot_product_attention call that decide CUDA's kernel."""

    dtype: torch.dtype
    head_dim: int
    head_dim_v: int
    q_heads: int
    kv_heads: int
    q_len: int
    kv_len: int
    has_mask: bool = False
    dropout: float = 0.0
    is_causal: bool = False
    enable_gqa: bool = False
    requires_grad: bool = True
    # the last dimension of query, key, value and the mask has stride 1: every fused GPU kernel
    # needs it (sdp_utils_cpp.h ``check_last_dim_stride_equals_1_dense``: "GPU backends require
    # attn_mask's last dimension to have stride 1 while the CPU does not"). A mask made by
    # permuting a learned bias (T5's relative position bias in transformers < 5.2x) fails it.
    last_dim_contiguous: bool = True


def _heads_ok(c: SdpaCall, supports_gqa: bool) -> bool:
    """sdp_utils.cpp ``check_batch_size_and_num_heads_dense<supports_gqa>``."""
    if c.q_heads == c.kv_heads:
        return True
    return supports_gqa and c.enable_gqa and c.q_heads % c.kv_heads == 0


def _flash_ok(c: SdpaCall, cc: tuple[int, int]) -> bool:
    if c.has_mask or c.dtype not in HALF:  # check_for_attn_mask, check_dtypes_flash_attention
        return False
    if c.head_dim != c.head_dim_v or c.head_dim > 256:  # check_head_dim_size_flash
        return False
    if not (8, 0) <= cc <= (12, 1):  # check_flash_attention_hardware_support
        return False
    # check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89_or_120
    if c.requires_grad and ((8, 6) <= cc <= (8, 9) or (12, 0) <= cc <= (12, 1)) and (
            192 < c.head_dim <= 224 or (c.head_dim > 224 and c.dropout > 0)):
        return False
    if c.is_causal and c.q_len != c.kv_len:  # check_flash_causal_non_square_seqlens
        return False
    return _heads_ok(c, supports_gqa=True)


def _efficient_ok(c: SdpaCall, cc: tuple[int, int]) -> bool:
    if not (5, 0) <= cc <= (12, 1):  # check_mem_efficient_hardware_support
        return False
    half = c.dtype in HALF  # minimum_gemm_alignment + check_head_dim_size_mem_efficient
    tensor_cores = cc[0] >= 8 or (cc[0] >= 7 and half)
    align = 4 if cc[0] >= 8 else 1
    if tensor_cores:
        align = max(align, 128 // (16 if half else 32))
    if c.head_dim % align or c.head_dim_v % align:
        return False
    dtypes = (torch.float16, torch.float32, torch.bfloat16) if cc[0] >= 8 else \
        (torch.float16, torch.float32)
    return c.dtype in dtypes and _heads_ok(c, supports_gqa=False)


def _cudnn_ok(c: SdpaCall, cc: tuple[int, int], new_cudnn: bool) -> bool:
    # check_cudnn_hardware_support (sm80+), check_cudnn_tensor_shapes, check_cudnn_dtype
    if cc < (8, 0) or c.dtype not in HALF or c.kv_len == 1:
        return False
    limit = 256 if new_cudnn and cc == (9, 0) else 128
    if c.head_dim > limit or c.head_dim_v > limit or c.head_dim % 8 or c.head_dim_v % 8:
        return False
    if c.dropout and (c.dropout * 16) % 1:  # check_cudnn_dropout: steps of 1/16 only
        return False
    return _heads_ok(c, supports_gqa=True)


def sdpa_kernel(target: CudaTarget, c: SdpaCall) -> str:
    """'cudnn', 'flash', 'efficient' or 'math': what CUDA's ``select_sdp_backend`` picks
    (priority cuDNN first only where torch prefers it, else flash, efficient, math)."""
    cc = target.compute_capability
    order = ("cudnn", "flash", "efficient", "math") if target.prefers_cudnn else \
        ("flash", "efficient", "math")
    for kernel in order:
        if kernel != "math" and not c.last_dim_contiguous:
            continue
        if kernel == "math" or (kernel == "flash" and _flash_ok(c, cc)) or (
                kernel == "efficient" and _efficient_ok(c, cc)) or (
                kernel == "cudnn" and _cudnn_ok(c, cc, target.prefers_cudnn)):
            return kernel
    return "math"  # pragma: no cover - math is always last


