"""Predict a training (or eval) step's peak memory: ``estimate_memory`` -> ``MemoryEstimate``.

Model states (weights, gradients, optimizer state) are computed analytically from the parameter
list (``_model.spec``, ``_optimizers``, ``_engines``), so optimizers whose kernels cannot run on
fake tensors (bitsandbytes) are still exact. Activations and temporaries come from tracing the
real model code on fake tensors (``activations``); ``phases`` puts them together per phase of
the step, ``assemble`` makes one estimate of the rank (``parallel``: under tensor, context or
sequence parallelism), ``device`` and ``allocation`` add what CUDA holds besides (the caching
allocator replayed), ``budget`` says what it must fit in, and ``result`` holds the answer.
``hf_memkit._store`` keeps traces (and their allocator replays) on disk between processes,
keyed by all they depend on (``estimate_memory`` and the planner use it by default;
``HF_MEMKIT_NO_CACHE=1`` turns it off).

A hub: it drives every engine and trainer through its registry entry and names none
(docs/extending.md). What must fit, and in what budget: docs/fitting.md; the accuracy it is
held to and how it is measured: docs/quality-bars.md, docs/stack-facts.md#cpu-ground-truth.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import torch

from .._compat import quiet_notices, spare_the_collector
from .._cuda.runtime import parse_cuda_version
from .._device.precision import precision_issues
from .._device.probe import resolve_device
from .._engines import Sharding
from .._errors import ConfigError, HfMemkitError
from .._model.spec import resolve_model
from .._setup.setup import normalize_args
from .._trainers.fused_head import with_completion
from .._trainers.packing import MAX_TOKENS, token_counts, with_lengths
from .activations import TraceCache
from .assemble import estimate_for
from .budget import headroom_problem, max_memory_problem, memory_budget, resolve_headroom
from .phases import BREAKDOWN_SUM_KEYS
from .result import MemoryEstimate

STAGES = ("train", "eval", "forward_backward")


def _trainer_rows(setup: Any, lengths: Sequence[int] | None, seq_len: int | None,
                  completion_len: int | None) -> tuple[Any, int, str]:
    """``setup``, ``seq_len`` and the argument it came from, for the rows the trainer feeds:
    their ``lengths`` (padding-free micro-batches in tokens), the trainer's ``max_length`` as
    the default ``seq_len``, and the positions its head scores (``completion_len``)."""
    name = "seq_len" if seq_len is not None or lengths is None else "the longest row of lengths"
    setup, seq_len = with_lengths(setup, lengths, seq_len)
    if seq_len is None:
        seq_len, name = setup.trainer_kind.seq_len(setup.trainer_options), "max_length"
        if seq_len is None:
            raise ConfigError([f"seq_len is required: {setup.trainer_kind.title}'s "
                               "arguments carry no max_length; pass seq_len=<the longest "
                               "sequence of a batch>"], source="estimate_memory")
    return with_completion(setup, completion_len, seq_len), seq_len, name


def _longest_completion(completion_len: Any, completion_lengths: Any) -> Any:
    """``completion_len``, or the longest of ``completion_lengths`` (the completions' token
    counts: a padded batch is as wide as its longest completion); both given is refused."""
    if completion_lengths is None:
        return completion_len
    try:
        counts = token_counts(completion_lengths)
    except HfMemkitError as exc:
        raise ConfigError([f"completion_lengths: {exc}"], source="estimate_memory") from None
    if completion_len is not None:
        raise ConfigError([f"completion_len={completion_len} and completion_lengths are both "
                           "given: completion_lengths stands for its longest; give one"],
                          source="estimate_memory")
    return max(counts)


def _problems(seq_len: Any, stage: Any, target_len: Any, seq_name: str = "seq_len") -> list[str]:
    problems = []
    if not isinstance(seq_len, int) or isinstance(seq_len, bool) or not 0 < seq_len <= MAX_TOKENS:
        problems.append(f"{seq_name} must be a positive integer (at most {MAX_TOKENS} tokens), "
                        f"got {seq_len!r}")
    if stage not in STAGES:
        problems.append(f"stage must be one of {', '.join(map(repr, STAGES))}, got {stage!r} "
                        "('forward_backward': a custom loop's forward and backward, no optimizer)")
    if target_len is not None and (not isinstance(target_len, int) or target_len <= 0):
        problems.append(f"target_len must be a positive integer, got {target_len!r}")
    return problems


def _warn_precision(amp: str | None, tf32: bool, dev: Any) -> None:
    """A ``UserWarning`` for each precision issue of the device (``_device.precision``, the rule
    plans and recipes share): the estimate is still made, of the precision asked for."""
    for issue in precision_issues(dev, bf16=amp == "bf16", fp16=amp == "fp16", tf32=tf32):
        warnings.warn(issue.message + ("; plans and recipes refuse it, and this estimate is of "
                                       "the precision asked for" if issue.refused else ""),
                      UserWarning, stacklevel=3)


def _batch_problems(args: Any, setup: Any, sharding: Sharding | None) -> list[str]:
    """What the trainer's config refuses of the run's batch (``TrainerKind.batch_problems``:
    whole generation groups of TRL's online RL), for a dict of fields (or none); a config
    instance's ``__post_init__`` has checked it already."""
    if args is not None and not isinstance(args, dict):
        return []
    return list(setup.trainer_kind.batch_problems(
        setup.trainer_options, setup.micro_batch, setup.grad_accum,
        (sharding or setup.sharding).world_size))


def _checked(seq_len: int | None, stage: str, target_len: int | None, seq_name: str,
             cuda_version: str | None, headroom: float | None, max_memory: Any,
             problems: list[str]) -> float:
    """The headroom to judge by; every problem of the inputs (with ``problems``, those found
    already) in one ``ConfigError``."""
    problems = problems + _problems(seq_len, stage, target_len, seq_name)
    if cuda_version is not None:
        try:
            parse_cuda_version(cuda_version)
        except ConfigError as exc:
            problems += exc.problems
    headroom = resolve_headroom(headroom, max_memory, "estimate_memory", stacklevel=4)
    if headroom_problem(headroom):
        problems.append(headroom_problem(headroom))
    if max_memory_problem(max_memory):
        problems.append(max_memory_problem(max_memory))
    if problems:
        raise ConfigError(problems, source="estimate_memory")
    return headroom


@spare_the_collector()
@quiet_notices()  # third-party import notices our call triggers
def estimate_memory(model: Any, args: Any = None, *, seq_len: int | None = None,
                    device: Any = None,
                    stage: str = "train", task: str | None = None, target_len: int | None = None,
                    dtype: torch.dtype | str | None = None, attn_implementation: str | None = None,
                    peft_config: Any = None, quantization_config: Any = None,
                    padded: bool = False, num_gpus: int | None = None,
                    sharding: Sharding | None = None,
                    cuda_version: str | None = None, headroom: float | None = None,
                    max_memory: int | str | None = None, trainer: str | None = None,
                    ref_model: bool | None = None,
                    lengths: Sequence[int] | None = None,
                    completion_len: int | None = None,
                    completion_lengths: Sequence[int] | None = None) -> MemoryEstimate:
    """Predict the peak memory of one training or eval step of `model` on a device.

    The estimate is for the target device: the model states come from the parameter list, and
    the activations from tracing the real model code on fake tensors. For a CUDA device the
    trace follows CUDA's autocast policy, SDPA kernel choice and dropout (`_cuda.emulation`),
    not this CPU's. The CUDA environment of this process is read as torch reads it:
    `PYTORCH_CUDA_ALLOC_CONF` / `PYTORCH_ALLOC_CONF` (the allocator options;
    `per_process_memory_fraction` caps the budget, options not modelled are named in the
    notes), `CUBLAS_WORKSPACE_CONFIG`, `TORCH_CUDNN_SDPA_DEPRIORITIZED` and, on this machine's
    GPU, the runtime cuDNN.

    Args:
        model (`torch.nn.Module`, `PretrainedConfig`, `str` or `os.PathLike`):
            A model on any device (the meta device included; a peft model is LoRA), a
            `PretrainedConfig`, a catalog name or a local directory.
        args (`TrainingArguments`, a TRL config or `dict`, *optional*):
            `transformers.TrainingArguments`, a TRL config (`SFTConfig`, `DPOConfig`,
            `GRPOConfig`, `RLOOConfig`) or a dict of their fields; `None` for the defaults. A
            dict plans for another machine without building the arguments here. A
            `parallelism_config` in it sets the data / tensor / context / sequence degrees.
        seq_len (`int`, *optional*):
            The longest sequence of a batch (a padded batch peaks there), at most 2**24
            tokens. May be left out when the trainer's config carries a `max_length` (the
            default then) or `lengths` is given (not both). GRPO / RLOO: the longest prompt.
        device (`DeviceInfo` or `str`, *optional*):
            A `DeviceInfo`, a catalog name or `"cpu"`; `None` for this machine's device
            (`probe_device()`), whose free memory then bounds the budget too.
        stage (`str`, *optional*, defaults to `"train"`):
            `"train"` (one optimizer step of the Trainer), `"eval"` (an eval step) or
            `"forward_backward"`: the peak of one forward and backward of the model's own loss
            (from `labels`) without an optimizer step and without optimizer state, as a custom
            training loop or a benchmark runs `model(**batch).loss.backward()`; the gradients
            stay allocated.
        task (`str`, *optional*):
            Picks the head when `model` is a config or a name (default: from the config's
            `architectures`).
        target_len (`int`, *optional*):
            The label length of a seq2seq model; defaults to `seq_len`.
        dtype (`torch.dtype` or `str`, *optional*):
            The dtype the weights are loaded in (`torch.float32`, `torch.bfloat16` = "pure" bf16
            training, `torch.float16`, or its name); `None` / `"auto"`: the model's, fp32 for a
            config.
        attn_implementation (`str`, *optional*):
            The attention kernel the model is loaded with (`"sdpa"`, `"eager"`, ...); default
            the model's own.
        peft_config (`peft.LoraConfig`, *optional*):
            LoRA adapters, as `Plan.model_kwargs` / `Plan.peft_config` would load them; a peft
            model's own adapters when left out.
        quantization_config (`BitsAndBytesConfig`, *optional*):
            A quantized base, as `Plan.model_kwargs` would load it (QLoRA: needs `peft_config`).
        padded (`bool`, *optional*, defaults to `False`):
            The batches carry a real attention mask (dynamic padding).
        num_gpus (`int`, *optional*):
            Data-parallel ranks. With `fsdp` / `fsdp_config` or `deepspeed` in `args` the
            estimate is one rank's (FSDP2 / ZeRO shards, gathered layers, buckets), otherwise
            DDP.
        sharding (`hf_memkit._engines.Sharding`, *optional*):
            How one rank holds the model states, replacing what `args` say (the planner's).
        cuda_version (`str`, *optional*):
            The target's CUDA, e.g. `"12.8"`; default the installed torch's CUDA, else the
            default torch wheel's (13.0). It decides eager or lazy module loading
            (`CUDA_MODULE_LOADING` is honoured) and so the CUDA context.
        headroom (`float`, *optional*, defaults to 0):
            The fraction of device memory kept free for other tenants, in [0, 1), as
            `plan_training` takes it: the budget the verdict is judged against is what CUDA
            hands out (NVML's total less the driver's reserve) x (1 - headroom).
        max_memory (`int` or `str`, *optional*):
            The budget in bytes or as `"20GiB"`; overrides the device's (1 - headroom)
            (a `headroom` given beside it is ignored, with a warning).
        trainer (`str`, *optional*):
            `"trainer"` (`transformers.Trainer`), `"sft"` (TRL's `SFTTrainer`), `"dpo"`
            (`DPOTrainer`), `"grpo"`, `"rloo"`, `"kto"`, `"reward"` or `"distillation"`; default from `args`' class (an `SFTConfig`
            means `"sft"`). TRL trainers are estimated as they run: their fused log-prob head,
            `max_length` as the default `seq_len`, padding-free / packed micro-batches, DPO's
            chosen+rejected rows and its reference model.
        ref_model (`bool`, *optional*):
            DPO and KTO only (another trainer refuses it). `True`: you pass your own `ref_model` (a
            frozen copy held on the device even for a PEFT policy or with
            `precompute_ref_log_probs`).
        lengths (`Sequence[int]`, *optional*):
            The token counts of the dataset's rows, in order, instead of `seq_len`: a padded
            batch peaks at the longest (truncated at `max_length`); a padding-free or packed
            SFT micro-batch is estimated at the most tokens any of its micro-batches holds
            (BFD's bins simulated as TRL packs them).
        completion_len (`int`, *optional*):
            SFT with `completion_only_loss` / `assistant_only_loss`, DPO: the labelled tokens
            of a row, which alone TRL's head scores on CUDA (`_trainers.fused_head`); without
            it every position is scored (an upper bound). GRPO / RLOO: the longest completion
            a generation batch holds (every row is padded to it), at most
            `max_completion_length`; without it, `max_completion_length` (the safe bound).
        completion_lengths (`Sequence[int]`, *optional*):
            Instead of `completion_len`: the completions' token counts (a distribution, e.g.
            from a previous run's logs); the estimate takes the longest, since a padded batch
            peaks there and any batch may hold it (their mean does not move the peak).

    Returns:
        `MemoryEstimate`: the step's predicted memory in bytes (`peak_allocated`,
        `device_used`, `required`, `breakdown`, the margin) with the `budget` it is judged
        against and how that was derived (`budget_basis`); `verdict` gives it in a word
        (`"fits"`, `"tight"`, `"does not fit"`), `fits` as a bool (True for `tight` too).

    Raises:
        ConfigError: Every problem of the inputs at once: `seq_len` missing or not a positive
            integer of at most 2**24 tokens, `lengths` with `seq_len`, an unknown `stage`, a
            bad `target_len`, `cuda_version`, `headroom`, `max_memory`, `num_gpus`,
            `completion_len` or `completion_lengths` (or both given), and the problems of `args` (`bf16` with `fp16`, an unknown
            optimizer, ...).
        HfMemkitError: An unknown model, device or trainer, a TRL trainer that is not
            modelled, a `dtype` weights cannot be loaded in, or a quantized base without
            `peft_config`.

    Warns:
        UserWarning: For a precision the device does not support (the estimate is still of
            the precision asked for), a `seq_len` past the model's positions, `headroom`
            beside `max_memory`, and settings the estimate does not model.
    """
    setup = normalize_args(args, source="args", num_gpus=num_gpus, trainer=trainer,
                           ref_model=ref_model)
    batch = _batch_problems(args, setup, sharding)
    completion_len = _longest_completion(completion_len, completion_lengths)
    setup, seq_len, seq_name = _trainer_rows(setup, lengths, seq_len, completion_len)
    headroom = _checked(seq_len, stage, target_len, seq_name, cuda_version, headroom,
                        max_memory, batch)
    if sharding is not None:
        setup = setup.replace(sharding=sharding)
    dev = resolve_device(device)
    _warn_precision(setup.amp, setup.tf32, dev)
    spec = resolve_model(model, task=task, dtype=dtype, attn_implementation=attn_implementation,
                         peft_config=peft_config, quantization_config=quantization_config)
    if seq_len is not None and spec.positions_warning(seq_len, seq_name):
        warnings.warn(spec.positions_warning(seq_len, seq_name), UserWarning, stacklevel=2)
    est = estimate_for(spec, setup, dev, seq_len=seq_len, stage=stage, target_len=target_len,
                       padded=padded, cuda_version=cuda_version, seq_name=seq_name)
    est.budget, est.budget_basis = memory_budget(dev, headroom=headroom, max_memory=max_memory,
                                                 this_machine=device is None)
    return est


__all__ = ["BREAKDOWN_SUM_KEYS", "STAGES", "MemoryEstimate", "TraceCache", "estimate_for",
           "estimate_memory"]
