"""What the libraries that split a sequence over ranks allocate around each attention kernel
(``SequenceSplit``): torch's ring attention (context parallelism, accelerate's ``cp_size``) and
DeepSpeed's Ulysses (sequence parallelism, ``sp_size``).

The trace (``_cuda.emulation``) allocates these bytes inside each attention call, where the
libraries allocate them: a transient that lives while the forward kernel runs, one that lives
while its backward runs, and (Ulysses) bytes the attention saves for the backward. So they land
in the step's event stream at the layer and moment they occur, are extrapolated with the layers,
are replayed by the allocator model, and follow checkpointing (saved bytes are dropped and
recomputed as the attention's own).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

RING, ULYSSES = "ring", "ulysses"


def ring_buffers(*, batch: int, local_seq: int, heads: int, kv_heads: int, head_dim: int,
                 itemsize: int, cp: int, comm: str) -> dict[str, int]:
    """Bytes one ring attention call holds on a rank beyond local attention over its chunk, at
    its peak (torch 2.13 ``_context_parallel/_attention.py``, ``convert_to_f32=True``; the worst
    rank under head-tail load balancing). With ``U_q`` / ``U_kv`` the query / key elements of
    the chunk, ``L`` the logsumexp elements and ``e`` the itemsize:

    * the key/value in flight: ``allgather`` gathers all of them once (``2e x cp x U_kv``, in
      the forward and again in the backward), ``alltoall`` holds two received chunks
      (``4e x U_kv``; one for ``cp = 2``, where nothing is sent on);
    * forward (``_templated_ring_attention``): the merger (``_SDPAMerger``) keeps the output in
      fp32 and updates it as ``out - sigmoid(lse' - lse) * (out - out')``: 4 fp32 copies of the
      output (``16 U_q``) and fp32 logsumexp temporaries (``8 L`` beyond the kernel's own);
    * backward (``_templated_ring_attention_backward``): the fp32 query-gradient accumulator
      (``4 U_q``), the key/value gradients rotating by all-to-all in fp32 whatever the method
      (received, concatenated, sent, next, and the partial updates' copies: ``40 U_kv``) and the
      key/value concatenated for sending (``e x U_kv`` beyond the kernel's own gradients).

    ``tests/unit/estimate/test_ring_attention_buffers.py`` runs torch's ring functions on fake
    tensors over a fake process group and checks these to the byte."""
    u_q = batch * heads * local_seq * head_dim
    u_kv = batch * kv_heads * local_seq * head_dim
    lse = batch * heads * local_seq
    # alltoall: the chunk received while the next is sent (two in flight; one when cp = 2)
    rotate = 2 * itemsize * u_kv * (cp if comm == "allgather" else min(2, cp - 1))
    return {"forward": rotate + 16 * u_q + 8 * lse,
            "backward": rotate + 4 * u_q + 40 * u_kv + itemsize * u_kv}


def ulysses_buffers(*, batch: int, local_seq: int, heads: int, kv_heads: int, head_dim: int,
                    itemsize: int, sp: int) -> dict[str, int]:
    """Bytes DeepSpeed's ``UlyssesSPAttentionHF`` holds on a rank beyond local attention over
    its chunk (deepspeed 0.19 ``runtime/sequence_parallel/ulysses_sp.py``; read from the code,
    not measured). Query, key and value are each rearranged into a contiguous send buffer and
    exchanged into a new tensor (``_dim_zero_all_to_all``: ``empty_like`` +
    ``all_to_all_single``) while the caller still holds the local ones: during the forward the
    received query, key and value and one send buffer (``2Q + 2K``) are extra. With fewer
    key/value heads than ``sp`` they are first repeated ``rep = sp / kv_heads`` times, and the
    attention saves the repeated key and value (``saved``: ``2K (rep - 1)`` more than local
    attention saves, until the backward). The backward exchanges the gradients the same way
    (``2Q``)."""
    q = batch * heads * local_seq * head_dim * itemsize
    k = batch * kv_heads * local_seq * head_dim * itemsize
    rep = max(1, sp // kv_heads)
    return {"forward": 2 * q + 2 * k, "backward": 2 * q, "saved": 2 * k * (rep - 1)}


@dataclass(frozen=True)
class SequenceSplit:
    """A sequence split over ``degree`` ranks: ``kind`` "ring" (torch context parallelism,
    rotating key/value by ``comm``) or "ulysses" (DeepSpeed sequence parallelism)."""

    kind: str
    degree: int
    comm: str = "allgather"

    def key(self) -> tuple:
        return (self.kind, self.degree, self.comm)

    def attention_bytes(self, q_shape: tuple[int, ...], kv_heads: int,
                        itemsize: int) -> tuple[int, int, int]:
        """(forward transient, backward transient, saved for backward) of one attention call
        whose query is ``q_shape`` (batch, heads, local sequence, head size) on one rank."""
        b, h, s, d = q_shape
        common = dict(batch=b, local_seq=s, heads=h, kv_heads=kv_heads, head_dim=d,
                      itemsize=itemsize)
        if self.kind == RING:
            r = ring_buffers(**common, cp=self.degree, comm=self.comm)
            return r["forward"], r["backward"], 0
        u = ulysses_buffers(**common, sp=self.degree)
        return u["forward"], u["backward"], u["saved"]


class _Around(torch.autograd.Function):
    """Identity on the query that holds a split's saved bytes until the attention's backward
    and allocates its backward transient there (after the kernel's own gradients)."""

    @staticmethod
    def forward(ctx, q, backward_bytes, saved_bytes):  # noqa: D102
        ctx.backward_bytes = backward_bytes
        kept = torch.empty(saved_bytes, dtype=torch.uint8) if saved_bytes else None
        ctx.save_for_backward(kept)
        return q.view_as(q)

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        transient = torch.empty(ctx.backward_bytes, dtype=torch.uint8) \
            if ctx.backward_bytes else None
        del transient
        return grad, None, None


@contextlib.contextmanager
def around_attention(split: SequenceSplit) -> Iterator[None]:
    """Where the attention kernel is this machine's own (a CPU target: DeepSpeed's Ulysses runs
    on gloo), allocate ``split``'s bytes around every ``F.scaled_dot_product_attention`` call
    (a CUDA target allocates them inside its emulated kernel, ``_cuda.emulation``)."""
    sdpa = F.scaled_dot_product_attention

    def wrapped(q, k, v, *args, **kwargs):
        if q.dim() != 4:
            return sdpa(q, k, v, *args, **kwargs)
        fwd, bwd, keep = split.attention_bytes(tuple(q.shape), k.shape[1], q.element_size())
        if q.requires_grad and torch.is_grad_enabled():
            q = _Around.apply(q, bwd, keep)
        in_flight = torch.empty(fwd, dtype=torch.uint8) if fwd else None
        out = sdpa(q, k, v, *args, **kwargs)
        del in_flight
        return out

    F.scaled_dot_product_attention = wrapped
    try:
        yield
    finally:
        F.scaled_dot_product_attention = sdpa
