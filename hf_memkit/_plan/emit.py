"""From a candidate to what a user runs: the TrainingArguments fields (one builder, used both to
estimate every candidate and to hand the chosen one over), the model's load kwargs, accelerate's
kwargs, and what the plan says about its data-parallel engine."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from .._device.probe import DeviceInfo
from .._engines import ENGINES, EmitContext, ParallelDims, Sharding
from .._estimate import MemoryEstimate
from .._methods import METHODS
from .._optimizers import get_optimizer_profile
from .._techniques import TECHNIQUES, searched
from .._techniques.checkpointing import NAME as CHECKPOINTING
from .._units import format_bytes
from .space import SINGLE, Candidate, rung_of


@dataclass(frozen=True)
class ArgsContext:
    """What every candidate's TrainingArguments share."""

    pins: dict[str, Any]
    dev: DeviceInfo
    ranks: int
    hidden: int
    layer_class: str | None


def _device_args(dev: DeviceInfo, ranks: int) -> dict[str, Any]:
    ta: dict[str, Any] = {}
    if dev.kind == "cuda" and dev.supports_tf32:
        ta["tf32"] = True
    if dev.kind == "cpu":
        ta["use_cpu"] = True
    ta["dataloader_pin_memory"] = dev.kind == "cuda"
    ta["dataloader_num_workers"] = min(4, max(0, (os.cpu_count() or 1) // max(1, ranks) - 1)) \
        if dev.kind == "cuda" else 0
    ta["eval_accumulation_steps"] = 8
    return ta


def training_args(c: Candidate, ctx: ArgsContext, eval_batch: int | None = None) -> dict[str, Any]:
    """The TrainingArguments fields of ``c``: device defaults, then the user's pins, then the
    candidate's own choices and its engine's configuration (``eval_batch`` None: the micro-batch
    unless pinned)."""
    ta = _device_args(ctx.dev, ctx.ranks)
    ta.update(ctx.pins)
    ta.update(per_device_train_batch_size=c.micro_batch, gradient_accumulation_steps=c.grad_accum,
              optim=c.optim, bf16=c.precision == "bf16", fp16=c.precision == "fp16")
    if eval_batch is not None or "per_device_eval_batch_size" not in ctx.pins:
        ta["per_device_eval_batch_size"] = eval_batch or c.micro_batch
    rung = rung_of(c.parallel)
    engine = ENGINES.get(rung.engine)
    # an engine that owns checkpointing (FSDP: fsdp_config) configures it, unless a technique
    # on top of it (its offload) is the Trainer's own: then the Trainer checkpoints
    owns = engine.owns_checkpointing and not trainer_checkpointing(c)
    techniques = searched()
    for f in {f for t in techniques for f in t.fields}:
        ta.pop(f, None)
    for t in sorted(techniques, key=lambda t: t.ladder):
        # an engine that owns checkpointing configures it itself (the same memory)
        owned = t.name == CHECKPOINTING and owns
        for k, v in t.emit(t.name in c.techniques and not owned, ctx.pins).items():
            # a dict merges into another technique's (offload into checkpointing's kwargs)
            ta[k] = {**ta[k], **v} if isinstance(v, dict) and isinstance(ta.get(k), dict) else v
    if c.padding_free:  # TRL: padding-free without packing takes the rows as they are
        ta.update(padding_free=True, max_length=None)
    ta.update(engine.emit(rung, EmitContext(
        ranks=ctx.ranks, micro_batch=c.micro_batch, grad_accum=c.grad_accum,
        precision=c.precision, checkpointing=c.checkpointing and owns, hidden=ctx.hidden,
        layer_class=ctx.layer_class, max_grad_norm=float(ctx.pins.get("max_grad_norm", 1.0)),
        dims=rung.dims.over(ctx.ranks))))
    return ta


def trainer_checkpointing(c: Candidate) -> bool:
    """Whether ``c`` has a technique that builds on the Trainer's own checkpointing (activation
    offloading: ``activation_checkpointing_kwargs={"offload": True}``), which an engine's
    checkpointing (FSDP's ``fsdp_config``) cannot carry."""
    return any(CHECKPOINTING in TECHNIQUES.get(n).requires for n in c.techniques)


def model_kwargs(c: Candidate, attn: str, quant: Any, dev: DeviceInfo) -> dict[str, Any]:
    """``from_pretrained`` kwargs: attention, load dtype, quantization."""
    mk: dict[str, Any] = {"attn_implementation": attn}
    load_dtype = METHODS.get(c.method).model_load_dtype(c.precision, dev)
    if load_dtype is not None:
        mk["dtype"] = load_dtype
    if quant is not None:
        mk["quantization_config"] = quant
    return mk


def accelerator_kwargs(c: Candidate, ta: dict[str, Any]) -> dict[str, Any]:
    acc = {"mixed_precision": {"bf16": "bf16", "fp16": "fp16"}.get(c.precision, "no"),
           "gradient_accumulation_steps": c.grad_accum,
           "optimizer": get_optimizer_profile(c.optim).accelerate_recipe()}
    acc.update(ENGINES.get(rung_of(c.parallel).engine).accelerator_plugin(ta))
    return acc


def parallel_summary(c: Candidate, ta: dict[str, Any], sh: Sharding, dims: ParallelDims,
                     nodes: int, notes: list[str], est: MemoryEstimate | None) -> dict[str, Any]:
    """What the plan says about running on several GPUs (and checks its emitted configs;
    ``dims``: the degrees the run launches with)."""
    if c.parallel == SINGLE.name:
        return {}
    out: dict[str, Any] = {"strategy": c.parallel, "engine": sh.engine, "label": sh.label(),
                           "num_nodes": nodes}
    ENGINES.get(sh.engine).check_emitted(ta, sh, dims, notes)
    if est is not None and est.host_offloaded:
        per_node = est.host_offloaded * (sh.world_size // max(1, nodes))
        notes.append(f"offload keeps {format_bytes(per_node)} in host RAM per node "
                     f"({format_bytes(est.host_offloaded)} per rank); check the nodes have it")
        out["host_memory_per_node"] = per_node
    return out
