"""What runs inside each rank of a tensor- or sequence-parallel measurement on CPU (gloo).

Modes ``"tp"`` and ``"sp"`` of :func:`hf_memkit.testing.groundtruth_dist.measure_distributed_peak`
(``_dist_worker._rank_main`` dispatches here); the measurement window is the one of
:mod:`hf_memkit.testing.groundtruth` (opened before a step's micro-batches, closed after
``optimizer.step()`` and ``zero_grad``; steady steps ``>= 2``). Findings with transformers 5.23,
accelerate 1.15, torch 2.13 (CPU build), DeepSpeed 0.19.8, all tried for real under torchrun:

``"tp"`` (transformers' native tensor parallelism; the Trainer's steps, not the Trainer)
    The model is loaded as a user loads it, ``from_pretrained(ckpt,
    distributed_config=DistributedConfig(tp_size=world))`` (``tp_plan="auto"`` is the deprecated
    spelling of the same), from a checkpoint saved from the random-init model. That works on
    CPU: the mesh is ``init_device_mesh("cpu", ...)`` over gloo. The real ``Trainer`` cannot
    train it on CPU: ``Trainer._build_accelerator_args`` adds ``ParallelismConfig(tp_size=2)``
    (as for any model with ``tp_size > 1``) and ``Accelerator.__init__`` ->
    ``ParallelismConfig._validate_accelerator`` raises ``ValueError: ParallelismConfig is only
    compatible DistributedType.FSDP (version 2) or DistributedType.Multi{Device} or
    DistributedType.DEEPSPEED, but got DistributedType.MULTI_CPU`` (with ``use_cpu=True``;
    without it the type is ``NO`` and the error names ``DistributedType.NO``), because
    ``Accelerator.multi_device`` lists accelerator types only, never ``MULTI_CPU``. So this mode
    runs the steps the Trainer runs for a model sharded at load time
    (``is_distributed_loading_by_transformers``), with the Trainer's own methods bound to a
    stand-in: ``Trainer.create_optimizer`` (decay groups, then one group per device mesh: the
    plan leaves the RMSNorm weights plain tensors, and the fused AdamW kernel refuses a mix,
    ``aten._fused_adamw_.default got mixed torch.Tensor and DTensor``);
    ``accelerator.prepare_model(model, device_placement=False, evaluation_mode=True)`` (bf16
    autocast, ``torch.autocast("cpu", bfloat16)`` with fp32 outputs, when ``bf16=True``);
    ``_sync_replicated_trainable_parameters`` (the plain parameters broadcast, a gradient
    all-reduce hook on each); forward with labels, ``loss / accumulation`` backward,
    ``Trainer._clip_grad_norm`` (one norm per mesh), ``optimizer.step()``, ``zero_grad``. All
    TP ranks get the same batches (the Trainer's data-parallel size is ``world / tp = 1``).
    Measured: parameters, AdamW state and gradients are DTensor local shards, except that the
    vocab-parallel ``embed_tokens`` gets a ``Replicate`` gradient of the whole table on each
    rank; the norms stay whole plain tensors.

``"sp"`` (DeepSpeed Ulysses / ALST; the real Trainer)
    ``TrainingArguments(deepspeed=..., parallelism_config=ParallelismConfig(sp_size=world,
    sp_backend="deepspeed", sp_handler=DeepSpeedSequenceParallelConfig(...)))`` trains through
    the real ``Trainer`` on DeepSpeed's CPU accelerator: ``UlyssesSPAttentionHF`` takes over the
    SDPA entry of ``ALL_ATTENTION_FUNCTIONS`` and swaps sequence and head shards with
    ``all_to_all_single``, which gloo carries; ``UlyssesSPDataLoaderAdapter`` gives each rank
    its ``seq_len / sp`` shard of one rank's sample per micro-step (one optimizer step trains
    one sample on all ranks). Conditions on CPU: ``use_cpu`` must stay False (with
    ``use_cpu=True`` accelerate starts torch.distributed for ``MULTI_CPU`` but never
    ``deepspeed.comm``, and ``parallel_state_sp.initialize_sequence_parallel`` fails on
    ``assert dist.is_initialized()``); so fp32 only (``TrainingArguments(bf16=True)`` refuses a
    CPU-only machine without ``use_cpu``: "Your setup doesn't support bf16/gpu"); and every
    batch carries ``position_ids`` (the adapter raises otherwise), as the examples here do.

``"cp"`` (torch context parallelism) does not run on CPU and has no mode: ``CP_ON_CPU`` below
records what was tried and the errors.

Bytes per rank: ``local_param_bytes`` / ``local_grad_bytes`` / ``local_optimizer_bytes`` are
what this rank holds (a DTensor's local shard; under DeepSpeed the ZeRO-3 ``ds_tensor``
partitions or ZeRO-2's whole parameters, the fp32 master partitions apart as
``local_master_bytes``, ZeRO-3's persistent gradient partition buffer as the gradients; ZeRO-2's
gradient partitions are gone when the step ends and are reported as None).
"""

