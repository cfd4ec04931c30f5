"""What runs inside each rank of a distributed measurement (``measure_distributed_peak``).

torchrun starts ``python -m hf_memkit.testing._dist_worker SPEC`` once per rank; the rank records
its pid, trains in the spec's mode (``"ddp"``, ``"fsdp2"`` (FSDP1 with ``fsdp.version`` 1),
``"deepspeed"``; described in
:mod:`hf_memkit.testing.groundtruth_dist`) with a measurement window per optimizer step (the
one of :mod:`hf_memkit.testing.groundtruth`) and writes ``rank<N>.json`` into the folder named
by ``HF_MEMKIT_DIST_OUT`` for the launcher to gather.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
import tempfile
import time
from typing import Any

from .._device.rss import alive_cpu_tensor_bytes
from .._engines.base import sync_each_batch
from ._rank_tools import digest, digesting_collate, examples, optimizer_bytes, tensor_bytes
from .groundtruth import close_window, open_window
from .groundtruth_dist import OUT_ENV
from .models import spec_model


def _training_args(spec: dict[str, Any], workdir: str, steps: int, **extra):
    import transformers

    a = dict(spec.get("args", {}))
    a.update(extra)
    a.update(output_dir=os.path.join(workdir, "out"), max_steps=steps, use_cpu=True,
             ddp_backend="gloo", report_to=[], save_strategy="no", logging_strategy="steps",
             logging_steps=1, eval_strategy="no", dataloader_num_workers=0,
             dataloader_pin_memory=False, disable_tqdm=True,
             learning_rate=a.get("learning_rate", 1e-4))
    return transformers.TrainingArguments(**a)


def _ddp_bucket_bytes(ddp) -> dict[str, Any]:
    """The reducer's flat gradient buckets (held in C++, so invisible to a gc walk)."""
    info: dict[str, Any] = {"bucket_cap_bytes": getattr(ddp, "bucket_bytes_cap", None),
                            "gradient_as_bucket_view": bool(getattr(ddp, "gradient_as_bucket_view",
                                                                    False))}
    try:
        data = ddp._get_ddp_logging_data()
        sizes = [int(x) for x in str(data.get("bucket_sizes", "")).split(",") if x.strip()]
    except Exception:  # private API: fall back to the bytes of every trainable parameter
        sizes = [sum(tensor_bytes(p) for p in ddp.module.parameters() if p.requires_grad)]
    info["bucket_sizes"] = sizes
    info["bucket_bytes"] = sum(sizes)
    return info


