"""The ``Recipe`` dataclass: one field per YAML key (``Recipe.schema()``), the key table the
loader checks a file against, and the model-config helpers (``model.overrides``)."""

from __future__ import annotations

import dataclasses
import inspect
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .._estimate.budget import DEFAULT_HEADROOM

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "tokenizer.model")
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
_MISSING = object()


def _key(path: str, help_: str, default: Any = _MISSING) -> Any:
    """A dataclass field read from YAML key ``path`` (``section.name``)."""
    meta = {"key": path, "help": help_}
    if default is _MISSING:
        return field(metadata=meta)
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda d=default: type(d)(d), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class Recipe:
    """A validated recipe. Build one with ``load_recipe(path)``; every field maps to one YAML key
    (``Recipe.schema()``), and ``save(path)`` writes a file ``load_recipe`` reads back equal."""

    model: str = _key("model.name", "catalog name (hf-memkit: Llama-3.1-8B, bert-large-uncased, "
                      "...), a local model directory, or a config.json path")
    seq_len: int = _key("training.seq_len", "tokens per sequence (the longest of a batch): "
                        "activations grow linearly with it (quadratically with eager attention)")
    target_batch_size: int = _key("training.target_batch_size", "effective batch size; the "
                                  "plan splits it into micro-batch x accumulation x GPUs exactly")
    model_overrides: dict[str, Any] = _key("model.overrides", "config fields to change, e.g. "
                                           "{num_hidden_layers: 2}; the model is built from the "
                                           "config with random weights unless the model "
                                           "directory holds weights", {})
    task: str | None = _key("model.task", "head: causal-lm, sequence-classification, masked-lm, "
                            "...; default: read from config.architectures", None)
    tokenizer: str | None = _key("model.tokenizer", "local tokenizer directory (data from a file "
                                 "needs one; default: the model directory's own)", None)
    data: str = _key("data.source", "'synthetic' (random learnable token sequences, "
                     "hf_memkit._run.synthetic.SyntheticTextDataset) or a local .txt (one example "
                     "per line) / .jsonl file", "synthetic")
    num_samples: int | None = _key("data.num_samples", "synthetic: number of samples (default: "
                                   "enough for max_steps); a file: use at most this many", None)
    text_field: str = _key("data.text_field", "JSON-lines key holding the text", "text")
    label_field: str = _key("data.label_field", "JSON-lines key holding the class label "
                            "(sequence-classification)", "label")
    method: str = _key("training.method", "auto (full fine-tuning whenever it fits, else LoRA, "
                       "LoRA on an 8-bit base, QLoRA) | full | lora | qlora", "auto")
    trainer: str = _key("trainer", "a registered trainer: trainer (transformers.Trainer) | sft "
                        "(TRL's SFTTrainer: its fused log-prob head instead of the logits) | "
                        "dpo (DPOTrainer: chosen + rejected rows and a reference model) | grpo "
                        "| rloo (planned; hf-memkit train does not run them); pins may then "
                        "set that config's fields (SFTConfig / DPOConfig: packing, max_length, "
                        "...)", "trainer")
    device: str | None = _key("hardware.device", "catalog GPU to plan for (hf-memkit devices), "
                              "'cpu', or omitted for this machine", None)
    num_gpus: int = _key("hardware.num_gpus", "GPUs (data-parallel ranks); the effective batch "
                         "is split across them", 1)
    max_memory: int | str | None = _key("hardware.max_memory", "explicit per-GPU budget, bytes or "
                                        "'20GiB'; overrides device memory x (1 - headroom)", None)
    headroom: float = _key("hardware.headroom", "fraction of device memory kept free for other "
                           "tenants of the GPU", DEFAULT_HEADROOM)
    num_nodes: int = _key("hardware.num_nodes", "nodes the num_gpus are spread over (GPUs per "
                          "node = num_gpus / num_nodes)", 1)
    engine: str = _key("hardware.engine", "auto | ddp | fsdp | deepspeed: the data-parallel "
                       "engine when num_gpus > 1 (auto = DDP if a replica fits, else FSDP2)",
                       "auto")
    host_memory: int | str | None = _key("hardware.host_memory", "CPU RAM per node that CPU "
                                         "offload may use, e.g. '512GiB'", None)
    cuda_version: str | None = _key("hardware.cuda_version", "the target's CUDA, e.g. '12.8' "
                                    "(default: the installed torch's); decides the context",
                                    None)
    pins: dict[str, Any] = _key("pins", "fields of the trainer's config (TrainingArguments; "
                                "SFTConfig / DPOConfig with trainer: sft / dpo) that override "
                                "the planner "
                                "(e.g. optim, activation_checkpointing) or just set (max_steps, "
                                "learning_rate, logging_steps)", {})
    callbacks: list[str] = _key("callbacks", "memory (MemoryCallback: memory logs, "
                                "memory_report.json, memory_timeline.png), throughput "
                                "(ThroughputCallback), oom_guard (train with OOMGuardTrainer)",
                                ["memory", "throughput"])
    output_dir: str | None = _key("output_dir", "where the model, logs, report and PNG go "
                                  "(default: outputs/<recipe name>)", None)
    source: str | None = field(default=None, compare=False,
                               metadata={"help": "the file this recipe was loaded from"})

    # -- what the planner and the trainer need ------------------------------------------------

    @property
    def name(self) -> str:
        return Path(self.source).stem if self.source else "recipe"

    @property
    def is_synthetic(self) -> bool:
        return self.data == "synthetic"

    def model_config(self):
        """The model's ``PretrainedConfig`` with ``model_overrides`` applied (no weights)."""
        return config_with_overrides(self.model, self.model_overrides)

    def model_ref(self) -> Any:
        """What ``plan_training`` takes: the name/directory, or a config when overridden."""
        return self.model_config() if self.model_overrides else self.model

    def has_weights(self) -> bool:
        return Path(self.model).is_dir() and any((Path(self.model) / f).is_file()
                                                 for f in WEIGHT_FILES)

    def tokenizer_dir(self) -> str | None:
        if self.tokenizer:
            return self.tokenizer
        if Path(self.model).is_dir() and has_tokenizer(Path(self.model)):
            return self.model
        return None

    def plan_kwargs(self, **overrides: Any) -> dict[str, Any]:
        """Keyword arguments of ``plan_training``; ``overrides`` (not None) win."""
        kw = dict(model=self.model_ref(), seq_len=self.seq_len,
                  target_batch_size=self.target_batch_size, device=self.device,
                  num_gpus=self.num_gpus, method=self.method,
                  # with max_memory the headroom is unused (the recipe check warns if both)
                  headroom=None if self.max_memory is not None else self.headroom,
                  max_memory=self.max_memory, task=self.task, num_nodes=self.num_nodes,
                  engine=self.engine, host_memory=self.host_memory,
                  cuda_version=self.cuda_version, trainer=self.trainer, **self.pins)
        kw.update({k: v for k, v in overrides.items() if v is not None})
        return kw

    # -- files --------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """The nested YAML form (only keys that differ from their defaults, plus required ones)."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            if "key" not in f.metadata:
                continue
            value = getattr(self, f.name)
            default = f.default if f.default is not dataclasses.MISSING else (
                f.default_factory() if f.default_factory is not dataclasses.MISSING else _MISSING)
            if default is not _MISSING and value == default:
                continue
            node = out
            *parents, leaf = f.metadata["key"].split(".")
            for p in parents:
                node = node.setdefault(p, {})
            node[leaf] = value
        return out

    def save(self, path: str | os.PathLike) -> None:
        with open(path, "w") as fh:
            yaml.safe_dump(self.to_dict(), fh, sort_keys=False)

    @classmethod
    def schema(cls) -> list[tuple[str, Any, str]]:
        """``(yaml key, default, help)`` for every key, in file order."""
        rows = []
        for f in dataclasses.fields(cls):
            if "key" not in f.metadata:
                continue
            if f.default is not dataclasses.MISSING:
                default = f.default
            elif f.default_factory is not dataclasses.MISSING:
                default = f.default_factory()
            else:
                default = "(required)"
            rows.append((f.metadata["key"], default, f.metadata["help"]))
        return rows