from __future__ import annotations

import gc
import os
from typing import Any

from .._device.rss import alive_cpu_tensor_bytes
from ._rank_tools import digest, digesting_collate, examples, optimizer_bytes, tensor_bytes
from .groundtruth import close_window, open_window
from .models import spec_model

# What torch 2.13's context parallelism does on this CPU build (gloo, 2 ranks, a Llama with SDPA,
# accelerate's pre-forward hook that drops the mask for ``is_causal=True``, the buffers the
# Trainer shards: input_ids, labels, shift_labels, attention_mask, position_ids; the head-tail
# load balancer is active and shards the sequence as on GPU). Same with either rotate method.
CP_ON_CPU = {
    "runs": False,
    "trainer": "Trainer(args=TrainingArguments(fsdp=True, fsdp_config={'version': 2, ...}, "
               "parallelism_config=ParallelismConfig(cp_size=2), use_cpu=True)) raises in "
               "ParallelismConfig._validate_accelerator: ValueError: ParallelismConfig is only "
               "compatible DistributedType.FSDP (version 2) or DistributedType.Multi{Device} or "
               "DistributedType.DEEPSPEED, but got DistributedType.MULTI_CPU. (without use_cpu: "
               "ValueError: ParallelismConfig total_size (2) does not match num_processes (1))",
    "allgather": "NotImplementedError: Operator aten._scaled_dot_product_flash_attention_for_cpu"
                 ".default does not have a sharding strategy registered.",
    "alltoall": "NotImplementedError: Operator aten._scaled_dot_product_flash_attention_for_cpu"
                ".default does not have a sharding strategy registered.",
    "why": "the ring-attention handlers and CP sharding rules cover only the CUDA kernels "
           "(_scaled_dot_product_flash/efficient/cudnn_attention and their backwards); on CPU "
           "SDPA dispatches to _scaled_dot_product_flash_attention_for_cpu, which DTensor has no "
           "strategy for",
    "math_backend": "sdpa_kernel(SDPBackend.MATH): RuntimeError: aten.add.Tensor got mixed "
                    "torch.Tensor and DTensor (the decomposed math path adds a plain causal mask "
                    "to sequence-sharded DTensor scores)",
    "efficient_backend": "sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION): RuntimeError: No viable "
                         "backend for scaled_dot_product_attention was found (no CPU kernel)",
}










def _args(spec: dict[str, Any], workdir: str, steps: int, **extra):
    import transformers

    a = dict(spec.get("args", {}))
    a.update(extra)
    a.update(output_dir=os.path.join(workdir, "out"), max_steps=steps, report_to=[],
             save_strategy="no", logging_strategy="steps", logging_steps=1, eval_strategy="no",
             dataloader_num_workers=0, dataloader_pin_memory=False, disable_tqdm=True,
             learning_rate=a.get("learning_rate", 1e-4))
    return transformers.TrainingArguments(**a)


