"""Optimizer memory, one registered profile per ``TrainingArguments.optim`` value (STYLE.md §2).

Each profile gives, for the trainable parameters:
  * ``state``: bytes of persistent optimizer state (created lazily at the first ``step()``);
  * ``transient``: the largest extra allocation alive *inside* ``step()``;
  * ``paged``: bytes of state that live in CUDA unified (managed) memory instead of the caching
    allocator (bitsandbytes paged optimizers), so ``max_memory_allocated`` does not see them.

Sources are cited per entry: the optimizer's own ``step`` code in the installed library.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ._errors import HfMemkitError, did_you_mean


@dataclass(frozen=True)
class ParamInfo:
    """One trainable parameter tensor, as the optimizer sees it."""

    numel: int
    shape: tuple[int, ...]
    itemsize: int  # bytes per element of the parameter (and of its gradient)
    embedding: bool = False  # the weight of an nn.Embedding (bitsandbytes keeps it 32-bit)

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


@dataclass(frozen=True)
class OptimizerContext:
    """Facts of the run that change optimizer memory."""

    device_kind: str = "cpu"                  # foreach defaults on only for CUDA tensors
    optim_args: dict[str, str] = field(default_factory=dict)
    num_groups: int = 2                       # the Trainer: decay / no-decay groups


@dataclass(frozen=True)
class OptimizerMemory:
    state: int
    transient: int
    paged: int = 0


@dataclass(frozen=True)
class OptimizerProfile:
    name: str
    estimate: Callable[[Sequence[ParamInfo], OptimizerContext], OptimizerMemory]
    source: str
    needs: str | None = None  # optional package that the Trainer needs for it


_REGISTRY: dict[str, OptimizerProfile] = {}


def register(profile: OptimizerProfile, *aliases: str) -> None:
    for name in (profile.name, *aliases):
        _REGISTRY[name] = profile


def supported_optimizers() -> list[str]:
    return sorted(_REGISTRY)


def get_optimizer_profile(name: str) -> OptimizerProfile:
    key = str(getattr(name, "value", name))
    if key not in _REGISTRY:
        raise HfMemkitError(
            f"cannot model the memory of optimizer `{key}`{did_you_mean(key, _REGISTRY)}; "
            f"modelled: {', '.join(supported_optimizers())}. Pick one of these for `optim`, or "
            "open an issue with the optimizer's state layout"
        )
    return _REGISTRY[key]


# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------

STEP_TENSOR = 4  # torch.optim keeps `state["step"]` as a float32 0-d tensor per parameter


def _largest(params: Sequence[ParamInfo]) -> int:
    return max((p.nbytes for p in params), default=0)


def _foreach(ctx: OptimizerContext) -> bool:
    # torch.optim.optimizer._default_to_fused_or_foreach: foreach only when every param is a
    # native tensor on a foreach-supported device (CUDA); CPU runs the single-tensor loop.
    return ctx.device_kind == "cuda"


def _per_tensor_state(params: Sequence[ParamInfo], copies: int) -> int:
    return sum(copies * p.nbytes + STEP_TENSOR for p in params)


# ----------------------------------------------------------------------------------------------
# torch.optim AdamW (torch/optim/adamw.py -> adam.py)
#   state: exp_avg + exp_avg_sq, zeros_like(param): 2 x param bytes (8 B/param in fp32) + step.
#   single-tensor (CPU): `denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)` holds
#     the sqrt() result and the quotient together while the previous parameter's `denom` is still
#     bound: max over consecutive params of one group of (previous + 2 x current).
#   foreach (CUDA): `exp_avg_sq_sqrt = torch._foreach_sqrt(device_exp_avg_sqs)` materialises a
#     copy of the whole param group (the decay group holds almost every parameter).
#   fused: `torch._fused_adamw_` updates in place, no temporaries.
# ----------------------------------------------------------------------------------------------


def trainer_groups(params: Sequence[ParamInfo]) -> list[list[ParamInfo]]:
    """The Trainer's two groups, in model order: weight-decayed (matrices) and not (biases,
    norms). transformers/trainer.py get_decay_parameter_names excludes biases and norm weights."""
    decay = [p for p in params if len(p.shape) >= 2]
    no_decay = [p for p in params if len(p.shape) < 2]
    return [g for g in (decay, no_decay) if g]


def _adamw_torch(params: Sequence[ParamInfo], ctx: OptimizerContext) -> OptimizerMemory:
    state = _per_tensor_state(params, 2)
    groups = trainer_groups(params)
    if _foreach(ctx):
        transient = max((sum(p.nbytes for p in g) for g in groups), default=0)
    else:
        transient = max((g[i - 1].nbytes * (i > 0) + 2 * g[i].nbytes
                         for g in groups for i in range(len(g))), default=0)
    return OptimizerMemory(state, transient)


def _adamw_fused(params: Sequence[ParamInfo], ctx: OptimizerContext) -> OptimizerMemory:
    return OptimizerMemory(_per_tensor_state(params, 2), 0)


register(OptimizerProfile("adamw_torch", _adamw_torch, "torch/optim/adam.py _single/_multi_tensor_adam"))
register(OptimizerProfile("adamw_torch_fused", _adamw_fused, "torch/optim/adam.py _fused_adam"))


# ----------------------------------------------------------------------------------------------
# bitsandbytes 8-bit blockwise optimizers (bitsandbytes/optim/optimizer.py Optimizer2State /
# Optimizer1State.init_state):
#   numel < min_8bit_size (4096): state kept in fp32 (4 B per state per element);
#   else uint8 state (1 B) + fp32 absmax per 256-element block, per state;
#   qmap tables (256 fp32 each) are shared across parameters.
#   The Trainer registers every nn.Embedding weight for 32-bit state (transformers/trainer.py
#   create_optimizer: GlobalOptimManager.register_module_override(module, "weight",
#   {"optim_bits": 32})), and the measured CPU runs confirm it.
#   Paged variants (get_state_buffer): on CUDA, buffers of >= 1e5 elements go to managed memory.
#   On CUDA the update kernels work in place; on CPU bnb's torch fallback dequantises the two
#   states of the parameter being updated to fp32 (measured: ~3 fp32 copies of the largest param).
# ----------------------------------------------------------------------------------------------

MIN_8BIT_SIZE = 4096
BNB_BLOCK = 256
PAGED_MIN_NUMEL = 100_000


def _bnb(states: int, bits: int, paged: bool) -> Callable[[Sequence[ParamInfo], OptimizerContext],
                                                         OptimizerMemory]:
    def estimate(params: Sequence[ParamInfo], ctx: OptimizerContext) -> OptimizerMemory:
        resident = paged_bytes = 0
        for p in params:
            if bits == 32 or p.numel < MIN_8BIT_SIZE or p.embedding:
                b = states * 4 * p.numel
            else:
                blocks = -(-p.numel // BNB_BLOCK)
                b = states * (p.numel + 4 * blocks)
            if paged and ctx.device_kind == "cuda" and p.numel >= PAGED_MIN_NUMEL:
                paged_bytes += b
            else:
                resident += b
        if bits == 8:
            resident += states * 256 * 4  # shared qmaps
        if ctx.device_kind == "cuda":
            transient = 0
        else:  # torch fallback: fp32 dequantised copies of the states of one parameter + update
            largest = max((p.numel for p in params), default=0)
            transient = (states + 1) * 4 * largest if bits == 8 else 4 * largest
        return OptimizerMemory(resident, transient, paged_bytes)

    return estimate


_BNB_SRC = "bitsandbytes/optim/optimizer.py Optimizer{1,2}State.init_state"
register(OptimizerProfile("adamw_bnb_8bit", _bnb(2, 8, False), _BNB_SRC, "bitsandbytes"), "adamw_8bit")
register(OptimizerProfile("paged_adamw_8bit", _bnb(2, 8, True), _BNB_SRC, "bitsandbytes"))
register(OptimizerProfile("paged_adamw_32bit", _bnb(2, 32, True), _BNB_SRC, "bitsandbytes"))
register(OptimizerProfile("lion_8bit", _bnb(1, 8, False), _BNB_SRC, "bitsandbytes"))
register(OptimizerProfile("lion_32bit", _bnb(1, 32, False), _BNB_SRC, "bitsandbytes"))
register(OptimizerProfile("paged_lion_8bit", _bnb(1, 8, True), _BNB_SRC, "bitsandbytes"))
register(OptimizerProfile("paged_lion_32bit", _bnb(1, 32, True), _BNB_SRC, "bitsandbytes"))


# ----------------------------------------------------------------------------------------------
# Adafactor (transformers/optimization.py Adafactor; the Trainer sets scale_parameter=False,
# relative_step=False, beta1=None): no first moment. For >= 2-D params the second moment is
# factored: exp_avg_sq_row (rows) + exp_avg_sq_col (cols), fp32; 1-D params keep a full fp32
# exp_avg_sq. step() works per parameter on fp32 copies: `grad.float()` (when not fp32),
# `update = grad**2 + eps`, the rsqrt outer product, and the update itself: ~3 fp32 copies of
# the parameter being updated at once.
# ----------------------------------------------------------------------------------------------


def _adafactor(params: Sequence[ParamInfo], ctx: OptimizerContext) -> OptimizerMemory:
    state = 0
    for p in params:
        if len(p.shape) >= 2:
            rows = p.numel // p.shape[-1]
            cols = p.numel // p.shape[-2]
            state += 4 * (rows + cols)
        else:
            state += 4 * p.numel
        state += 4  # RMS scalar kept in state
    largest = max((p.numel for p in params), default=0)
    return OptimizerMemory(state, 3 * 4 * largest)


register(OptimizerProfile("adafactor", _adafactor, "transformers/optimization.py Adafactor.step"))


# ----------------------------------------------------------------------------------------------
# SGD (torch/optim/sgd.py): momentum_buffer (param dtype) only when momentum != 0 (the Trainer
# passes optim_args "momentum=0.9"); no temporaries beyond one param-sized buffer on first step.
# ----------------------------------------------------------------------------------------------


def _sgd(params: Sequence[ParamInfo], ctx: OptimizerContext) -> OptimizerMemory:
    momentum = float(ctx.optim_args.get("momentum", 0) or 0)
    if momentum == 0:
        return OptimizerMemory(0, 0)
    # first step: `buf = torch.clone(grad).detach()` becomes the state; no extra transient
    return OptimizerMemory(sum(p.nbytes for p in params), 0)


register(OptimizerProfile("sgd", _sgd, "torch/optim/sgd.py _single_tensor_sgd"))


def _adagrad(params: Sequence[ParamInfo], ctx: OptimizerContext) -> OptimizerMemory:
    # torch/optim/adagrad.py: state "sum" (param dtype) + step; `std = state_sum.sqrt().add_(eps)`
    # is one param-sized temporary (foreach: the whole group).
    transient = sum(p.nbytes for p in params) if _foreach(ctx) else _largest(params)
    return OptimizerMemory(_per_tensor_state(params, 1), transient)


register(OptimizerProfile("adagrad", _adagrad, "torch/optim/adagrad.py"))


def _rmsprop(params: Sequence[ParamInfo], ctx: OptimizerContext) -> OptimizerMemory:
    # torch/optim/rmsprop.py: square_avg (+ momentum_buffer, + grad_avg if centered);
    # `avg = square_avg.sqrt().add_(eps)` is one param-sized temporary.
    copies = 1 + (float(ctx.optim_args.get("momentum", 0) or 0) != 0) + (
        str(ctx.optim_args.get("centered", "false")).lower() in ("true", "1"))
    transient = sum(p.nbytes for p in params) if _foreach(ctx) else _largest(params)
    return OptimizerMemory(_per_tensor_state(params, copies), transient)


register(OptimizerProfile("rmsprop", _rmsprop, "torch/optim/rmsprop.py"))
