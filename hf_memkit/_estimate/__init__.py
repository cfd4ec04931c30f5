"""Predict a training (or eval) step's peak memory: ``estimate_memory`` -> ``MemoryEstimate``.

Model states (weights, gradients, optimizer state) are computed analytically from the parameter
list (``_model.spec``, ``_optimizers``, ``_engines``), so optimizers whose kernels cannot run on
fake tensors (bitsandbytes) are still exact. Activations and temporaries come from tracing the
real model code on fake tensors (``activations``); ``phases`` puts them together per phase of
the step, and ``result`` holds the answer.
"""

from __future__ import annotations

from typing import Any

import torch

from .._cuda import parse_cuda_version
from .._device import resolve_device
from .._engines import Sharding
from .._errors import ConfigError
from .._model.spec import resolve_model
from .._setup import normalize_args
from .activations import TraceCache
from .phases import BREAKDOWN_SUM_KEYS, estimate_for
from .result import MemoryEstimate

STAGES = ("train", "eval", "forward_backward")


def _problems(seq_len: Any, stage: Any, target_len: Any) -> list[str]:
    problems = []
    if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len <= 0:
        problems.append(f"seq_len must be a positive integer, got {seq_len!r}")
    if stage not in STAGES:
        problems.append(f"stage must be one of {', '.join(map(repr, STAGES))}, got {stage!r} "
                        "('forward_backward': a custom loop's forward and backward, no optimizer)")
    if target_len is not None and (not isinstance(target_len, int) or target_len <= 0):
        problems.append(f"target_len must be a positive integer, got {target_len!r}")
    return problems


def estimate_memory(model: Any, args: Any = None, *, seq_len: int, device: Any = None,
                    stage: str = "train", task: str | None = None, target_len: int | None = None,
                    dtype: torch.dtype | str | None = None, attn_implementation: str | None = None,
                    peft_config: Any = None, quantization_config: Any = None,
                    padded: bool = False, num_gpus: int | None = None,
                    sharding: Sharding | None = None,
                    cuda_version: str | None = None) -> MemoryEstimate:
    """Predict the peak memory of one training (``stage="train"``) or eval step.

    ``stage="forward_backward"``: the peak of one forward and backward of the model's own loss
    (from ``labels``) without an optimizer step and without optimizer state, as a custom training
    loop or a benchmark runs ``model(**batch).loss.backward()``; the gradients stay allocated.
    ``cuda_version`` ("12.8"): the target's CUDA; default the installed torch's CUDA, else the
    default torch wheel's (13.0). It decides eager or lazy module loading (``CUDA_MODULE_LOADING``
    is honoured) and so the CUDA context. For a CUDA device the trace follows CUDA's autocast
    policy, SDPA kernel choice and dropout (``_cuda_emulation``), not this CPU's.

    ``model``: a model on any device (meta included; a peft model is LoRA), a
    ``PretrainedConfig``, a catalog name or a local directory. ``args``: ``TrainingArguments`` or a
    dict of its fields. ``seq_len``: the longest sequence of a batch (a padded batch peaks there).
    ``task`` picks the head for a config; ``target_len`` is the label length of seq2seq (default
    ``seq_len``). ``dtype``: the dtype weights are loaded in (``torch.bfloat16`` = "pure" bf16
    training; default: the model's, fp32 for a config). ``peft_config`` / ``quantization_config``:
    LoRA / QLoRA as ``Plan.model_kwargs`` would load it. ``padded``: batches carry a real attention
    mask (dynamic padding). ``device``: DeviceInfo, catalog name, ``"cpu"``, or None (this machine).
    ``num_gpus``: data-parallel ranks; with ``fsdp``/``fsdp_config`` or ``deepspeed`` in ``args``
    the estimate is one rank's (FSDP2 / ZeRO shards, gathered layers, buckets), otherwise DDP.
    """
    problems = _problems(seq_len, stage, target_len)
    if cuda_version is not None:
        try:
            parse_cuda_version(cuda_version)
        except ConfigError as exc:
            problems += exc.problems
    if problems:
        raise ConfigError(problems, source="estimate_memory")
    setup = normalize_args(args, source="args", num_gpus=num_gpus)
    if sharding is not None:
        setup = setup.replace(sharding=sharding)
    dev = resolve_device(device)
    spec = resolve_model(model, task=task, dtype=dtype, attn_implementation=attn_implementation,
                         peft_config=peft_config, quantization_config=quantization_config)
    return estimate_for(spec, setup, dev, seq_len=seq_len, stage=stage, target_len=target_len,
                        padded=padded, cuda_version=cuda_version)


__all__ = ["BREAKDOWN_SUM_KEYS", "STAGES", "MemoryEstimate", "TraceCache", "estimate_for",
           "estimate_memory"]