def _tp_model(spec: dict[str, Any], workdir: str, world: int):
    """The spec's random-init model saved, then loaded sharded as a user loads it."""
    import torch
    import transformers
    from transformers.distributed import DistributedConfig

    model = spec_model(spec, workdir)
    full = sum(tensor_bytes(p) for p in model.parameters())
    ckpt = os.path.join(workdir, "ckpt")
    model.save_pretrained(ckpt)  # each rank its own copy of the same (seed 0) weights
    auto = type(model)
    del model
    gc.collect()
    kw = {"attn_implementation": spec["attn_implementation"]} if spec.get(
        "attn_implementation") else {}
    model = auto.from_pretrained(ckpt, distributed_config=DistributedConfig(tp_size=world),
                                 dtype=getattr(torch, spec.get("dtype", "float32")), **kw)
    if not isinstance(model, transformers.PreTrainedModel) or (model.tp_size or 1) != world:
        raise RuntimeError(f"from_pretrained did not shard the model over {world} ranks "
                           f"(tp_size {model.tp_size})")
    return model, full


def _trainer_steps(model, args, accelerator):
    """The Trainer's own optimizer, clipping and replicated-parameter sync, bound to a stand-in
    that holds only what they read (the Trainer itself cannot be built: module docstring)."""
    import transformers

    trainer = transformers.Trainer

    class Steps:
        create_optimizer = trainer.create_optimizer
        get_decay_parameter_names = trainer.get_decay_parameter_names
        get_optimizer_cls_and_kwargs = staticmethod(trainer.get_optimizer_cls_and_kwargs)
        _clip_grad_norm = trainer._clip_grad_norm
        _has_mixed_mesh_grads = trainer._has_mixed_mesh_grads
        _mixed_mesh_grad_norm = trainer._mixed_mesh_grad_norm
        _sync_replicated_trainable_parameters = trainer._sync_replicated_trainable_parameters

    steps = Steps()
    steps.model, steps.args, steps.accelerator = model, args, accelerator
    steps.optimizer, steps.optimizer_cls_and_kwargs, steps._mixed_mesh_grads = None, None, None
    return steps


def _tp_layout(model) -> dict[str, Any]:
    """The plan transformers applied: rule -> style, and each parameter's placement."""
    from torch.distributed.tensor import DTensor

    params = {}
    for name, p in model.named_parameters():
        is_d = isinstance(p, DTensor)
        params[name] = {"placements": [repr(x) for x in p.placements] if is_d else None,
                        "shape": list(p.shape),
                        "local_shape": list(p.to_local().shape if is_d else p.shape)}
    head = params.get("lm_head.weight", {})
    embed = next((v for k, v in params.items() if k.endswith("embed_tokens.weight")), {})
    return {"plan": dict(model.tp_plan), "params": params,
            "embed_tokens_sharded": bool(embed.get("placements")),
            "lm_head_sharded": bool(head.get("placements")),
            "plain_params": sorted(k for k, v in params.items() if v["placements"] is None)}