def _run_ddp(spec: dict[str, Any], workdir: str) -> dict[str, Any]:
    import torch
    import transformers

    steps = max(2, int(spec.get("steps", 3)))
    model = spec_model(spec, workdir)
    args = _training_args(spec, workdir, steps)
    world, rank = args.world_size, args.process_index
    per_step = args.per_device_train_batch_size * args.gradient_accumulation_steps
    data = examples(spec, model.config, per_step * world * (steps + 1), seed=1)
    initial = digest(p for p in model.parameters())
    seen: list[str] = []
    records: list[dict[str, Any]] = []
    extra: dict[str, Any] = {}

    collate = digesting_collate(seen)

    class Window(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            ddp = trainer.model_wrapped
            buckets = _ddp_bucket_bytes(ddp) if hasattr(ddp, "reducer") else {"bucket_bytes": 0}
            # with gradient_as_bucket_view the grads are views of the buckets: counted once
            hidden = buckets["bucket_bytes"]
            if buckets.get("gradient_as_bucket_view") and any(
                    p.grad is not None for p in ddp.parameters()):
                hidden = 0
            extra["buckets"] = buckets
            self.open = open_window(alive_cpu_tensor_bytes() + hidden)
            self.hidden = hidden

        def on_pre_optimizer_step(self, args, state, control, **kw):
            self.grad = sum(tensor_bytes(p.grad) for p in kw["model"].parameters()
                            if p.grad is not None)

        def on_step_end(self, args, state, control, **kw):
            rec = {"step": state.global_step, **close_window(self.open),
                   "bucket_bytes": self.hidden, "grad_bytes": self.grad}
            records.append(rec)
            extra["optimizer_bytes"] = optimizer_bytes(kw["optimizer"])

    trainer = transformers.Trainer(model=model, args=args, train_dataset=data,
                                   data_collator=collate, callbacks=[Window()])
    trainer.train()
    ddp = trainer.model_wrapped
    if not isinstance(ddp, torch.nn.parallel.DistributedDataParallel):
        raise RuntimeError(f"the Trainer did not wrap the model in DistributedDataParallel "
                           f"(got {type(ddp).__name__}); world size {world}")
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    opt = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    return {"rank": rank, "world_size": world, "steps": records,
            "losses": losses,
            "local_param_bytes": sum(tensor_bytes(p) for p in model.parameters()),
            "full_param_bytes": sum(tensor_bytes(p) for p in model.parameters()),
            "local_buffer_bytes": sum(tensor_bytes(b) for b in model.buffers()),
            "local_grad_bytes": records[-1]["grad_bytes"],
            "local_optimizer_bytes": extra["optimizer_bytes"],
            "optimizer": type(opt).__name__,
            "optimizer_impl": _adam_impl(opt),
            "ddp": {**extra["buckets"], "find_unused_parameters": ddp.find_unused_parameters,
                    "wrapper": type(ddp).__name__},
            "param_digest_initial": initial,
            "param_digest": digest(p for p in model.parameters()),
            "data_digest": seen[0] if seen else None}


def _adam_impl(opt) -> str:
    d = opt.defaults
    return "fused" if d.get("fused") else "foreach" if d.get("foreach") else "single-tensor"


def _fsdp2_prepare(model, args):
    """accelerate's own FSDP2 preparation (``fsdp2_apply_ac`` + ``fsdp2_prepare_model``)."""
    import types

    import torch
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_apply_ac, fsdp2_prepare_model
    from torch.distributed.fsdp import CPUOffloadPolicy

    plugin = FullyShardedDataParallelPlugin(**args.fsdp_plugin_args)
    if args.mixed_precision != "no":  # accelerate.state.AcceleratorState does this
        plugin.set_mixed_precision(args.mixed_precision)
    if isinstance(plugin.cpu_offload, CPUOffloadPolicy) and not torch.accelerator.is_available():
        plugin.cpu_offload = CPUOffloadPolicy(pin_memory=False)  # pinning needs an accelerator
    acc = types.SimpleNamespace(state=types.SimpleNamespace(fsdp_plugin=plugin),
                                torch_device_mesh=None, mixed_precision=args.mixed_precision,
                                is_main_process=args.process_index == 0,
                                device=torch.device("cpu"))
    plugin.set_auto_wrap_policy(model)  # Accelerator._prepare_fsdp2 does this before AC
    if plugin.activation_checkpointing:
        model = fsdp2_apply_ac(acc, model)
    return fsdp2_prepare_model(acc, model), plugin


def _fsdp1_prepare(model, args):
    """accelerate's FSDP1 preparation (``Accelerator.prepare_model``, accelerate 1.15): the
    plugin's kwargs to ``FullyShardedDataParallel``, its activation checkpointing, then the fp32
    upcast of every FlatParameter that requires grad under mixed precision. ``device_id`` is the
    CPU (gloo)."""
    import torch
    from accelerate.utils import FullyShardedDataParallelPlugin
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    plugin = FullyShardedDataParallelPlugin(**args.fsdp_plugin_args)
    if args.mixed_precision != "no":  # accelerate.state.AcceleratorState does this
        plugin.set_mixed_precision(args.mixed_precision)
    plugin.set_auto_wrap_policy(model)
    model = FSDP(model, sharding_strategy=plugin.sharding_strategy or plugin.reshard_after_forward,
                 cpu_offload=plugin.cpu_offload, auto_wrap_policy=plugin.auto_wrap_policy,
                 mixed_precision=plugin.mixed_precision_policy,
                 sync_module_states=plugin.sync_module_states,
                 backward_prefetch=plugin.backward_prefetch,
                 forward_prefetch=plugin.forward_prefetch, use_orig_params=plugin.use_orig_params,
                 limit_all_gathers=plugin.limit_all_gathers, device_id=torch.device("cpu"))
    if plugin.activation_checkpointing:
        import functools as ft

        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            CheckpointImpl,
            apply_activation_checkpointing,
            checkpoint_wrapper,
        )

        apply_activation_checkpointing(model, checkpoint_wrapper_fn=ft.partial(
            checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
            auto_wrap_policy=plugin.auto_wrap_policy)
    if args.mixed_precision != "no":
        for module in FSDP.fsdp_modules(model):
            param = getattr(module, "_flat_param", None)
            if param is not None and param.dtype != torch.float32 and param.requires_grad:
                param.data = param.data.to(torch.float32)
                module._handle._orig_param_dtype = torch.float32
    return model, plugin


def _reshards(module) -> bool | None:
    """Whether an FSDP2 unit frees its unsharded parameters after forward (private state)."""
    try:
        group = module._get_fsdp_state()._fsdp_param_group
        return None if group is None else group.post_forward_mesh_info is not None
    except AttributeError:
        return None


def _fsdp_training_args(spec: dict[str, Any], workdir: str, steps: int, model) -> tuple[int, Any]:
    """The FSDP version and the TrainingArguments (fsdp, fsdp_config) of an ``fsdp2`` spec."""
    fs = dict(spec.get("fsdp") or {})
    layer_cls = fs.get("transformer_layer_cls_to_wrap") or list(model._no_split_modules or [])
    version = int(fs.get("version", 2))
    fsdp_config = {"version": version, "transformer_layer_cls_to_wrap": layer_cls,
                   "reshard_after_forward": bool(fs.get("reshard_after_forward", True)),
                   "cpu_offload": bool(fs.get("offload", False)),
                   "activation_checkpointing": bool(fs.get("activation_checkpointing", False))}
    bf16 = fs.get("mixed_precision") == "bf16" or bool(spec.get("args", {}).get("bf16"))
    fsdp: Any = True
    if version == 1:  # FSDP1 takes its sharding strategy from the legacy `fsdp` string
        fsdp = "full_shard" if fsdp_config.pop("reshard_after_forward") else "shard_grad_op"
        # its default broadcast of rank 0's weights needs an accelerator to build its
        # param_init_fn (FullyShardedDataParallelPlugin.__post_init__); the ranks seed alike
        fsdp_config["sync_module_states"] = False
    return version, _training_args(spec, workdir, steps, fsdp=fsdp, fsdp_config=fsdp_config,
                                   bf16=bf16)


def _run_fsdp2(spec: dict[str, Any], workdir: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    import transformers
    from torch.distributed.fsdp import FSDPModule

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    steps = max(2, int(spec.get("steps", 3)))
    model = spec_model(spec, workdir)
    version, args = _fsdp_training_args(spec, workdir, steps, model)
    if args.gradient_checkpointing:  # the Trainer's, before accelerate prepares the model
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs=args.gradient_checkpointing_kwargs)
    full_param_bytes = sum(tensor_bytes(p) for p in model.parameters())
    model, plugin = (_fsdp1_prepare if version == 1 else _fsdp2_prepare)(model, args)
    model.train()
    units = [{"module": name or "<root>", "reshard_after_forward": _reshards(m)}
             for name, m in model.named_modules()
             if isinstance(m, FSDPModule) or type(m).__name__ == "FullyShardedDataParallel"]
    optim_cls, optim_kwargs = transformers.Trainer.get_optimizer_cls_and_kwargs(args, model)
    optimizer = optim_cls([p for p in model.parameters() if p.requires_grad], **optim_kwargs)

    mb, accum = args.per_device_train_batch_size, args.gradient_accumulation_steps
    sync_each = sync_each_batch(functools.partial(getattr, args))  # as the estimate reads it
    data = examples(spec, model.config, mb * accum * steps, seed=1 + rank)
    batches = [{k: torch.stack([x[k] for x in data[i:i + mb]]) for k in data[0]}
               for i in range(0, len(data), mb)]
    records: list[dict[str, Any]] = []
    losses: list[float] = []
    grad_bytes = 0
    for step in range(steps):
        micro = batches[step * accum:(step + 1) * accum]  # the Trainer prefetches the step's batches
        opened = open_window(alive_cpu_tensor_bytes())
        total = torch.zeros(())
        for i, batch in enumerate(micro):
            # accelerate's accumulate(): no_sync but on the last micro-batch, unless the
            # accelerator_config's gradient_accumulation_kwargs say sync_each_batch
            sync = sync_each or i == len(micro) - 1
            if version == 2:
                model.set_requires_gradient_sync(sync)
            with contextlib.nullcontext() if sync or version == 2 else model.no_sync():
                loss = model(**batch).loss / len(micro)
                loss.backward()
            total += loss.detach()
        if args.max_grad_norm and args.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        grad_bytes = sum(tensor_bytes(p.grad) for p in model.parameters() if p.grad is not None)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        records.append({"step": step + 1, **close_window(opened), "grad_bytes": grad_bytes})
        del loss, batch
        dist.all_reduce(total)
        losses.append(float(total) / world)
    local_params = sum(tensor_bytes(p) for p in model.parameters())
    return {"rank": rank, "world_size": world, "steps": records, "losses": losses,
            "local_param_bytes": local_params, "full_param_bytes": full_param_bytes,
            "local_buffer_bytes": sum(tensor_bytes(b) for b in model.buffers()),
            "local_grad_bytes": grad_bytes,
            "local_optimizer_bytes": optimizer_bytes(optimizer),
            "optimizer": optim_cls.__name__, "optimizer_impl": _adam_impl(optimizer),
            "fsdp": {"units": units, "mixed_precision": args.mixed_precision,
                     "mp_policy": repr(plugin.mixed_precision_policy),
                     "offload_policy": repr(plugin.cpu_offload),
                     "param_dtype": str(next(model.parameters()).dtype)},
            "data_digest": digest([batches[0]["input_ids"]])}


def _run_deepspeed(spec: dict[str, Any], workdir: str) -> dict[str, Any]:
    """DeepSpeed ZeRO on its CPU accelerator over gloo, as the Trainer drives it when the
    DeepSpeed config has no optimizer section: the Trainer's optimizer is handed to
    ``deepspeed.initialize`` (here torch AdamW), ``engine.backward`` / ``engine.step`` on every
    micro-batch (DeepSpeed steps at the accumulation boundary). Each step's record carries the
    peak of its optimizer step alone (``step_peak``: a window opened after the last backward)
    beside the peak of the whole step."""
    import deepspeed
    import torch
    import torch.distributed as dist

    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    steps = max(2, int(spec.get("steps", 3)))
    a = dict(spec.get("args") or {})
    mb = int(a.get("per_device_train_batch_size", spec.get("micro_batch", 1)))
    accum = int(a.get("gradient_accumulation_steps", 1))
    cfg = json.loads(json.dumps(spec["deepspeed"]))
    cfg.update(train_micro_batch_size_per_gpu=mb, gradient_accumulation_steps=accum,
               train_batch_size=mb * accum * world)
    cfg.setdefault("gradient_clipping", float(a.get("max_grad_norm", 1.0)))  # the Trainer's
    model = spec_model(spec, workdir)
    full_param_bytes = sum(tensor_bytes(p) for p in model.parameters())
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                                  lr=float(a.get("learning_rate", 1e-3)), foreach=False)
    engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=cfg)
    data = examples(spec, model.config, mb * accum * steps, seed=1 + rank)
    batches = [{k: torch.stack([x[k] for x in data[i:i + mb]]) for k in data[0]}
               for i in range(0, len(data), mb)]
    records: list[dict[str, Any]] = []
    losses: list[float] = []
    for step in range(steps):
        micro = batches[step * accum:(step + 1) * accum]
        opened = open_window(alive_cpu_tensor_bytes())
        total = torch.zeros(())
        for i, batch in enumerate(micro):
            loss = engine(**batch).loss
            engine.backward(loss)
            if i == len(micro) - 1:  # the optimizer step gets a window of its own
                passes = close_window(opened)
                opened = open_window(alive_cpu_tensor_bytes())
            engine.step()
            total += loss.detach().float() / len(micro)
        stepped = close_window(opened)
        records.append({"step": step + 1, "alive_open": passes["alive_open"],
                        "peak": max(passes["peak"], stepped["peak"]),
                        "step_peak": stepped["peak"],
                        "seconds": passes["seconds"] + stepped["seconds"]})
        del loss, batch
        dist.all_reduce(total)
        losses.append(float(total) / world)
    return {"rank": rank, "world_size": world, "steps": records, "losses": losses,
            "full_param_bytes": full_param_bytes,
            "local_param_bytes": sum(tensor_bytes(p) for p in engine.module.parameters()),
            "deepspeed": {"stage": engine.zero_optimization_stage(), "config": cfg},
            "data_digest": digest([batches[0]["input_ids"]])}