# ----------------------------------------------------------------------------------------------
# the key table: YAML key -> Recipe field, and the sections they live in
# ----------------------------------------------------------------------------------------------

FIELDS = {f.metadata["key"]: f.name for f in dataclasses.fields(Recipe) if "key" in f.metadata}
SECTIONS: dict[str, set[str]] = {}
for _k in FIELDS:
    if "." in _k:
        _s, _leaf = _k.split(".", 1)
        SECTIONS.setdefault(_s, set()).add(_leaf)
TOP = {k for k in FIELDS if "." not in k} | set(SECTIONS)
SHORTHAND = {"model": "name", "data": "source"}   # `model: NAME`, `data: synthetic`


def leaf_key(leaf: str) -> str:
    return next(k for k in FIELDS if k.split(".")[-1] == leaf)


# ----------------------------------------------------------------------------------------------
# model config helpers
# ----------------------------------------------------------------------------------------------

def has_tokenizer(d: Path) -> bool:
    return any((d / f).is_file() for f in TOKENIZER_FILES)


def config_keys(config) -> set[str]:
    keys = set(config.to_dict())
    for cls in type(config).__mro__:
        if "__init__" in vars(cls):
            keys |= {p for p in inspect.signature(cls.__init__).parameters
                     if p not in ("self", "kwargs")}
    return keys | {"num_labels"}


def apply_overrides(config, overrides: dict[str, Any]):
    """A new config of the same class: the overrides applied through ``__init__``, so derived
    fields (head_dim, rope parameters) are recomputed as when the config is built."""
    from transformers import AutoConfig

    d = config.to_dict()
    d.update(overrides)
    if "num_labels" in overrides:
        d.pop("id2label", None)
        d.pop("label2id", None)
    model_type = d.pop("model_type")
    d.pop("transformers_version", None)
    new = AutoConfig.for_model(model_type, **d)
    base = getattr(config, "name_or_path", "") or model_type
    new.name_or_path = f"{base} + {len(overrides)} config override(s)"
    return new


def config_with_overrides(model: str, overrides: dict[str, Any]):
    from .._model.catalog import resolve_config

    config = resolve_config(model)
    return apply_overrides(config, overrides) if overrides else config
