"""GaLore (package ``galore-torch`` 1.0; transformers ``trainer_optimizer._get_galore_optimizer``
and ``_setup_low_rank_optimizer``).

Which params are projected: the Trainer needs ``optim_target_modules`` (a list, a regex, or
``"all-linear"``) and takes the ``weight`` of every ``nn.Linear`` whose module name matches it
(``check_target_module_exists``; with ``"all-linear"`` every ``nn.Linear``, the untied LM head
included). Two groups replace the decay / no-decay split: ``[{non-targets}, {targets, rank,
update_proj_gap, scale, proj_type}]`` from ``optim_args`` (defaults 128, 200, 0.25, ``"std"``).

Projector (galore_torch/galore_projector.py ``GaLoreProjector``, kept in ``state["projector"]``;
``get_orthogonal_matrix``): ``U, s, Vh = torch.linalg.svd(grad.float(), full_matrices=False)``,
k = min(m, n), r = min(rank, k). With ``proj_type="std"`` an (m, n) grad with m >= n is projected
on the right (``ortho = Vh[:r]``, low-rank grad (m, r)), else on the left (``ortho = U[:, :r]``,
low-rank grad (r, n)); ``reverse_std`` swaps the sides, ``left`` / ``right`` fix one, ``full``
keeps both and projects to (r, r). For an fp32 grad the kept ortho is a *view*, so it holds the
whole ``Vh`` (k x n) or ``U`` (m x k) in fp32; for a bf16/fp16 grad it is converted back
(``.type(original_type)``), an (r x n) or (m x r) copy in the grad's dtype.

State, per optimizer (``step`` is a Python int in all three):
  * ``galore_adamw`` (galore_torch/adamw.py ``AdamW.step``): ``exp_avg``, ``exp_avg_sq`` =
    ``zeros_like(grad)`` of the low-rank grad for targets, of the param otherwise (param dtype).
  * ``galore_adafactor`` (adafactor.py; the Trainer sets ``scale_parameter=False,
    relative_step=False``, ``beta1=None``: no first moment): the grad is made fp32 first, so the
    projector is always the fp32 view; factored fp32 ``exp_avg_sq_row`` + ``exp_avg_sq_col`` of
    the (low-rank) 2-D grad, a full fp32 ``exp_avg_sq`` for 1-D, and ``RMS`` (a 0-d fp32 tensor).
  * ``galore_adamw_8bit`` (adamw8bit.py, a bitsandbytes ``Optimizer2State`` with
    ``optim_bits=8``): ``init_state`` runs on ``p.data`` swapped for the low-rank grad, so the
    bitsandbytes layout (uint8 + fp32 absmax per 256-block, fp32 below 4096 elements, two shared
    qmaps) applies to the low-rank shape; the Trainer's 32-bit override for embeddings does not
    apply (its class name holds no "bitsandbytes"). galore-torch 1.0 passes
    ``percentile_clipping=100, block_wise=True`` positionally, where bitsandbytes 0.50's
    ``Optimizer2State`` now takes ``max_unorm, skip_zeros``: ``max_unorm=100 > 0`` adds a
    ``unorm_vec`` (one fp32) per param (optimizer.py ``init_state``). Its ``step`` calls
    ``torch.cuda.synchronize()``: it runs on CUDA only.
Step transients are the named locals of ``step`` alive together (``Frame`` below), at steady
state: the SVD runs only when ``step % update_proj_gap == 0`` (the first step and every 200th),
and its LAPACK work buffers, U, s and Vh are not modelled. On CUDA, bitsandbytes' own kernels
work in place; only the projection temporaries count.
The ``*_layerwise`` variants are refused (lomo.py says why).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

from .._errors import HfMemkitError
from .base import OptimizerMemory, OptimizerProfile, register

if TYPE_CHECKING:
    from .base import OptimizerContext, ParamInfo

BNB_MIN_8BIT, BNB_BLOCK = 4096, 256


class Frame:
    """The local variables of one ``step()``: each name holds one tensor of some bytes; a tensor
    is freed when no name holds it. ``peak`` is the most bytes alive at once."""

    def __init__(self) -> None:
        self.names: dict[str, tuple[int, int]] = {}
        self.peak = 0
        self._next = 0

    def alive(self) -> int:
        return sum(dict(self.names.values()).values())

    def new(self, name: str, nbytes: int, *, temps: int = 0) -> None:
        """Bind ``name`` to a new tensor made while ``temps`` more bytes are briefly alive; the
        tensor ``name`` held before is released only after."""
        self.peak = max(self.peak, self.alive() + nbytes + temps)
        self._next += 1
        self.names[name] = (self._next, nbytes)

    def alias(self, name: str, other: str | None) -> None:
        """Bind ``name`` to what ``other`` holds (``None``: a tensor owned elsewhere)."""
        self._next += 1
        self.names[name] = self.names[other] if other else (self._next, 0)


def split_targets(params: Sequence[ParamInfo], ctx: OptimizerContext,
                  optim: str) -> tuple[list[ParamInfo], list[ParamInfo]]:
    """(non-targets, targets), in the Trainer's group order (trainer_optimizer.py
    _setup_low_rank_optimizer)."""
    from transformers.trainer_utils import check_target_module_exists

    wanted = ctx.target_modules
    if wanted is None:
        raise HfMemkitError(f"`{optim}` needs `optim_target_modules` (a list of module names, a "
                            "regex, or 'all-linear'), as the Trainer does")
    all_linear = isinstance(wanted, str) and wanted.replace("_", "-") == "all-linear"
    hit = [p.linear is not None and (all_linear or check_target_module_exists(wanted, p.linear))
           for p in params]
    if not any(hit):
        raise HfMemkitError(f"no nn.Linear module matches optim_target_modules={wanted!r} for "
                            f"`{optim}` (the Trainer raises too)")
    return ([p for p, h in zip(params, hit, strict=True) if not h],
            [p for p, h in zip(params, hit, strict=True) if h])


def projection(p: ParamInfo, ctx: OptimizerContext, *, fp32_grad: bool = False,
               svd: bool = True) -> tuple[tuple[int, ...], int]:
    """(low-rank grad shape, projector bytes) of a target (m, n) weight. ``fp32_grad``: the grad
    is made fp32 before projecting; ``svd`` False: APOLLO's random (rank x n) / (m x rank)."""
    m, n = p.shape
    rank = int(ctx.optim_args.get("rank", 128))
    kind = ctx.optim_args.get("proj_type", "std")
    side = {"std": "right" if m >= n else "left",
            "reverse_std": "left" if m >= n else "right"}.get(kind, kind)
    if side not in ("left", "right", "full") or (side == "full" and not svd):
        raise HfMemkitError(f"proj_type={kind!r} is not a projection this optimizer has")
    k = min(m, n)
    r = min(rank, k) if svd else rank
    view = svd and (fp32_grad or p.itemsize == 4)          # fp32: a view of the whole U / Vh
    item = 4 if (fp32_grad or view) else p.itemsize
    left = (m * k if view else m * r) * item
    right = (k * n if view else r * n) * item
    shapes = {"right": ((m, r), right), "left": ((r, n), left), "full": ((r, r), left + right)}
    return shapes[side]


