"""What a device makes of the mixed precision a user asks for: one rule for ``estimate_memory``,
``plan_training`` and recipes.

The rule follows what the installed stack does with the arguments, not what we would like it to
do (transformers 5.x ``TrainingArguments.__post_init__``, accelerate's ``Accelerator``, torch):

* **bf16 before Ampere** (compute capability < 8.0, e.g. V100, T4): ``TrainingArguments`` asks
  ``torch.cuda.is_bf16_supported()``, whose default includes emulation and is True wherever a
  bf16 tensor can be created (every CUDA GPU torch supports). The run starts, with no bf16
  tensor cores: a warning, never a refusal. The planner never picks it itself (fp16 there).
* **fp16 on a CPU**: accelerate turns native AMP on only off the CPU, so the run starts and its
  step runs in fp32. Plans and recipes refuse it (they would hand over arguments that do not do
  what they say); ``estimate_memory`` estimates the fp16 autocast asked for, with a warning.
* **tf32 before Ampere**: ``TrainingArguments(tf32=True)`` raises. Plans and recipes refuse it;
  ``estimate_memory`` estimates it with a warning (the run cannot start).
"""

from __future__ import annotations

from typing import NamedTuple

from .probe import DeviceInfo


class PrecisionIssue(NamedTuple):
    field: str       # the argument: "bf16", "fp16" or "tf32"
    message: str
    refused: bool    # plans and recipes refuse it; a warning otherwise


def precision_issues(dev: DeviceInfo, *, bf16: bool = False, fp16: bool = False,
                     tf32: bool = False) -> list[PrecisionIssue]:
    """What ``dev`` makes of bf16/fp16 mixed precision and TF32 (see the module docstring)."""
    cc = ".".join(map(str, dev.compute_capability or ())) or "unknown"
    out = []
    if bf16 and dev.kind == "cuda" and not dev.supports_bf16:
        out.append(PrecisionIssue("bf16", (
            f"bf16=True on {dev.name} (compute capability {cc}): no bf16 tensor cores before "
            "compute capability 8.0 (Ampere). torch emulates bf16 there "
            "(torch.cuda.is_bf16_supported() is True), so TrainingArguments accepts it and the "
            "run starts, several times slower than fp16; memory is as estimated. Use fp16=True "
            "on this GPU"), False))
    if fp16 and dev.kind == "cpu":
        out.append(PrecisionIssue("fp16", (
            "fp16=True on a CPU: fp16 mixed precision needs a GPU (on a CPU accelerate leaves it "
            "off and the step runs in fp32). On a CPU use bf16=True with use_cpu=True, or no "
            "mixed precision; for a GPU name one (device='T4', --gpu T4)"), True))
    if tf32 and dev.kind == "cuda" and not dev.supports_tf32:
        out.append(PrecisionIssue("tf32", (
            f"tf32=True on {dev.name} (compute capability {cc}): TF32 needs an Ampere or newer "
            "GPU, and TrainingArguments(tf32=True) raises on this GPU; drop tf32"), True))
    return out
