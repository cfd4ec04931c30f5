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

And which positions it scores (``add_fused_lm_head``'s forward, ``compact =
_use_triton(hidden_states.device)``): on a Triton device (CUDA) only the labelled ones,
``hidden_states[mask]`` with ``mask = labels[:, 1:] != -100``, so the tile (``min(N, 4096)``
rows), the per-token statistics, the gathered hidden states and their fp32 gradient follow the
``N`` labelled positions; elsewhere every position (``hidden_states.reshape(-1, H)``). Labels
are -100 on DPO's prompt and padding (``DPOTrainer._compute_loss``: ``completion_mask == 0``) and
on SFT's prompt with ``completion_only_loss`` / outside the assistant turns with
``assistant_only_loss`` (``DataCollatorForLanguageModeling``). A CUDA target's trace takes the
compact branch; ``labelled`` sizes the selection: the ``completion_len`` the user gave per row,
else every position (today's upper bound).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
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


def labelled(options: Mapping[str, Any], mask_shape: tuple[int, ...]) -> int:
    """The positions TRL's head scores on CUDA for a ``[rows, positions]`` label mask (labels
    shifted by one): ``completion_len`` per row (DPO: per chosen or rejected row), per sequence
    of ``row_len`` tokens in a padding-free row, else every position."""
    rows, positions = mask_shape[0], mask_shape[-1]
    c = options.get("completion_len")
    if not c or options.get("tokens"):
        return rows * positions
    if options.get("padding_free"):  # one row of sequences of about row_len tokens each
        return min(positions, -(-(positions + 1) * c // options["row_len"]))
    return rows * min(c, positions)


@contextlib.contextmanager
def cuda_fold(options: Mapping[str, Any] | None = None) -> Iterator[None]:
    """While active, TRL's tile folds allocate what its Triton kernels allocate on CUDA, and its
    head scores the labelled positions only (``labelled`` of ``options``)."""
    from trl.kernels import chunked_logprob as cl
    from trl.trainer import utils as tu

    from .._trace.masked import MaskedSelect

    originals = {name: getattr(cl, name) for name in
                 ("_forward_tile", "_backward_tile", "_addmm_fp32")}
    use_triton = tu._use_triton
    addmm = originals["_addmm_fp32"]

    def addmm_fp32(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
        if a.dtype in (torch.float16, torch.bfloat16):  # cuBLAS writes fp32 into acc directly
            return
        addmm(acc, a, b)  # fp32 inputs: .float() is a no-op on CUDA as here

    cl._forward_tile, cl._backward_tile, cl._addmm_fp32 = _no_alloc, _no_alloc, addmm_fp32
    tu._use_triton = _on_cuda
    try:
        with MaskedSelect(lambda shape: labelled(options or {}, shape)):
            yield
    finally:
        for name, fn in originals.items():
            setattr(cl, name, fn)
        tu._use_triton = use_triton


def _on_cuda(device: Any) -> bool:
    """``_use_triton`` as on a CUDA device: TRL's head takes its compact branch."""
    return True


def fold_context(target: Any, options: Mapping[str, Any] | None = None) -> Any:
    return cuda_fold(options) if target is not None else contextlib.nullcontext()


def head_notes(options: Mapping[str, Any], masked: str | None) -> list[str]:
    """What the estimate says of the positions TRL's head scores (``masked``: the part of a
    row the trainer labels -100, None when it labels every token)."""
    c = options.get("completion_len")
    if c and options.get("tokens"):
        return [f"completion_len={c} is not applied to micro-batches planned from lengths= (the "
                "number of sequences in the fullest one is not known): the head scores every "
                "position, an upper bound"]
    if c:
        return [f"TRL's fused head on CUDA scores only the labelled positions: {c} per row "
                f"(completion_len; {masked} unlabelled); on a CPU it scores every position"]
    if masked:
        return [f"on CUDA TRL's fused head scores only the labelled positions ({masked} is "
                "unlabelled); without completion_len=<labelled tokens per row> the estimate "
                "scores every position (an upper bound)"]
    return []


def with_completion(setup: Any, completion_len: int | None, seq_len: int) -> Any:
    """``setup`` whose trainer scores ``completion_len`` labelled positions per row on CUDA
    (None: ``setup`` as it is). Refused, with why, where the trainer labels every token."""
    from .._errors import ConfigError
    from .._techniques import TechniqueUse

    if completion_len is None:
        return setup
    kind, o = setup.trainer_kind, setup.trainer_options
    why = kind.completion_problem(o)
    if isinstance(completion_len, bool) or not isinstance(completion_len, int) \
            or completion_len < 1:
        why = f"completion_len must be a positive integer (tokens per row), got {completion_len!r}"
    if why:
        raise ConfigError([why], source="estimate_memory")
    before = set(kind.notes(o))
    o.update(completion_len=completion_len, row_len=seq_len)
    notes = tuple(n for n in setup.notes if n not in before) + tuple(kind.notes(o))
    return setup.replace(trainer=TechniqueUse.of(kind.name, o), notes=notes)
