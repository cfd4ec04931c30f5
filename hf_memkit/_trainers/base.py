"""The trainer registry: one ``TrainerKind`` subclass per trainer class whose step hf_memkit models,
registered in one line (as engines, methods and techniques are).

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
  * ``config_problems(options)``, ``batch_problems(options, micro_batch, grad_accum, ranks)``,
    ``target_problems(options, target, ranks)``: what its config refuses, before any trace;
  * ``adjust(uses)``: the techniques that are on, as the trainer changes them before training;
  * ``notes(options)``, ``host_note(nbytes)``: what the estimate says about it;
  * ``fields``: the config fields it models (the field-coverage test checks the rest are named);
  * ``takes_ref_model``, ``lengths_plan``: whether ``ref_model=`` and ``lengths=`` apply;
  * ``eval_is_forward``: whether its eval step holds no more than its train step's forward;
  * ``sequence_split``: whether its step runs with each sequence split over ranks (cp / sp);
  * ``unmodelled_fields``: fields of its config alone that change memory and are not modelled;
  * ``run_problems(...)`` and ``build(...)``: what ``hf-memkit train`` needs to run it, and the
    trainer it builds over a recipe's rows.
A trainer whose step has phases of its own (online RL's generation) or shares the device with
another engine (a colocated vLLM) implements three hooks, empty here, that the estimator and
the planner call for every trainer: ``rollout`` (and ``rollout_notes``), ``tenant`` and
``plan_around``. ``docs/extending.md`` says what a new trainer touches.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from .._errors import HfMemkitError
from .._registry import Registry
from .._techniques.liger import liger_layers_only
from .._units import format_bytes


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
    records_phases = False   # its no-grad step records phases of its own (``rollout``)

    def __init__(self, options: Mapping[str, Any] | None = None) -> None:
        from .offload import ActivationOffload

        self.options: Mapping[str, Any] = options or {}
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

    def rollout(self, model: Any, batch: dict[str, Any], reference: Any,
                record: Callable[[str], None]) -> None:
        """Where ``records_phases``: a no-grad step that records phases of its own by name
        (``record(name)``) instead of one eval forward."""
        raise NotImplementedError(f"{type(self).__name__} records no phases of its own")

    def loss(self, model: Any, batch: dict[str, Any], reference: Any = None) -> Any:
        """The micro-step's loss (a scalar the trace backpropagates); ``reference``: the
        trainer's reference model (a frozen copy, or the PEFT policy's twin over the same
        tensors, whose adapters the step disables)."""
        out = model(**batch)
        return out.loss if hasattr(out, "loss") else out[0]


@dataclass(frozen=True)
class Unmodelled:
    """A config field that changes memory and is not modelled. ``what``: what it changes (the
    warning's text). ``trainers``: the trainers where it does (empty: all); elsewhere it is
    irrelevant because ``otherwise``. ``when``: other fields' values under which it changes
    memory (the warning is given only then)."""

    what: str
    trainers: tuple[str, ...] = ()
    otherwise: str = ""
    when: Mapping[str, tuple[Any, ...]] = field(default_factory=dict)

    def applies(self, trainer: str, get: Callable[[str], Any]) -> bool:
        return (not self.trainers or trainer in self.trainers) and \
            all(str(get(k)) in map(str, vs) for k, vs in self.when.items())


@dataclass
class RolloutPhase:
    """One phase of a step besides its train micro-steps (``TrainerKind.rollout``): its peak
    (``total``), its breakdown (weights, gradients, optimizer, activations, temporaries,
    summing to it) and the trace it came from (``_estimate``'s ``Excess``)."""

    total: int
    parts: dict[str, int]
    excess: Any


@dataclass
class Tenant:
    """What shares the device with the trainer at the step's peak (``TrainerKind.tenant``: a
    colocated vLLM engine), as the estimate adds it."""

    key: str                 # its row in the estimate's breakdown
    nbytes: int              # what it holds at the moment ``used`` is taken
    used: int                # device_used with it
    phase: str               # the moment of that peak
    notes: list[str]
    refusals: list[str]      # why it would not start beside the trainer (empty: it starts)


class TrainerKind:
    """Base of the registered trainers: ``transformers.Trainer`` (the model's own loss from
    ``labels``, rows x seq_len tokens); each TRL entry overrides what its trainer does."""

    name = "trainer"
    title = "Trainer"                             # the trainer class users construct
    config_class = "transformers.TrainingArguments"  # "module.Class" of its arguments
    fields: tuple[str, ...] = ()                  # the config fields it models
    extra: str | None = None                      # the pip extra that installs it
    takes_ref_model = False                       # estimate_memory(ref_model=...) applies
    # config fields of this trainer alone that change nothing a step holds, by reason
    # (``_setup.coverage``'s IRRELEVANT holds those of every trainer)
    irrelevant: Mapping[str, tuple[str, ...]] = {}
    lengths_plan = False                          # plans micro-batches in tokens from lengths=
    # how its step's memory differs from transformers.Trainer's on the same arguments, said
    # beside an answer people compare across trainers (``hf-memkit estimate --max-seq-len``)
    memory_difference = ""
    # its eval step is a forward and loss of the train step's own (no generation): it fits
    # at any batch the train step fits at (the planner's eval batch search stops there)
    eval_is_forward = True
    # its step runs with each sequence split over ranks (context / sequence parallelism): the
    # rows it feeds are plain sequences (not paired rows, not a rollout of phases)
    sequence_split = True
    # config fields its config's ``__post_init__`` derives from others (read None unless given)
    derived: tuple[str, ...] = ()
    # fields of this trainer's config alone that change memory and are not modelled (warned
    # when set); ``_setup.coverage`` gathers them with the fields every trainer has
    unmodelled_fields: Mapping[str, Unmodelled] = {}

    def read(self, get: Callable[[str], Any]) -> Mapping[str, Any]:
        """The options that change memory (``get``: a config field, with its default)."""
        return {}

    def seq_len(self, options: Mapping[str, Any]) -> int | None:
        """The default sequence length (TRL: ``max_length``)."""
        return None

    def shape(self, options: Mapping[str, Any], batch: int, seq: int) -> BatchShape:
        """The micro-batch the model really sees."""
        return BatchShape(batch, seq)

    def step(self, options: Mapping[str, Any]) -> TraceStep | None:
        """The ``TraceStep`` the trace runs (None: the model's own loss)."""
        return None

    def reference(self, options: Mapping[str, Any], adapters: bool) -> str | None:
        """What serves as the reference model ("copy", "adapters", or None)."""
        return None

    def notes(self, options: Mapping[str, Any]) -> list[str]:
        return []

    def adapter_dtype(self, *, quantized: bool, zero3: bool, base: Any,
                      given: Any) -> Any:
        """The torch dtype the trainer casts a PEFT model's trainable adapters to (None: it
        leaves them as peft made them). ``quantized``: a bitsandbytes base; ``zero3``: under
        DeepSpeed ZeRO-3; ``base``: the load dtype; ``given``: the adapters' dtype in a peft
        model the user passed (None: the trainer wraps the model from ``peft_config``)."""
        return None

    def adapter_note(self, dtype: Any) -> str:
        return f"{self.title} trains the adapters in {str(dtype).removeprefix('torch.')}"

    def completion_problem(self, options: Mapping[str, Any]) -> str | None:
        """Why ``estimate_memory(completion_len=...)`` does not apply (None: it does: the
        trainer's head scores only the labelled positions on CUDA, ``fused_head``)."""
        return (f"completion_len applies to TRL's SFTTrainer and DPOTrainer, whose fused head "
                f"scores only the labelled positions on CUDA; {self.title} computes the model's "
                "own loss over every position (drop completion_len, or pass trainer='sft' / "
                "'dpo')")

    def unmodelled(self, options: Mapping[str, Any]) -> list[str]:
        """``"field: what it changes"`` for settings on in ``options`` it does not model."""
        return []

    def config_problems(self, options: Mapping[str, Any]) -> list[str]:
        """What the trainer refuses when it is built with these ``options`` (its ``__init__``
        raises): refused as it would be, before anything is traced."""
        return []

    def batch_problems(self, options: Mapping[str, Any], micro_batch: int, grad_accum: int,
                       ranks: int) -> list[str]:
        """What the trainer's config refuses of a run of ``micro_batch`` rows per device,
        ``grad_accum`` accumulation steps and ``ranks`` processes (TRL's online RL: whole
        generation groups), given ``options`` as the user set them: refused by an estimate
        of a dict, and kept out of a plan's search. None by default."""
        return []

    def target_problems(self, options: Mapping[str, Any], target: int, ranks: int) -> list[str]:
        """What the trainer refuses of a plan's effective batch (``target_batch_size`` over
        ``ranks``), beyond the batch rule every trainer has."""
        return []

    def adjust(self, uses: frozenset[Any]) -> frozenset[Any]:
        """The techniques that are on, as the trainer passes them on."""
        return uses

    def host_note(self, nbytes: int) -> str:
        """What the estimate says of the pinned host bytes its ``TraceStep`` held at once."""
        return f"{self.title} keeps {format_bytes(nbytes)} in pinned host memory at once"

    # -- phases and tenants of its own: empty here (online RL fills them, ``rl``) ---------------
    def rollout(self, spec: Any, setup: Any, rs: Any, *, held: int,
                trace: Callable[[Any], Any]) -> dict[str, RolloutPhase]:
        """The step's phases besides its train micro-steps (generation, scoring), by the name
        the estimate reports, each with its peak and breakdown. ``spec`` / ``setup``: the
        model and setup as each rank computes (``ModelSpec``, ``TrainingSetup``); ``rs``: one
        rank's model states (``RankStates``); ``held``: a reference model's bytes held on the
        rank; ``trace(phase_setup)``: the excess of an eval trace of a phase's setup at the
        step's sequence length. None by default."""
        return {}

    def rollout_notes(self, setup: Any, phases: Mapping[str, RolloutPhase]) -> list[str]:
        """What the estimate says about ``rollout``'s phases."""
        return []

    def tenant(self, spec: Any, setup: Any, dev: Any, *, seq_len: int, held: int,
               parts: Mapping[str, int], rs: Any, used: int, phase: str) -> Tenant | None:
        """Another engine on the device beside the trainer's step of peak ``used`` bytes
        (device_used) in ``phase`` with breakdown ``parts``, or None (the default). ``dev``:
        the target (``DeviceInfo``); ``held``: a reference model's bytes on the rank."""
        return None

    def plan_around(self, req: Any, run: Callable[[Any], Any], base: Callable[[], Any]) -> Any:
        """The plan of ``req`` (a ``PlanRequest``): ``run(req)`` after planning what the
        trainer brings besides its step (a colocated vLLM's share of the GPU). ``base()``: the
        model's spec as loaded. By default ``run(req)``."""
        return run(req)

    def rederive(self, args: Any, planned: dict[str, Any]) -> dict[str, Any]:
        """``planned`` (a plan's fields for ``Plan.apply_to``) plus the ``derived`` fields of
        ``args`` (an instance of this trainer's config) that its ``__post_init__`` must derive
        again from them. None by default."""
        return planned

    def modelled_fields(self) -> frozenset[str]:
        """``fields`` less those ``unmodelled`` warns about when they are on (its messages
        start with the field's name): the config fields the estimate follows (``_setup``)."""
        warned = {m.split(":", 1)[0] for m in self.unmodelled({f: True for f in self.fields})}
        return frozenset(self.fields) - warned

    def config_type(self) -> type:
        """The installed config class (raises a clear error when its package is missing)."""
        import importlib

        module, _, cls = self.config_class.rpartition(".")
        try:
            return getattr(importlib.import_module(module), cls)
        except ImportError as exc:
            raise HfMemkitError(
                f"trainer={self.name!r} ({self.title}) needs {module}, which is not installed "
                f"({exc}); pip install 'hf-memkit[{self.extra}]'") from exc

    # -- hf-memkit train ------------------------------------------------------------------------
    def run_problems(self, *, where: str, synthetic: bool, task: str | None,
                     callbacks: tuple[str, ...]) -> list[str]:
        """Why ``hf-memkit train`` cannot train a recipe with this trainer (``where``: the
        recipe; its data, task and callbacks)."""
        return []

    def build(self, *, model: Any, args: Any, rows: Any, data_collator: Any,
              processing_class: Any, callbacks: list[Any], oom_guard: bool) -> Any:
        """The trainer ``hf-memkit train`` runs over ``rows`` (items with ``input_ids``);
        ``args``: the plan's config for this trainer; ``oom_guard``: recover from OOMs."""
        from transformers import Trainer

        from .._oom.guard import OOMGuardTrainer

        cls = OOMGuardTrainer if oom_guard else Trainer
        return cls(model=model, args=args, train_dataset=rows, data_collator=data_collator,
                   processing_class=processing_class, callbacks=callbacks)


class TrlTrainerKind(TrainerKind):
    """What TRL's trainers share (``SFTTrainer``, ``DPOTrainer``; ``GRPOTrainer`` and
    ``RLOOTrainer`` override the length and the run): a config with ``max_length`` (the default
    ``seq_len``), Liger's layer kernels only (``adjust``), the adapters' dtype TRL casts them
    to, TRL's activation offloading (``host_note``), and what ``hf-memkit train`` needs to run
    them (``run_problems``)."""

    extra = "trl"

    def seq_len(self, options: Mapping[str, Any]) -> int | None:
        return options.get("max_length")

    def adjust(self, uses: frozenset[Any]) -> frozenset[Any]:
        return liger_layers_only(uses)

    def adapter_dtype(self, *, quantized: bool, zero3: bool, base: Any, given: Any) -> Any:
        # TRL 1.16 SFTTrainer / DPOTrainer.__init__: a quantized model's trainable parameters
        # are cast to bf16 (QLoRA's recipe; DoRA's magnitude stays); under ZeRO-3 a 16-bit
        # base is wrapped with autocast_adapter_dtype=False, so adapters keep its dtype
        import torch

        if quantized:
            return torch.bfloat16
        return base if zero3 and given is None else None

    def adapter_note(self, dtype: Any) -> str:
        return (f"{self.title} casts the trainable adapters to "
                f"{str(dtype).removeprefix('torch.')} (TRL: bf16 for a quantized base; the "
                "base's dtype under ZeRO-3), so their weights, gradients and optimizer state "
                "are in that dtype")

    def host_note(self, nbytes: int) -> str:
        return (f"TRL's activation offloading keeps {format_bytes(nbytes)} of saved activations "
                "in pinned host memory at once (the device keeps the last few it copied, and in "
                "the backward the ones two autograd nodes use)")

    # what `hf-memkit train` makes from synthetic rows for this trainer ("DPO's preference
    # pairs"); "": it trains on the rows themselves, any data source
    synthetic_examples = ""

    def synthetic_problem(self, where: str, synthetic: bool) -> list[str]:
        """A recipe whose data is not synthetic, for a trainer whose examples ``hf-memkit
        train`` can only make from synthetic rows (``synthetic_examples``)."""
        if synthetic or not self.synthetic_examples:
            return []
        return [f"{where}: data.source: `hf-memkit train` makes {self.synthetic_examples} only "
                f"for data: synthetic; for your own data train {self.title} yourself with "
                "plan.to_training_args() and hf_memkit.MemoryCallback(plan) (hf-memkit plan "
                f"{where} works as it is)"]

    def run_problems(self, *, where: str, synthetic: bool, task: str | None,
                     callbacks: tuple[str, ...]) -> list[str]:
        problems = []
        if task is not None and task != "causal-lm":
            problems.append(f"{where}: model.task: trainer: {self.name} trains a causal LM; "
                            f"this model's task is {task} (use trainer: trainer, or model.task: "
                            "causal-lm)")
        if "oom_guard" in callbacks:
            problems.append(
                f"{where}: callbacks: oom_guard retries a step by splitting its micro-batch "
                f"into rows, which TRL's packed and padding-free batches do not allow; with "
                f"trainer: {self.name} drop oom_guard (the plan already fits the memory it was "
                "given)")
        return problems


def padded_length(o: Mapping[str, Any], seq: int) -> int:
    """``seq`` rounded up to the config's ``pad_to_multiple_of`` (its collators pad so)."""
    m = o.get("pad_to_multiple_of")
    return -(-seq // m) * m if m else seq


# the key under which the CLI's JSON (a plan's, an estimate's, a run's) names the trainer
TRAINER_KEY = "trainer"

TRAINERS: Registry[TrainerKind] = Registry(
    "trainer", hint="; TRL's online DPO, PPO, ORPO and CPO trainers are not modelled")


def register(kind: TrainerKind) -> TrainerKind:
    return TRAINERS.register(kind)