def _rank_main(spec: dict[str, Any]) -> dict[str, Any]:
    with open(os.path.join(os.environ[OUT_ENV], f"pid{os.environ.get('RANK', '0')}"), "w") as f:
        f.write(str(os.getpid()))  # so that the parent can end this rank after a timeout
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") != "65536":
        raise RuntimeError("MALLOC_MMAP_THRESHOLD_=65536 must be set when the process starts")
    with tempfile.TemporaryDirectory() as workdir:
        t0 = time.perf_counter()
        from ._parallel_worker import run_sp, run_tp

        run = {"ddp": _run_ddp, "fsdp2": _run_fsdp2, "deepspeed": _run_deepspeed,
               "tp": run_tp, "sp": run_sp}[spec["mode"]]
        result = run(spec, workdir)
        result["seconds"] = time.perf_counter() - t0
    steady = [r for r in result["steps"] if r["step"] >= 2] or result["steps"]
    result["peak"] = max(r["peak"] for r in steady)
    return result


if __name__ == "__main__":
    _result = _rank_main(json.loads(sys.argv[1]))
    _path = os.path.join(os.environ[OUT_ENV], f"rank{_result['rank']}.json")
    with open(_path + ".tmp", "w") as _f:
        json.dump(_result, _f)
    os.replace(_path + ".tmp", _path)
    import torch.distributed as _dist

    if _dist.is_initialized():
        _dist.barrier()
        _dist.destroy_process_group()
