"""The optimizer registry: one ``OptimizerProfile`` per ``TrainingArguments.optim`` value.

A profile says everything hf_memkit needs about an optimizer, so adding one is one entry in one
file of this package:
  * ``estimate``: for the trainable parameters, ``state`` (persistent bytes, created lazily at the
    first ``step()``), ``transient`` (the largest extra allocation alive inside ``step()``) and
    ``paged`` (state in CUDA managed memory, outside the caching allocator and outside what
    must fit on the device) and ``paged_resident`` (the part of it the step needs on the device
    at once, which the must-fit figure counts);
  * ``step_cost``: the step's time relative to fused AdamW (memory-bound: bytes moved per
    parameter), for the planner's cost model;
  * ``accelerate_class`` / ``accelerate_kwargs``: what ``Plan.accelerator_kwargs`` hands a custom
    accelerate loop;
  * ``plan_on``: the device kinds on which the planner may pick it (empty: only when pinned);
  * ``stands_in_for``: another optimizer it replaces in the planner's search only where that one
    is not available there (torchao's 8-bit AdamW when bitsandbytes is absent: never both);
  * ``requires``: a check, beyond ``needs`` being importable, that the Trainer can build it
    (a minimum version); it must not import the package;
  * ``shardable``: whether it steps FSDP2 DTensor shards and DeepSpeed partitions.
Sources are cited per entry: the optimizer's own ``step`` code in the installed library.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .._compat import is_bitsandbytes_available
from .._errors import HfMemkitError, did_you_mean, excerpt
from .._registry import Registry


@dataclass(frozen=True)
class ParamInfo:
    """One trainable parameter tensor, as the optimizer sees it."""

    numel: int
    shape: tuple[int, ...]
    itemsize: int  # bytes per element of the parameter (and of its gradient)
    embedding: bool = False  # the weight of an nn.Embedding (bitsandbytes keeps it 32-bit)
    linear: str | None = None  # the module's name when this is an nn.Linear's weight (GaLore,
    #                            APOLLO: what `optim_target_modules` is matched against)

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


@dataclass(frozen=True)
class OptimizerContext:
    """Facts of the run that change optimizer memory."""

    device_kind: str = "cpu"                  # foreach defaults on only for CUDA tensors
    optim_args: dict[str, str] = field(default_factory=dict)
    num_groups: int = 2                       # the Trainer: decay / no-decay groups

    @property
    def target_modules(self) -> str | list[str] | None:
        """``TrainingArguments.optim_target_modules``, which ``normalize_args`` carries in
        ``optim_args`` under ``TARGET_MODULES_ARG`` (JSON), so it reaches the optimizer entries
        without a field of its own in every caller."""
        raw = self.optim_args.get(TARGET_MODULES_ARG)
        return None if raw is None else json.loads(raw)


TARGET_MODULES_ARG = "optim_target_modules"


@dataclass(frozen=True)
class OptimizerMemory:
    """What an optimizer adds to a step, in bytes.

    ``paged``: state in CUDA managed memory (``cudaMallocManaged``), which the driver migrates to
    the host when the device is short of memory: counted outside ``device_used``.
    ``paged_resident``: the part of ``paged`` that must be on the device at once (the pages of
    the tensor being updated), counted in ``device_used``."""

    state: int
    transient: int
    paged: int = 0
    paged_resident: int = 0


# Step time relative to fused AdamW for an optimizer whose entry gives none.
DEFAULT_STEP_COST = 1.5


@dataclass(frozen=True)
class OptimizerProfile:
    name: str
    estimate: Callable[[Sequence[ParamInfo], OptimizerContext], OptimizerMemory]
    source: str
    needs: str | None = None               # optional package that the Trainer needs for it
    step_cost: float = DEFAULT_STEP_COST
    accelerate_class: str | None = None    # None: the optim name itself
    accelerate_kwargs: dict[str, Any] = field(default_factory=dict)
    plan_on: tuple[str, ...] = ()          # device kinds the planner searches it on
    shardable: bool = False                # steps FSDP2 / DeepSpeed shards
    stands_in_for: str | None = None       # planned only where that optimizer is not
    requires: Callable[[], bool] | None = None  # e.g. a version check (never an import)

    def available(self) -> bool:
        if self.needs == "bitsandbytes" and not is_bitsandbytes_available():
            return False
        return self.requires is None or self.requires()

    def accelerate_recipe(self) -> dict[str, Any]:
        return {"class": self.accelerate_class or self.name, "kwargs": dict(self.accelerate_kwargs)}


OPTIMIZERS: Registry[OptimizerProfile] = Registry("optimizer")


def refuse(name: str, why: str) -> None:
    """An ``optim`` value the Trainer accepts whose memory hf_memkit does not model, and why."""
    OPTIMIZERS.refuse(name, why)


def register(profile: OptimizerProfile, *aliases: str) -> OptimizerProfile:
    return OPTIMIZERS.register(profile, *aliases)


def supported_optimizers() -> list[str]:
    """Every ``optim`` value modelled (aliases included), sorted."""
    return sorted(OPTIMIZERS.names(aliases=True))


def get_optimizer_profile(name: str) -> OptimizerProfile:
    key = str(getattr(name, "value", name))
    why = OPTIMIZERS.refusal(key)
    if why is not None:
        raise HfMemkitError(
            f"cannot model the memory of optimizer `{excerpt(key)}`: {why}; modelled: "
            f"{', '.join(supported_optimizers())}. Pick one of these for `optim`")
    if key not in OPTIMIZERS:
        raise HfMemkitError(
            f"cannot model the memory of optimizer `{excerpt(key)}`"
            f"{did_you_mean(key, supported_optimizers())}; modelled: "
            f"{', '.join(supported_optimizers())}. Pick one of these for `optim`, or "
            "open an issue with the optimizer's state layout"
        )
    return OPTIMIZERS.get(key)


def _planned(p: OptimizerProfile, device_kind: str) -> bool:
    return device_kind in p.plan_on and p.available()


def planner_optimizers(device_kind: str) -> list[str]:
    """The optimizers the planner searches on ``device_kind``, cheapest step first. A stand-in
    (``stands_in_for``) is searched only where the optimizer it replaces is not."""
    found = [p for p in OPTIMIZERS if _planned(p, device_kind)
             and not (p.stands_in_for in OPTIMIZERS
                      and _planned(OPTIMIZERS.get(p.stands_in_for), device_kind))]
    return [p.name for p in sorted(found, key=lambda p: p.step_cost)]


# ----------------------------------------------------------------------------------------------
# helpers shared by the entries
# ----------------------------------------------------------------------------------------------

STEP_TENSOR = 4  # torch.optim keeps `state["step"]` as a float32 0-d tensor per parameter
ALL_DEVICES = ("cuda", "cpu", "mps")


def largest(params: Sequence[ParamInfo]) -> int:
    return max((p.nbytes for p in params), default=0)


def foreach(ctx: OptimizerContext) -> bool:
    # torch.optim.optimizer._default_to_fused_or_foreach: foreach only when every param is a
    # native tensor on a foreach-supported device (CUDA); CPU runs the single-tensor loop.
    return ctx.device_kind == "cuda"


def per_tensor_state(params: Sequence[ParamInfo], copies: int) -> int:
    return sum(copies * p.nbytes + STEP_TENSOR for p in params)


def trainer_groups(params: Sequence[ParamInfo]) -> list[list[ParamInfo]]:
    """The Trainer's two groups, in model order: weight-decayed (matrices) and not (biases,
    norms). transformers/trainer.py get_decay_parameter_names excludes biases and norm weights."""
    decay = [p for p in params if len(p.shape) >= 2]
    no_decay = [p for p in params if len(p.shape) < 2]
    return [g for g in (decay, no_decay) if g]
