"""The trainer registry: one ``TrainerKind`` per trainer class whose step hf_memkit models.

``transformers.Trainer`` runs the model's own loss. TRL's trainers run their own: ``SFTTrainer``
and ``DPOTrainer`` replace the LM head and loss with a fused log-prob head, DPO feeds chosen and
rejected rows together and runs a reference forward. An entry says, from its config's fields:
  * ``read(get)``: the options that change memory (``get`` reads a config field, defaults from
    the installed config class), kept in ``TrainingSetup.trainer``;
  * ``seq_len(options)``: the default sequence length (``max_length``);
  * ``shape(options, micro_batch, seq_len)``: the micro-batch the model really sees;
  * ``step(options)``: the ``TraceStep`` the trace runs (None: the model's own loss);
  * ``reference(options, adapters)``: what serves as the reference model ("copy", "adapters",
    or None), whose weights are held on the device;
  * ``unmodelled(options)``: "field: what it changes" for settings it does not model (warned);
  * ``adjust(uses)``: the techniques that are on, as the trainer changes them before training;
  * ``fields``: the config fields it models (the field-coverage test checks the rest are named).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from .._registry import Registry


class BatchShape(NamedTuple):
    """The micro-batch a trainer's collator builds: ``rows`` x ``tokens``; ``padded``: a real
    attention mask; ``packed``: sequences flattened into rows with ``position_ids``
    (padding-free), so attention sees sequence boundaries."""

    rows: int
    tokens: int
    padded: bool = False
    packed: bool = False


class TraceStep:
    """How a trainer runs one micro-step, for the fake-tensor trace (``_trace.trace_step``).

    The default is ``transformers.Trainer``: the model's own loss from ``labels``. A TRL step
    with ``activation_offloading`` runs under TRL's offloading hooks (``offload``), whose pinned
    host bytes ``host_peak`` reports."""

    title = "Trainer"

    def __init__(self, options: Mapping[str, Any] | None = None) -> None:
        from .offload import ActivationOffload

        self.offload = ActivationOffload(self.title) \
            if (options or {}).get("activation_offloading") else None

    def prepare(self, model: Any, *, adapters: bool) -> None:
        """Patch the fake (base) model as the trainer does before training."""
        if self.offload is not None:
            self.offload.watch(model)

    def kernels(self, target: Any) -> Any:
        """What replaces the trainer's GPU kernels on the trace (``target``: None for a CPU)."""
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def context(self, target: Any) -> Iterator[None]:
        """Around each traced micro-step (``target``: the CUDA target, or None for this CPU)."""
        with self.kernels(target), \
                self.offload(target) if self.offload is not None else contextlib.nullcontext():
            yield

    def host_peak(self) -> int:
        """The most pinned host bytes the offloading held at once in the steps traced since
        ``prepare``."""
        return self.offload.host_peak if self.offload is not None else 0

    def loss(self, model: Any, batch: dict[str, Any], reference: Any = None) -> Any:
        """The micro-step's loss (a scalar the trace backpropagates); ``reference``: the
        trainer's reference model (a frozen copy, or the PEFT policy's twin over the same
        tensors, whose adapters the step disables)."""
        out = model(**batch)
        return out.loss if hasattr(out, "loss") else out[0]


@dataclass(frozen=True)
class TrainerKind:
    name: str
    title: str                                    # the trainer class users construct
    config_class: str                             # "module.Class" of its arguments
    read: Callable[[Callable[[str], Any]], Mapping[str, Any]] = field(
        default=lambda get: {})
    fields: tuple[str, ...] = ()
    seq_len: Callable[[Mapping[str, Any]], int | None] = field(default=lambda o: None)
    shape: Callable[[Mapping[str, Any], int, int], BatchShape] = field(
        default=lambda o, batch, seq: BatchShape(batch, seq))
    step: Callable[[Mapping[str, Any]], TraceStep] | None = None
    reference: Callable[[Mapping[str, Any], bool], str | None] = field(
        default=lambda o, adapters: None)
    notes: Callable[[Mapping[str, Any]], list[str]] = field(default=lambda o: [])
    unmodelled: Callable[[Mapping[str, Any]], list[str]] = field(default=lambda o: [])
    extra: str | None = None                      # the pip extra that installs it
    # the techniques as the trainer passes them on (TRL drops Liger's fused cross-entropy)
    adjust: Callable[[frozenset[Any]], frozenset[Any]] = field(default=lambda uses: uses)

    def modelled_fields(self) -> frozenset[str]:
        """``fields`` less those ``unmodelled`` warns about when they are on (its messages
        start with the field's name): the config fields the estimate follows (``_fields``)."""
        warned = {m.split(":", 1)[0] for m in self.unmodelled({f: True for f in self.fields})}
        return frozenset(self.fields) - warned

    def config_type(self) -> type:
        """The installed config class (raises a clear error when its package is missing)."""
        import importlib

        module, _, cls = self.config_class.rpartition(".")
        try:
            return getattr(importlib.import_module(module), cls)
        except ImportError as exc:
            from .._errors import HfMemkitError

            raise HfMemkitError(
                f"trainer={self.name!r} ({self.title}) needs {module}, which is not installed "
                f"({exc}); pip install 'hf-memkit[{self.extra}]'") from exc


def padded_length(o: Mapping[str, Any], seq: int) -> int:
    """``seq`` rounded up to the config's ``pad_to_multiple_of`` (its collators pad so)."""
    m = o.get("pad_to_multiple_of")
    return -(-seq // m) * m if m else seq


TRAINERS: Registry[TrainerKind] = Registry(
    "trainer", hint="; TRL's GRPO, RLOO, online DPO, KTO and reward trainers are not modelled")


def register(kind: TrainerKind) -> TrainerKind:
    return TRAINERS.register(kind)