def _adamw_steps(non_targets, targets, ctx, frame: Frame) -> Iterator[tuple[int, int]]:
    """galore_torch/adamw.py AdamW.step, one param at a time; yields each param's state."""
    for p, target in [(p, False) for p in non_targets] + [(p, True) for p in targets]:
        frame.alias("grad", None)                           # grad = p.grad
        low, proj = (projection(p, ctx) if target else (p.shape, 0))
        lr = math.prod(low) * p.itemsize
        if target:
            frame.new("grad", lr)                           # projector.project(grad)
        frame.new("denom", lr)                              # exp_avg_sq.sqrt().add_(eps)
        frame.new("norm_grad", lr)                          # exp_avg / denom
        if target:                                          # project_back: matmul, then * scale
            frame.new("norm_grad", p.nbytes, temps=p.nbytes)
        yield 2 * lr, proj


def _galore_adamw(params: Sequence[ParamInfo], ctx: OptimizerContext) -> OptimizerMemory:
    non, tgt = split_targets(params, ctx, "galore_adamw")
    frame = Frame()
    state = sum(a + b for a, b in _adamw_steps(non, tgt, ctx, frame))
    return OptimizerMemory(state, frame.peak)


def _galore_adamw_8bit(params: Sequence[ParamInfo], ctx: OptimizerContext) -> OptimizerMemory:
    if ctx.device_kind != "cuda":
        raise HfMemkitError("`galore_adamw_8bit` runs on CUDA only: galore_torch/adamw8bit.py "
                            "AdamW8bit.step calls torch.cuda.synchronize()")
    non, tgt = split_targets(params, ctx, "galore_adamw_8bit")
    state = 2 * 256 * 4                                     # bitsandbytes' two shared qmaps
    peak = 0
    for p, target in [(p, False) for p in non] + [(p, True) for p in tgt]:
        low, proj = projection(p, ctx) if target else (p.shape, 0)
        numel = math.prod(low)
        if numel >= BNB_MIN_8BIT:
            state += 2 * (numel + 4 * -(-numel // BNB_BLOCK)) + proj
        else:
            state += 2 * 4 * numel + proj
        state += 4  # unorm_vec: galore's positional args land on bitsandbytes' max_unorm
        if target:  # p.saved_data = p.data.clone(); p.data = grad.clone(); project_back(...)
            peak = max(peak, 2 * numel * p.itemsize + 2 * p.nbytes)
    return OptimizerMemory(state, peak)


def _adafactor_step(frame: Frame, p: ParamInfo, ctx: OptimizerContext, target: bool) -> int:
    """galore_torch/adafactor.py Adafactor.step for one param; returns its state bytes."""
    half = p.itemsize != 4
    full4 = 4 * p.numel
    frame.alias("grad", None)                               # grad = p.grad
    if half:
        frame.new("grad", full4)                            # grad.float()
    low, proj = projection(p, ctx, fp32_grad=True) if target else (p.shape, 0)
    low4 = 4 * math.prod(low)
    if target:
        frame.new("grad", low4)                             # projector.project(grad)
    if half:
        frame.new("p_data_fp32", full4)                     # p.float()
    else:
        frame.alias("p_data_fp32", None)
    frame.new("update", low4, temps=low4)                   # grad ** 2 + eps
    frame.new("update", low4)                               # _approx_sq_grad / rsqrt()
    if target:
        frame.new("update", full4, temps=full4)             # project_back: matmul, * scale
    frame.new("neg", full4)                                 # p_data_fp32.add_(-update)
    frame.alias("neg", None)
    if len(low) >= 2:
        state = 4 * (math.prod(low[:-1]) + math.prod(low[:-2]) * low[-1])
    else:
        state = low4
    return state + 4 + proj                                 # + RMS


def _galore_adafactor(params: Sequence[ParamInfo], ctx: OptimizerContext) -> OptimizerMemory:
    non, tgt = split_targets(params, ctx, "galore_adafactor")
    frame = Frame()
    state = sum(_adafactor_step(frame, p, ctx, False) for p in non)
    state += sum(_adafactor_step(frame, p, ctx, True) for p in tgt)
    return OptimizerMemory(state, frame.peak)


def _entry(name: str, estimate: Callable, cls: str, **kw) -> OptimizerProfile:
    return OptimizerProfile(name, estimate, f"galore_torch/{cls} step + galore_projector.py",
                            "galore_torch", accelerate_class=f"galore_torch.{cls}", **kw)


register(_entry("galore_adamw", _galore_adamw, "GaLoreAdamW"))
register(_entry("galore_adamw_8bit", _galore_adamw_8bit, "GaLoreAdamW8bit"))
register(_entry("galore_adafactor", _galore_adafactor, "GaLoreAdafactor",
                accelerate_kwargs={"scale_parameter": False, "relative_step": False}))
