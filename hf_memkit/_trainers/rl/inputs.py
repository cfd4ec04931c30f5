"""What ``GRPOConfig`` / ``RLOOConfig`` and the engines behind them refuse of the online-RL fields
a user types, checked before anything is traced (``GRPO.config_problems``,
``GRPO.batch_problems``): every problem at once (docs/style.md §7).

Read from TRL 1.16 (``GRPOConfig.__post_init__``; ``RLOOConfig.__post_init__`` is the same):
  * ``generation_batch_size`` and ``steps_per_generation`` are not both configured;
  * neither given: ``steps_per_generation`` is ``gradient_accumulation_steps`` and the generation
    batch ``per_device_train_batch_size x processes x steps_per_generation``; a given
    ``steps_per_generation`` makes it the same product, and a given ``generation_batch_size``
    must be divisible by the global batch ``per_device_train_batch_size x processes``;
  * the generation batch is divisible by ``num_generations`` (whole prompt groups), and
    ``num_generations`` is at least 2 (the advantages compare a prompt's completions; 0 fails
    earlier, dividing by it).
TRL takes the others as given and fails later, as vLLM or the trace would:
``max_completion_length`` is ``max_new_tokens`` (positive; bounded as ``seq_len`` is,
``MAX_TOKENS``), ``num_iterations`` divides the generation schedule, ``vllm_gpu_memory_utilization``
is vLLM's ``CacheConfig`` share, in (0, 1], and ``vllm_tensor_parallel_size`` /
``vllm_max_model_length`` are counts.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from ..._errors import quoted
from ..packing import MAX_TOKENS

# counts: field -> (None allowed, what it is, the fix)
COUNTS = {
    "num_iterations": (False, "the passes over each generation batch", "e.g. 1 (TRL's default)"),
    "steps_per_generation": (True, "the micro-steps one generation batch feeds",
                             "e.g. 1, or leave it unset (then the accumulation steps)"),
    "generation_batch_size": (True, "the rows generated at once over all processes",
                              "leave it unset to derive it from the batch"),
    "vllm_tensor_parallel_size": (False, "the GPUs one colocated vLLM engine spans",
                                  "e.g. 1 (TRL's default)"),
    "vllm_max_model_length": (True, "the longest sequence vLLM serves, in tokens",
                              "leave it unset for the model's positions"),
}


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _got(v: Any) -> str:
    return f"{quoted(v)} ({type(v).__name__})" if isinstance(v, (bool, str)) else quoted(v)


def value_problems(options: Mapping[str, Any], config: str, default_generations: int) -> list[str]:
    """What is wrong with each field of ``options`` (``GRPO.read``) on its own; ``config``: the
    config class's name, ``default_generations``: its default ``num_generations``."""
    out = []
    g = options.get("num_generations")
    if not _is_int(g) or g < 2:
        out.append(f"`num_generations` must be an integer >= 2, got {_got(g)}: {config} refuses "
                   "fewer than 2 generations per prompt (the advantages compare a prompt's "
                   f"completions with each other); set num_generations=2 or more ({config}'s "
                   f"default: {default_generations})")
    c = options.get("max_completion_length")
    if not _is_int(c) or not 1 <= c <= MAX_TOKENS:
        out.append(f"`max_completion_length` must be a positive number of tokens, at most "
                   f"{MAX_TOKENS} (2**24, as seq_len), got {_got(c)}: generation runs to it "
                   "(max_new_tokens); e.g. max_completion_length=256")
    share = options.get("vllm_gpu_memory_utilization")
    if share is not None and (isinstance(share, bool) or not isinstance(share, (int, float))
                              or not math.isfinite(share) or not 0 < share <= 1):
        out.append(f"`vllm_gpu_memory_utilization` must be a fraction of the GPU's memory in "
                   f"(0, 1], got {_got(share)}: vLLM refuses any other share (CacheConfig); "
                   "e.g. 0.3 (TRL's default), or leave it out and plan_training chooses it")
    for name, (optional, what, fix) in COUNTS.items():
        v = options.get(name)
        if name not in options or (v is None and optional) or (_is_int(v) and v >= 1):
            continue
        none = " or None (unset)" if optional else ""
        out.append(f"`{name}` must be a positive integer{none}, got {_got(v)}: it is {what}; "
                   f"{fix}")
    return out


def generation_problems(options: Mapping[str, Any], config: str, *, micro_batch: int,
                        grad_accum: int, ranks: int) -> list[str]:
    """What ``config``'s ``__post_init__`` refuses of the generation batch for a run of
    ``micro_batch`` rows per device, ``grad_accum`` accumulation steps and ``ranks`` processes.
    ``options``: fields with valid values (``value_problems``), the derived ones None unless
    given (``GRPO.derived``)."""
    g, gbs, spg = (options.get(k) for k in ("num_generations", "generation_batch_size",
                                             "steps_per_generation"))
    if gbs is not None and spg is not None:
        return [f"generation_batch_size={gbs} and steps_per_generation={spg} are both set: "
                f"{config} refuses that ('generation_batch_size' and 'steps_per_generation' "
                "can not be both configured at the same time), since each derives the other "
                "(generation_batch_size = per_device_train_batch_size x processes x "
                "steps_per_generation); keep one"]
    step = micro_batch * ranks
    if gbs is not None:
        out = []
        if gbs % g:
            out.append(f"generation_batch_size ({gbs}) must be divisible by num_generations "
                       f"({g}): {config} refuses a generation batch that splits a prompt's "
                       f"group of completions; use a multiple of {g}")
        if gbs % step:
            lcm = step * g // math.gcd(step, g)
            out.append(f"generation_batch_size ({gbs}) must be divisible by the global batch "
                       f"size ({step}): {config} refuses it (per_device_train_batch_size "
                       f"{micro_batch} x {ranks} process(es)); use a multiple of {step}, e.g. "
                       f"{max(lcm, gbs // lcm * lcm)}, or a per_device_train_batch_size whose "
                       "global batch divides it")
        return out
    steps = spg if spg is not None else grad_accum
    gen = step * steps
    if gen % g == 0:
        return []
    where = "steps_per_generation" if spg is not None else \
        "steps_per_generation, unset: gradient_accumulation_steps"
    fit = g // math.gcd(g, ranks * steps)        # the per-device batches that make it whole
    fewer = [d for d in range(2, g) if gen % d == 0]
    other = f", or num_generations={fewer[-1]} (it divides {gen})" if fewer else ""
    return [f"generation_batch_size ({gen}) must be divisible by num_generations ({g}): "
            f"{config} refuses a generation batch that splits a prompt's group of "
            f"completions; the generation batch is per_device_train_batch_size {micro_batch} x "
            f"{ranks} process(es) x {steps} ({where}): use a per_device_train_batch_size that "
            f"is a multiple of {fit} (e.g. {-(-micro_batch // fit) * fit}){other}"]
