"""The task/head registry: one ``Task`` subclass per file, registered in one line. A task names
the transformers Auto class that builds its head, how ``config.architectures`` reveals it, the
labels its collator makes (what the trace feeds the model), peft's task type, and whether
evaluation keeps vocabulary-sized logits."""

from __future__ import annotations

from typing import Any

from ..._errors import HfMemkitError, excerpt
from ..._registry import Registry


class Task:
    """Base of the registered tasks; each file sets its facts and the labels its collator makes
    (``labels_for``: what the trace feeds the model)."""

    name = ""
    auto_class = ""                          # transformers Auto class, e.g. AutoModelForCausalLM
    arch_suffixes: tuple[str, ...] = ()      # config.architectures[0] endings that mean this task
    encoder_decoder_only = False             # the suffix means this task only for seq2seq configs
    peft_task_type: str | None = None        # peft.TaskType value
    vocab_logits = False                     # eval keeps [batch x len x vocab] logits
    trainable_by_cli = False                 # `hf-memkit train` builds its data

    def labels_for(self, config: Any, batch: int, seq_len: int, target_len: int) -> dict:
        """The labels the default collator makes for a micro-batch of ``config``'s model
        (``config`` may be None: the labels of the default config)."""
        return {}


TASKS: Registry[Task] = Registry(
    "task", " (or 'auto' to read it from config.architectures)")


def register(task: Task, *aliases: str) -> Task:
    return TASKS.register(task, *aliases)


def normalize_task(task: str | None, config: Any = None) -> str:
    """Validate ``task``; ``None``/``"auto"`` infers it from ``config.architectures``."""
    if task in (None, "auto"):
        return infer_task(config) if config is not None else "causal-lm"
    if task not in TASKS:
        raise HfMemkitError(
            f"unknown task `{excerpt(task)}`; allowed: {', '.join(TASKS.names())} (or 'auto' to read it "
            "from config.architectures)")
    return TASKS.get(task).name


def infer_task(config: Any) -> str:
    arch = (getattr(config, "architectures", None) or [""])[0]
    enc_dec = bool(getattr(config, "is_encoder_decoder", False))
    for t in TASKS:
        if arch.endswith(t.arch_suffixes) and t.arch_suffixes and (
                enc_dec or not t.encoder_decoder_only):
            return t.name
    if enc_dec:
        return "seq2seq-lm"
    return "causal-lm" if getattr(config, "is_decoder", False) or arch == "" else "base"


def task_of_class(cls: type, config: Any) -> str:
    """The task of a loaded model, read from its class name (e.g. ...ForCausalLM)."""
    return infer_task(type("C", (), {"architectures": [cls.__name__],
                                     "is_encoder_decoder": getattr(config, "is_encoder_decoder",
                                                                   False)})())


def task_choices(*, aliases: bool = True) -> list[str]:
    """The values of ``task=`` (the CLI's ``--task``, recipes' ``model.task``)."""
    return ["auto", *TASKS.names(aliases=aliases)]


def auto_class(task: str):
    import transformers

    return getattr(transformers, TASKS.get(task).auto_class)


def long_zeros(*shape: int) -> Any:
    import torch

    return torch.zeros(*shape, dtype=torch.long)
