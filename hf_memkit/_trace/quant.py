"""QLoRA's NF4 base linears as the trace sees them (``SimLinear4bit``); which linears bitsandbytes
replaces is a model fact (``_model.adapters.quantizable_linears``)."""

from __future__ import annotations

import torch


class _Dequant4bitMatmul(torch.autograd.Function):
    """Memory behaviour of bitsandbytes' MatMul4Bit (bitsandbytes/autograd/_functions.py): the
    forward dequantises the packed weight to the compute dtype for the GEMM; only the packed
    weight is kept for backward, which dequantises it again to compute the input's gradient."""

    @staticmethod
    def forward(ctx, x, packed, out_features: int):
        w = torch.empty(out_features, x.shape[-1], dtype=x.dtype, device=x.device)
        ctx.save_for_backward(packed)
        ctx.shape = (out_features, x.shape[-1])
        return x @ w.t()

    @staticmethod
    def backward(ctx, grad):
        w = torch.empty(ctx.shape, dtype=grad.dtype, device=grad.device)
        return grad @ w, None, None


class SimLinear4bit(torch.nn.Module):
    """Stands in for ``bnb.nn.Linear4bit`` while tracing: an NF4-packed frozen weight
    (2 weights per byte) with one fp32 absmax per 64-weight block, and Linear4bit.forward's
    dtype handling (input cast to the compute dtype, output cast back)."""

    def __init__(self, linear: torch.nn.Linear, compute_dtype: torch.dtype):
        super().__init__()
        n = linear.in_features * linear.out_features
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.compute_dtype = compute_dtype
        self.weight = torch.nn.Parameter(torch.empty((n + 1) // 2, 1, dtype=torch.uint8),
                                         requires_grad=False)
        self.register_buffer("absmax", torch.empty(-(-n // 64), dtype=torch.float32))
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inp_dtype = x.dtype
        out = _Dequant4bitMatmul.apply(x.to(self.compute_dtype), self.weight, self.out_features)
        if self.bias is not None:
            out = out + self.bias.to(self.compute_dtype)
        return out.to(inp_dtype)


__all__ = ["SimLinear4bit"]
