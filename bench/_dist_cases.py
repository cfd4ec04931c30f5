"""The 2-process CPU sharding cases: one spec each for ``measure_distributed_peak``.

Shared by ``bench/dist_measure.py`` (measures them) and ``bench/sharding.py`` (estimates them and
compares). A small Llama (hidden 256, 4 layers, vocab 8192, untied head: 7.4 M parameters,
28 MiB of fp32 weights, 113 MiB of fp32 AdamW model states) is big enough that model states
dominate the per-rank peak and small enough that each case trains in well under a minute.
"""

from __future__ import annotations

from typing import Any

from transformers import LlamaConfig

NPROC = 2
SEQ_LEN = 256
MICRO_BATCH = 4
STEPS = 5

LLAMA = LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2, vocab_size=8192,
                    max_position_embeddings=1024, tie_word_embeddings=False,
                    attention_dropout=0.0)


def _spec(name: str, mode: str, *, fsdp: dict[str, Any] | None = None,
          dtype: str | None = None, **args: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "name": name, "mode": mode, "config": LLAMA.to_dict(), "seq_len": SEQ_LEN,
        "steps": STEPS,
        # the Trainer's default optimizer (fused AdamW) and clipping, every run in fp32 unless
        # the case says otherwise
        "args": {"per_device_train_batch_size": MICRO_BATCH, "optim": "adamw_torch_fused",
                 "max_grad_norm": 1.0, **args},
    }
    if fsdp is not None:
        spec["fsdp"] = fsdp
    if dtype is not None:  # the dtype the model is loaded in (default float32)
        spec["dtype"] = dtype
    return spec


def cases() -> list[dict[str, Any]]:
    """~10 per-rank cases over ``NPROC`` gloo ranks; ``name`` is the row label (ignored by the
    measurement). FSDP2 cases wrap ``LlamaDecoderLayer`` as accelerate does."""
    wrap = ["LlamaDecoderLayer"]
    return [
        _spec("ddp-fp32-adamw", "ddp"),
        _spec("ddp-fp32-adamw-accum2", "ddp", gradient_accumulation_steps=2),
        _spec("fsdp2-full-shard", "fsdp2",
              fsdp={"reshard_after_forward": True, "transformer_layer_cls_to_wrap": wrap}),
        # FSDP1 (fsdp_config version 1), prepared as accelerate's Accelerator.prepare_model
        # does: its root unit (embedding, final norm, head) stays gathered through the step
        _spec("fsdp1-full-shard", "fsdp2",
              fsdp={"version": 1, "reshard_after_forward": True,
                    "transformer_layer_cls_to_wrap": wrap}),
        _spec("fsdp2-shard-grad-op", "fsdp2",
              fsdp={"reshard_after_forward": False, "transformer_layer_cls_to_wrap": wrap}),
        # accumulating with a reduce-scatter every micro-batch (accelerate's sync_each_batch,
        # what a plan sets): the second micro-step's backward holds the sharded gradients
        _spec("fsdp2-full-shard-ckpt-accum4-sync", "fsdp2",
              fsdp={"reshard_after_forward": True, "activation_checkpointing": True,
                    "transformer_layer_cls_to_wrap": wrap},
              gradient_accumulation_steps=4,
              accelerator_config={"gradient_accumulation_kwargs": {"sync_each_batch": True}}),
        _spec("fsdp2-full-shard-offload", "fsdp2",
              fsdp={"reshard_after_forward": True, "offload": True,
                    "transformer_layer_cls_to_wrap": wrap}),
        _spec("fsdp2-full-shard-bf16", "fsdp2",
              fsdp={"reshard_after_forward": True, "mixed_precision": "bf16",
                    "transformer_layer_cls_to_wrap": wrap}),
        # loaded in bf16 (dtype="auto" of a bf16 checkpoint), bf16=True: accelerate upcasts the
        # trainable parameters to fp32 before sharding (fp32 master shards, grads, AdamW state)
        _spec("fsdp2-full-shard-bf16-loaded", "fsdp2", dtype="bfloat16",
              fsdp={"reshard_after_forward": True, "mixed_precision": "bf16",
                    "transformer_layer_cls_to_wrap": wrap}),
        # DeepSpeed on its CPU accelerator (gloo), bf16, the Trainer's path with a client
        # torch AdamW; buckets small enough for this model (DeepSpeed's defaults are 5e8)
        _deepspeed("deepspeed-zero2-bf16", {"stage": 2, "reduce_bucket_size": 500_000,
                                            "allgather_bucket_size": 500_000}),
        _deepspeed("deepspeed-zero3-bf16", {"stage": 3, "reduce_bucket_size": 500_000,
                                            "stage3_prefetch_bucket_size": 500_000,
                                            "stage3_param_persistence_threshold": 0}),
    ]


def _deepspeed(name: str, zero: dict[str, Any]) -> dict[str, Any]:
    spec = _spec(name, "deepspeed", optim="adamw_torch", bf16=True)
    spec["deepspeed"] = {"bf16": {"enabled": True}, "zero_optimization": zero}
    return spec


SP_SEQ_LEN = 2048


def parallel_cases() -> list[dict[str, Any]]:
    """Tensor and sequence parallelism over ``NPROC`` gloo ranks (``hf_memkit.testing.
    _parallel_worker``), the same Llama. TP: loaded with transformers' ``DistributedConfig
    (tp_size=2)`` and trained with the Trainer's steps (the Trainer refuses TP on CPU), at the DDP
    cases' seq 256 x micro-batch 4, fp32, bf16 autocast (``bf16=True``), and a bf16-loaded
    model with ``bf16=True``. SP: DeepSpeed Ulysses through the real Trainer, ZeRO-3 (ALST's
    stage) and ZeRO-2, fp32 only (bf16 on CPU needs ``use_cpu``, which Ulysses cannot have),
    micro-batch 1 at 1024 and 2048 tokens; beside it the same ZeRO-3 run without SP (each rank its
    own 2048-token sample) so the activation split shows. Context parallelism does not run on
    CPU (``_parallel_worker.CP_ON_CPU``): no case."""
    zero3 = {"stage": 3, "reduce_bucket_size": 500_000, "stage3_prefetch_bucket_size": 500_000,
             "stage3_param_persistence_threshold": 0}
    zero2 = {"stage": 2, "reduce_bucket_size": 500_000, "allgather_bucket_size": 500_000}
    return [
        _spec("tp-fp32", "tp"),
        _spec("tp-bf16-autocast", "tp", bf16=True),
        _spec("tp-bf16-loaded", "tp", dtype="bfloat16", bf16=True),
        _long("sp-zero3-fp32-seq1024", "sp", zero3, 1024),
        _long("sp-zero3-fp32-seq2048", "sp", zero3, SP_SEQ_LEN),
        _long("sp-zero2-fp32-seq2048", "sp", zero2, SP_SEQ_LEN),
        _long("zero3-fp32-seq2048-no-sp", "deepspeed", zero3, SP_SEQ_LEN),
    ]


def _long(name: str, mode: str, zero: dict[str, Any], seq_len: int) -> dict[str, Any]:
    """A long-sequence DeepSpeed case: micro-batch 1, torch AdamW, fp32 (``bf16`` off)."""
    spec = _spec(name, mode, optim="adamw_torch", per_device_train_batch_size=1)
    spec["seq_len"] = seq_len
    spec["config"] = {**spec["config"], "max_position_embeddings": max(seq_len, 1024)}
    spec["deepspeed"] = {"bf16": {"enabled": False}, "zero_optimization": zero}
    return spec
