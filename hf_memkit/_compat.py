"""Fences around optional dependencies (docs/style.md §11).

Each ``is_*_available`` answers without importing the package twice; ``require`` raises an
error that names the feature lost and the extra that brings it back; ``quiet_notices`` drops
the notices that our own imports and traces make third-party packages log (and the warnings
our traces make torch raise), ``quiet_peft`` the
deprecation warnings peft triggers in transformers when our code calls it.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import re
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache

from ._errors import HfMemkitError

_EXTRA = {
    "pynvml": "nvml",
    "peft": "peft",
    "bitsandbytes": "bnb",
    "matplotlib": "plot",
}


@cache
def _has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


@cache
def checkpointing_field() -> str:
    """The installed ``TrainingArguments``' name for gradient checkpointing: transformers 5
    renamed ``gradient_checkpointing`` to ``activation_checkpointing``
    (docs/stack-facts.md#checkpointing-field-names); read the installed class rather than
    hard-code either."""
    import dataclasses

    from transformers import TrainingArguments

    names = {f.name for f in dataclasses.fields(TrainingArguments)}
    new = "activation_checkpointing"
    return new if new in names else "gradient_checkpointing"


def is_peft_available() -> bool:
    return _has("peft")


def is_bitsandbytes_available() -> bool:
    return _has("bitsandbytes")


def is_matplotlib_available() -> bool:
    return _has("matplotlib")


def is_flash_attn_available() -> bool:
    return _has("flash_attn")


def require(module: str, feature: str):
    """Import ``module`` or raise an error naming the lost ``feature`` and the pip extra."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        extra = _EXTRA.get(module)
        hint = f"pip install 'hf-memkit[{extra}]'" if extra else f"pip install {module}"
        raise HfMemkitError(f"{feature} needs `{module}`, which is not installed; {hint}") from exc


# Notices third-party packages log because of what our code does, not what the user did:
# (logger, start of the message); one line per notice.
NOTICES: tuple[tuple[str, str], ...] = (
    # At import: transformers' TrainingArguments and Trainer modules import peft when it is
    # installed, and peft imports bitsandbytes. bitsandbytes >= 0.49 on a CPU with AVX512-BF16
    # but without the `kernels` package then says it uses its own CPU 4-bit GEMM
    # (bitsandbytes/backends/cpu/ops.py).
    ("bitsandbytes.backends.cpu.ops", "Failed to load CPU gemm_4bit_forward"),
    # A trace of a model whose class name maps to no loss type (GPT2LMHeadModel, ...):
    # transformers falls back to ForCausalLMLoss, as it does in the user's own run
    # (PreTrainedModel.loss_function).
    ("transformers.modeling_utils", "`loss_type=None` was set in the config"),
    # Trainer -> accelerate's unwrap_model imports deepspeed when it is installed, and deepspeed
    # on a machine without a GPU says it falls back to the CPU (deepspeed/accelerator/
    # real_accelerator.py, through its "DeepSpeed" logger).
    ("DeepSpeed", "Setting accelerator to CPU"),
    # transformers imports torchao when it is installed (optim=adamw_torch_8bit/4bit); a torchao
    # wheel built for another torch names each C++ extension it could not load
    # (torchao/__init__.py) and registers its enums as pytree constants, which torch >= 2.13
    # deprecates (torch/utils/_pytree.py register_constant, logged with this format string)
    ("torchao", "Failed to load "),
    ("torch.utils._pytree", "%s is an Enum subclass"),
)


# Warnings third-party code raises because of what our traces do, not what the user did:
# (category, the exact message, the module that raises it); one line per warning.
TRACE_WARNINGS: tuple[tuple[type[Warning], str, str], ...] = (
    # MemTracker's backward hooks hold each module by weak reference; where a traced module is
    # gone by its backward (BERT's, on every estimate and twice per plan candidate), torch skips
    # that module's own snapshot and warns. Our trace reads only the global peak
    # (_trace/step.py, _GlobalPeakTracker), which the skipped snapshot does not change.
    (UserWarning, "Module is None. Skipping PRE_BW hook.", "torch.distributed._tools.mod_tracker"),
    (UserWarning, "Module is None. Skipping POST_BW hook.",
     "torch.distributed._tools.mod_tracker"),
)


class _DropNotice(logging.Filter):
    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


@contextmanager
def quiet_notices() -> Iterator[None]:
    """Drop ``NOTICES`` and ``TRACE_WARNINGS`` while the body runs (our imports of optional
    stacks, our traces), and only then: a user who imports bitsandbytes first still sees what it
    says, and every other warning still shows. Also a decorator."""
    added = [(logging.getLogger(name), _DropNotice(prefix)) for name, prefix in NOTICES]
    for logger, notice in added:
        logger.addFilter(notice)
    try:
        with warnings.catch_warnings():
            for category, message, module in TRACE_WARNINGS:
                warnings.filterwarnings("ignore", message=re.escape(message) + r"\Z",
                                        category=category, module=re.escape(module) + r"\Z")
            yield
    finally:
        for logger, notice in added:
            logger.removeFilter(notice)


# Warnings our calls into peft trigger: (category, regex of the message); one line per warning.
PEFT_WARNINGS: tuple[tuple[type[Warning], str], ...] = (
    # transformers 5 deprecates its `gradient_checkpointing` spellings (removal in v6) and peft
    # still uses them: get_peft_model reads `model.is_gradient_checkpointing`
    # (peft/peft_model.py), prepare_model_for_kbit_training calls `gradient_checkpointing_enable`
    # (peft/utils/other.py).
    (FutureWarning, r"`is_gradient_checkpointing` is deprecated"),
    (FutureWarning, r"`gradient_checkpointing_enable` is deprecated"),
    # our LoRA defaults on GPT-2's Conv1D layers: peft sets fan_in_fan_out itself
    # (peft/tuners/lora/layer.py)
    (UserWarning, r"fan_in_fan_out is set to False but the target module is `Conv1D`"),
)


@contextmanager
def no_progress_bars() -> Iterator[None]:
    """transformers' tqdm bars off while the body runs ("Writing model shards" when our train
    command saves the model: its own progress bar and summary already say where)."""
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()


@contextmanager
def quiet_peft() -> Iterator[None]:
    """Drop ``PEFT_WARNINGS`` while the body calls into peft (ours to fix, not the user's: the
    user's own transformers and peft calls still warn)."""
    with warnings.catch_warnings():
        for category, message in PEFT_WARNINGS:
            warnings.filterwarnings("ignore", message=message, category=category)
        yield


@contextmanager
def spare_the_collector() -> Iterator[None]:
    """Keep what is alive on entry (torch, transformers, the user's objects: about 600k
    objects) out of the cyclic garbage collector's full passes for the duration (``gc.freeze``),
    and give it back on exit (``gc.unfreeze``). A trace makes and drops many objects, so a plan
    runs full passes that each walk the whole heap: 0.3 s each, 7% of an 8B plan (measured).
    Nothing is freed later than it would be by reference counting; cycles made before entry wait
    for the first full pass after exit. Left alone where the caller froze objects itself or
    turned the collector off."""
    import gc

    if gc.get_freeze_count() or not gc.isenabled():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