def run_tp(spec: dict[str, Any], workdir: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from accelerate import Accelerator
    from torch.distributed.tensor import DTensor

    steps_n = max(2, int(spec.get("steps", 3)))
    # saved before torch.distributed starts (save_pretrained then writes on rank 0 only);
    # from_pretrained starts it (gloo), as it does for a user
    model, full_param_bytes = _tp_model(spec, workdir, int(os.environ["WORLD_SIZE"]))
    args = _args(spec, workdir, steps_n, use_cpu=True, ddp_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    accelerator = Accelerator(cpu=True, mixed_precision=args.mixed_precision)
    steps = _trainer_steps(model, args, accelerator)
    optimizer = steps.create_optimizer(model)
    model = accelerator.prepare_model(model, device_placement=False, evaluation_mode=True)
    steps._sync_replicated_trainable_parameters(model)
    model.train()
    mb, accum = args.per_device_train_batch_size, args.gradient_accumulation_steps
    data = examples(spec, model.config, mb * accum * steps_n, seed=1)  # TP ranks share batches
    batches = [{k: torch.stack([x[k] for x in data[i:i + mb]]) for k in data[0]}
               for i in range(0, len(data), mb)]
    records: list[dict[str, Any]] = []
    losses: list[float] = []
    grads: dict[str, Any] = {}
    for step in range(steps_n):
        micro = batches[step * accum:(step + 1) * accum]
        opened = open_window(alive_cpu_tensor_bytes())
        total = torch.zeros(())
        for i, batch in enumerate(micro):
            accelerator.gradient_state._set_sync_gradients(i == len(micro) - 1)
            loss = model(**batch).loss / len(micro)
            loss.backward()
            total += loss.detach().float()
        if args.max_grad_norm and args.max_grad_norm > 0:
            steps._clip_grad_norm(model)
        with_grad = [p for p in model.parameters() if p.grad is not None]
        grads = {"bytes": sum(tensor_bytes(p.grad) for p in with_grad),
                 "dtensor": sum(isinstance(p.grad, DTensor) for p in with_grad),
                 "plain": sum(not isinstance(p.grad, DTensor) for p in with_grad)}
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        records.append({"step": step + 1, **close_window(opened), "grad_bytes": grads["bytes"]})
        del loss, batch
        losses.append(float(total))  # this rank's own loss: TP ranks compute the same one
    state = [v for st in optimizer.state.values() for v in st.values()
             if isinstance(v, torch.Tensor) and v.dim() > 0]
    return {"rank": rank, "world_size": world, "steps": records, "losses": losses,
            "local_param_bytes": sum(tensor_bytes(p) for p in model.parameters()),
            "full_param_bytes": full_param_bytes,
            "local_buffer_bytes": sum(tensor_bytes(b) for b in model.buffers()),
            "local_grad_bytes": grads["bytes"],
            "local_optimizer_bytes": optimizer_bytes(optimizer),
            "optimizer": type(optimizer).__name__, "optimizer_impl": _adam_impl(optimizer),
            "tp": {**_tp_layout(model), "mixed_precision": args.mixed_precision,
                   "param_dtype": str(next(model.parameters()).dtype),
                   "grads_dtensor": grads["dtensor"], "grads_plain": grads["plain"],
                   "optimizer_state_dtensor": sum(isinstance(v, DTensor) for v in state),
                   "optimizer_state_plain": sum(not isinstance(v, DTensor) for v in state),
                   "param_groups": [len(g["params"]) for g in optimizer.param_groups]},
            "param_digest": digest(p.full_tensor() if isinstance(p, DTensor) else p
                                    for p in model.parameters()),
            "data_digest": digest([batches[0]["input_ids"]])}


def _adam_impl(opt) -> str:
    d = opt.defaults
    return "fused" if d.get("fused") else "foreach" if d.get("foreach") else "single-tensor"


def _sp_args(spec: dict[str, Any], workdir: str, steps: int, world: int):
    """TrainingArguments for Ulysses SP: DeepSpeed's config with the Trainer's ``auto`` batch
    sizes and clipping, and a ParallelismConfig with ``sp_size = world`` (no ``use_cpu``)."""
    from accelerate import ParallelismConfig
    from accelerate.utils import DeepSpeedSequenceParallelConfig

    sp = dict(spec.get("sp") or {})
    ds = dict(spec["deepspeed"])
    for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                "train_batch_size", "gradient_clipping"):
        ds.setdefault(key, "auto")
    handler = DeepSpeedSequenceParallelConfig(
        sp_seq_length=None if sp.get("seq_length_is_variable", True) else spec["seq_len"],
        sp_seq_length_is_variable=bool(sp.get("seq_length_is_variable", True)),
        sp_attn_implementation=spec.get("attn_implementation", "sdpa"))
    pc = ParallelismConfig(sp_size=int(sp.get("sp_size", world)), sp_backend="deepspeed",
                           sp_handler=handler)
    return _args(spec, workdir, steps, deepspeed=ds, parallelism_config=pc)


def _ds_local_bytes(engine) -> dict[str, Any]:
    """What a DeepSpeed engine's rank holds: module parameters (ZeRO-3: their ``ds_tensor``
    partitions); the fp32 master partitions (counted only where they are not the parameter
    partitions themselves: in an fp32 run ZeRO-3 steps the parameter partition in place); their
    optimizer state; ZeRO-3's persistent gradient partition buffer and its reduce buckets."""
    opt = engine.optimizer
    inner = getattr(opt, "optimizer", opt)
    parts = [p.ds_tensor if hasattr(p, "ds_tensor") else p for p in engine.module.parameters()]
    held = {t.untyped_storage().data_ptr() for t in parts}
    flats = list(getattr(opt, "fp32_partitioned_groups_flat", None)
                 or getattr(opt, "single_partition_of_fp32_groups", None) or [])
    master = sum(tensor_bytes(f) for f in flats if f.untyped_storage().data_ptr() not in held)
    grad = getattr(opt, "grad_partitions_flat_buffer", None)
    buckets = []  # ZeRO-3: one tensor per bucket; ZeRO-1/2: a list of them
    for b in (getattr(opt, "ipg_buckets", None) or {}).values():
        buf = getattr(b, "buffer", None)
        buckets += buf if isinstance(buf, list) else [buf]
    return {"local_param_bytes": sum(tensor_bytes(t) for t in parts),
            "local_master_bytes": master, "master_is_param_partition": bool(flats) and not master,
            "local_optimizer_bytes": optimizer_bytes(inner),
            "local_grad_bytes": None if grad is None else tensor_bytes(grad),
            "ipg_bucket_bytes": sum(tensor_bytes(b) for b in buckets if b is not None),
            "optimizer": type(inner).__name__, "zero_optimizer": type(opt).__name__}


def run_sp(spec: dict[str, Any], workdir: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    import transformers

    steps_n = max(2, int(spec.get("steps", 3)))
    world = int(os.environ["WORLD_SIZE"])
    spec = {**spec, "attn_implementation": spec.get("attn_implementation", "sdpa")}
    model = spec_model(spec, workdir)
    full_param_bytes = sum(tensor_bytes(p) for p in model.parameters())
    args = _sp_args(spec, workdir, steps_n, world)
    per_step = args.per_device_train_batch_size * args.gradient_accumulation_steps
    seq = spec["seq_len"]
    data = [{**x, "position_ids": torch.arange(seq)}  # Ulysses needs them (module docstring)
            for x in examples(spec, model.config, per_step * world * (steps_n + 1), seed=1)]
    shapes: list[list[int]] = []
    model.register_forward_pre_hook(  # the shard each rank's model really sees
        lambda m, a, kw: shapes.append(list(kw["input_ids"].shape)) if "input_ids" in kw
        else None, with_kwargs=True)
    seen: list[str] = []
    records: list[dict[str, Any]] = []

    collate = digesting_collate(seen)

    class Window(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.open = open_window(alive_cpu_tensor_bytes())

        def on_step_end(self, args, state, control, **kw):
            records.append({"step": state.global_step, **close_window(self.open)})

    trainer = transformers.Trainer(model=model, args=args, train_dataset=data,
                                   data_collator=collate, callbacks=[Window()])
    trainer.train()
    engine = trainer.model_wrapped
    kind = str(trainer.accelerator.distributed_type)
    if "DEEPSPEED" not in kind or type(engine).__name__ != "DeepSpeedEngine":
        raise RuntimeError(f"the Trainer did not train through DeepSpeed ({kind}, "
                           f"{type(engine).__name__})")
    pc = trainer.accelerator.parallelism_config
    return {"rank": dist.get_rank(), "world_size": world, "steps": records,
            "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
            "full_param_bytes": full_param_bytes, **_ds_local_bytes(engine),
            "local_buffer_bytes": sum(tensor_bytes(b) for b in engine.module.buffers()),
            "sp": {"sp_size": pc.sp_size, "backend": dist.get_backend(),
                   "zero_stage": engine.zero_optimization_stage(),
                   "attn_implementation": model.config._attn_implementation,
                   "model_input_shapes": shapes[:4], "distributed_type": kind,
                   "config": {k: v for k, v in trainer.accelerator.deepspeed_config.items()
                              if isinstance(v, (int, float, str, bool, dict))}},
            "data_digest": seen[0] if seen else None}
