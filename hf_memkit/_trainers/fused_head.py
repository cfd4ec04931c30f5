"""TRL's fused log-prob head (``trl.trainer.utils.add_fused_lm_head``), traced as it runs.

``SFTTrainer`` and ``DPOTrainer`` patch the model so that ``model(..., fused_lm_head=True)``
projects the last hidden states through the LM head in tiles of at most
``TOKEN_CHUNK_SIZE`` (4096) tokens x ``_CHUNKED_LOGPROB_CHUNK_SIZE`` (32768) vocabulary entries
(``trl/kernels/chunked_logprob.py``, ``ChunkedLogProbFunction``), never building the
``[tokens x vocab]`` logits. The trace patches the fake model with TRL's own function, so the
tile buffer, the per-token statistics and what the backward saves are TRL's.

What differs by device is the fold of each tile:
  * on CPU (no Triton), ``_forward_tile`` / ``_backward_tile`` run torch ops on the whole tile,
    creating several fp32 tile-sized temporaries: traced as they are;
  * on CUDA, the Triton ``_forward_kernel`` reads the tile and updates per-token statistics in
    place, ``_backward_kernel`` overwrites the tile with its gradient in place, and
    ``_addmm_fp32`` accumulates bf16/fp16 products with ``torch.addmm(..., out_dtype=float32,
    out=acc)``: none allocates. ``cuda_fold`` stands in for them with in-place no-ops, so a CUDA
    target's trace keeps only the tile buffer and TRL's other allocations.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

SFT_OUTPUTS = ("log_probs", "entropy", "is_top1")         # SFTTrainer.__init__
DPO_OUTPUTS = ("log_probs", "entropy", "mean_logits", "is_top1")  # DPOTrainer.__init__


def add_head(model: Any, outputs: tuple[str, ...] = ("log_probs",)) -> None:
    """``add_fused_lm_head`` on the fake (base) model, as the TRL trainer calls it."""
    from trl.trainer.utils import add_fused_lm_head

    add_fused_lm_head(model, outputs=outputs)


def _no_alloc(*args: Any, **kwargs: Any) -> None:
    """A Triton fold: reads and writes its arguments in place, allocates nothing."""


@contextlib.contextmanager
def cuda_fold() -> Iterator[None]:
    """While active, TRL's tile folds allocate what its Triton kernels allocate on CUDA."""
    from trl.kernels import chunked_logprob as cl

    originals = {name: getattr(cl, name) for name in
                 ("_forward_tile", "_backward_tile", "_addmm_fp32")}
    addmm = originals["_addmm_fp32"]

    def addmm_fp32(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
        if a.dtype in (torch.float16, torch.bfloat16):  # cuBLAS writes fp32 into acc directly
            return
        addmm(acc, a, b)  # fp32 inputs: .float() is a no-op on CUDA as here

    cl._forward_tile, cl._backward_tile, cl._addmm_fp32 = _no_alloc, _no_alloc, addmm_fp32
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(cl, name, fn)


def fold_context(target: Any) -> Any:
    return cuda_fold() if target is not None else contextlib.nullcontext()
