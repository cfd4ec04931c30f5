"""``Plan``: the chosen setup, every candidate considered, and how to apply it."""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from .._compat import quiet_notices
from .._device.probe import DeviceInfo
from .._engines import ENGINES, Engine, launch_commands
from .._engines.dims import read_dims
from .._engines.single import SINGLE
from .._errors import HfMemkitError
from .._estimate import MemoryEstimate
from .._methods import METHODS
from .._setup.coverage import ENGINE_FIELDS
from .._setup.fields import OUTBOUND_FIELDS, training_args_fields
from .._techniques import TECHNIQUES
from .._techniques.checkpointing import NAME as CHECKPOINTING
from .._trainers import TRAINER, TRAINERS
from .._units import format_bytes
from . import read
from . import serialize as ser
from .emit import trainer_checkpointing
from .space import Candidate

# TrainingArguments fields whose override re-estimates the plan: the batch, precision and
# optimizer, what the engines and the parallel degrees read (``ENGINE_FIELDS``) and the
# techniques' fields.
MEMORY_FIELDS = frozenset({
    "per_device_train_batch_size", "gradient_accumulation_steps", "bf16", "fp16", "optim",
    "optim_args", *ENGINE_FIELDS, *(f for t in TECHNIQUES for f in t.fields)})


@dataclass
class Plan:
    """The chosen setup, every candidate considered, and how to apply it.

    Made by `plan_training` (read back with `from_dict` / `from_json`); sizes in bytes.

    Attributes:
        device (`DeviceInfo`):
            The device planned for.
        model_name (`str` or `PretrainedConfig`):
            The model's catalog name or path, else its config (what re-estimates load).
        seq_len (`int`):
            The longest sequence of a batch.
        target_batch_size (`int`):
            The effective batch: micro-batch x accumulation x data-parallel ranks.
        num_gpus (`int`):
            Ranks over all nodes.
        method (`str`):
            The method asked for (`"auto"`, `"full"`, `"lora"`, `"qlora"`); `chosen` has the
            one picked.
        budget (`int`):
            What one rank's step must fit in.
        training_args_kwargs (`dict`):
            `TrainingArguments` (or TRL config) fields.
        model_kwargs (`dict`):
            For `from_pretrained`: `attn_implementation`, `dtype`, `quantization_config`.
        peft_config (`peft.LoraConfig` or `None`):
            The adapters of a LoRA / QLoRA plan.
        accelerator_kwargs (`dict`):
            accelerate's settings: mixed precision, accumulation, the engine's plugin.
        candidates (`list[Candidate]`):
            Every setup considered, each with its estimate or the reason it was rejected.
        notes (`list[str]`):
            What was assumed, chosen or changed, in words.
        num_nodes (`int`):
            Nodes the ranks are spread over.
        parallel (`dict`):
            With several GPUs: the engine, the strategy and the launch details.
    """

    device: DeviceInfo
    model_name: str
    seq_len: int
    target_batch_size: int
    num_gpus: int
    method: str
    budget: int
    training_args_kwargs: dict[str, Any]
    model_kwargs: dict[str, Any]
    peft_config: Any
    accelerator_kwargs: dict[str, Any]
    candidates: list[Candidate]
    notes: list[str] = field(default_factory=list)
    num_nodes: int = 1
    parallel: dict[str, Any] = field(default_factory=dict)  # engine, strategy, launch details
    budget_basis: str = "the plan's budget"  # how the budget was derived, for a person
    # what each rung saved (_plan.rungs), or the search that works it out on first use
    _ladder: list[dict[str, Any]] | Callable[[], list[dict[str, Any]]] = field(
        default_factory=list, repr=False, compare=False)

    def __post_init__(self) -> None:
        # the candidates' estimates are judged against the plan's budget (``MemoryEstimate.fits``)
        for c in self.candidates:
            if c.estimate is not None and c.estimate.budget is None:
                c.estimate.budget, c.estimate.budget_basis = self.budget, self.budget_basis

    @property
    def ladder(self) -> list[dict[str, Any]]:
        """`list[dict]`: what each memory rung of the chosen setup saved
        (`_plan.rungs.ladder_savings`). Estimated on first use (`explain()`, `to_json()`): a
        plan that is only applied does not pay for the setups below its rungs."""
        if callable(self._ladder):
            self._ladder = self._ladder()
        return self._ladder

    @property
    def chosen(self) -> Candidate:
        """`Candidate`: the chosen setup."""
        return next(c for c in self.candidates if c.chosen)

    @property
    def verdict(self) -> str:
        """`str`: the chosen setup's verdict, `"fits"` or `"tight"` (`MemoryEstimate.verdict`;
        the planner takes a tight setup only when none fits with its margin)."""
        est = self.chosen.estimate
        return est.verdict if est is not None else ("fits" if self.chosen.fits else "tight")

    @property
    def estimate(self) -> MemoryEstimate | None:
        """`MemoryEstimate` or `None`: the chosen setup's estimate."""
        return self.chosen.estimate

    # -- using it ---------------------------------------------------------------------------
    @quiet_notices()  # third-party import notices our call triggers
    def to_training_args(self, **overrides: Any):
        """Build the plan's `TrainingArguments`; call it on the target machine.

        A plan for a TRL trainer builds its config (`SFTConfig`, `DPOConfig`, ...). An
        override that changes memory is re-estimated; if the result no longer fits, a warning
        shows it.

        Args:
            **overrides:
                Fields set over the plan's; yours always win (`output_dir` defaults to
                `"hf_memkit_output"`).

        Returns:
            `TrainingArguments` or the TRL trainer's config.

        Raises:
            HfMemkitError: When the config class refuses the plan on this machine (it checks
                `bf16`, `fp16` and `tf32` against the machine that builds it).
        """
        est = self.chosen.estimate if self.chosen is not None else None
        kind = est.setup.trainer_kind if est is not None else TRAINER
        TrainingArguments = kind.config_type()  # noqa: N806 - the class the user would name
        kwargs = {"output_dir": "hf_memkit_output", **self.training_args_kwargs, **overrides}
        if MEMORY_FIELDS & set(overrides) and self.chosen.estimate is not None:
            self._warn_if_override_does_not_fit(kwargs)
        kwargs = _with_objects(kwargs)
        return self._build(lambda: TrainingArguments(**kwargs), TrainingArguments.__name__)

    @quiet_notices()  # third-party import notices our call triggers
    def apply_to(self, args: Any) -> Any:
        """Set the plan's fields onto your own arguments, keeping every other field.

        A planned field that `args` had set to another value than its class default is
        replaced, with a warning naming both values (pin it in `plan_training` to keep yours);
        a planned field the class lacks is not applied, with a warning. `args` itself is left
        as it was (`with_fields`: no `__init__` of a subclass is called, fields with
        `init=False` and other attributes are kept). Where the run's results go (`output_dir`,
        `report_to`, `push_to_hub`, `hub_*`) stays as `args` has it.

        Args:
            args (`TrainingArguments`):
                `TrainingArguments` or a subclass (`SFTConfig`, `DPOConfig`, your own).

        Returns:
            A copy of `args`, of the same class, with the plan's fields.

        Raises:
            HfMemkitError: When `args` is not `TrainingArguments` (for a dict use
                `{**args, **plan.training_args_kwargs}`), or its class refuses the plan here.
        """
        import dataclasses

        from transformers import TrainingArguments

        if not isinstance(args, TrainingArguments):
            raise HfMemkitError(
                f"apply_to takes TrainingArguments or a subclass of it (SFTConfig, DPOConfig, "
                f"...), got {type(args).__name__}; for a dict use "
                "{**args, **plan.training_args_kwargs}")
        cls = type(args)
        init = {f.name for f in dataclasses.fields(cls) if f.init} - set(OUTBOUND_FIELDS)
        planned = {k: v for k, v in self.training_args_kwargs.items() if k in init}
        unknown = sorted(set(self.training_args_kwargs) - init - set(OUTBOUND_FIELDS))
        if unknown:
            warnings.warn(f"{cls.__name__} has no field(s) {', '.join(unknown)}: the plan's "
                          "values for them are not applied", stacklevel=2)
        defaults = _defaults_of(cls, args)
        for k, v in planned.items():
            mine = getattr(args, k)
            if not _same(mine, v) and k in defaults and not _same(mine, defaults[k]):
                warnings.warn(
                    f"apply_to: {cls.__name__}.{k}={_plain(mine)!r} is replaced by the plan's "
                    f"{_plain(v)!r}; to keep yours, plan with it pinned "
                    f"(plan_training(..., {k}={_plain(mine)!r}))", stacklevel=2)
        return self._build(lambda: with_fields(args, _with_objects(_rederived(args, planned))),
                           cls.__name__)

    def _build(self, make: Any, what: str) -> Any:
        """``make()``, with transformers' refusal of the plan on this machine in our words."""
        try:
            return make()
        except ValueError as exc:
            here = "CUDA" if torch.cuda.is_available() else "no CUDA device"
            raise HfMemkitError(
                f"{what} refused the plan here: {exc}\nThe plan is for {self.device.name} "
                f"({self.device.kind}); this machine has {here}, and {what} checks bf16, fp16 "
                "and tf32 against the machine that builds it. Build the arguments on the "
                "target machine (carry the plan there with plan.to_json() / Plan.from_json()), "
                "or use the plain dict plan.training_args_kwargs") from exc

    def estimate_again(self, **overrides: Any) -> MemoryEstimate:
        """The chosen setup estimated afresh by `estimate_memory` from the plan's own arguments
        (with `overrides`) and environment (`env`), judged against the plan's budget: what a
        user gets who passes them to `estimate_memory`. Without overrides its verdict is the
        plan's.

        Args:
            **overrides:
                Fields set over the plan's arguments.

        Returns:
            `MemoryEstimate`.
        """
        from .._estimate import estimate_memory

        est = self.chosen.estimate
        kind = est.setup.trainer_kind if est is not None else TRAINER
        fields = set(training_args_fields()) | set(kind.fields)
        args = {k: v for k, v in {**self.training_args_kwargs, **overrides}.items()
                if k in fields and k != "output_dir"}
        with _environment(self.env):  # what the run is launched with
            return estimate_memory(self.model_name, args, seq_len=self.seq_len,
                                   device=self.device,
                                   num_gpus=self.num_gpus if self.num_gpus > 1 else None,
                                   cuda_version=est.cuda_version if est is not None else None,
                                   max_memory=self.budget,
                                   trainer=None if kind is TRAINER else kind.name,
                                   **ser.estimate_kwargs(self.model_kwargs, self.peft_config))

    def _warn_if_override_does_not_fit(self, kwargs: dict[str, Any]) -> None:
        try:
            est = self.estimate_again(**kwargs)
        except Exception as exc:  # an override the estimator rejects: say so, do not block
            warnings.warn(f"could not re-estimate the overridden plan: {exc}", stacklevel=3)
            return
        if est.verdict != "fits":
            warnings.warn(
                f"with these overrides the setup is {est.verdict}: it needs "
                f"{format_bytes(est.required)} (+ margin "
                f"{format_bytes(est.upper - est.required)}), over the "
                f"budget of {format_bytes(self.budget)} on {self.device.name}:\n{est.explain()}",
                stacklevel=3)

    def set_attention(self, model: torch.nn.Module) -> None:
        """Switch a loaded model to the plan's attention kernel, in place.

        A model that refuses it keeps its own, with a warning.

        Args:
            model (`torch.nn.Module`):
                The loaded model.
        """
        attn = self.model_kwargs.get("attn_implementation")
        if attn and hasattr(model, "set_attn_implementation"):
            try:
                model.set_attn_implementation(attn)
            except Exception as exc:  # the loaded model may not support it: keep its own
                warnings.warn(f"kept the model's attention ({exc})", stacklevel=3)

    @quiet_notices()  # third-party import notices our call triggers
    def prepare(self, model: torch.nn.Module) -> torch.nn.Module:
        """Apply the plan to a loaded model: attention kernel, method and searched techniques.

        The method's preparation is k-bit preparation and LoRA (with `peft_config`); the
        techniques' include checkpointing (non-reentrant, safe with PEFT), left to the engine
        where it owns checkpointing (FSDP: `fsdp_config`) unless the plan's offload needs the
        Trainer's own.

        Args:
            model (`torch.nn.Module`):
                The model, loaded with `model_kwargs`.

        Returns:
            `torch.nn.Module`: the model to train (a peft model for LoRA / QLoRA).
        """
        self.set_attention(model)
        engine = self._engine()
        # an engine that owns checkpointing (FSDP: fsdp_config) applies it when it wraps,
        # unless the plan's offload needs the Trainer's own (``emit.trainer_checkpointing``)
        owned = {CHECKPOINTING} if engine.owns_checkpointing and \
            not trainer_checkpointing(self.chosen) else set()
        ckpt = self.chosen.checkpointing and CHECKPOINTING not in owned
        model = METHODS.get(self.chosen.method).prepare(model, self.peft_config, ckpt)
        for name in self.chosen.techniques:
            if name not in owned:
                model = TECHNIQUES.get(name).prepare(model)
        return model

    def launch_commands(self, script: str = "train.py") -> dict[str, str]:
        """`accelerate launch` and `torchrun` command lines for this plan's GPUs and nodes.

        With DeepSpeed, write the config first (`write_deepspeed_config`).

        Args:
            script (`str`, *optional*, defaults to `"train.py"`):
                The training script.

        Returns:
            `dict[str, str]`: `"accelerate"`, `"torchrun"` and `"accelerate_config"` (with
            `accelerate_config()` written to `accelerate_config.yaml`).
        """
        engine = self._engine()
        out = launch_commands(script=script, num_gpus=self.num_gpus, num_nodes=self.num_nodes,
                              engine=engine.name, config_file=engine.config_file)
        out["accelerate_config"] = ("accelerate launch --config_file accelerate_config.yaml "
                                    f"{script}  # plan.accelerate_config() written there")
        prefix = " ".join(f"{k}={v}" for k, v in self.env.items())
        return {k: f"{prefix} {v}" if prefix else v for k, v in out.items()}

    @property
    def env(self) -> dict[str, str]:
        """`dict[str, str]`: environment variables the run needs, set before its first CUDA
        allocation (the launch lines carry them): `PYTORCH_CUDA_ALLOC_CONF` with
        `expandable_segments:True` where the chosen setup fits only with it."""
        opt = self.chosen.allocator
        if not opt:
            return {}
        given = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
        return {"PYTORCH_CUDA_ALLOC_CONF": ",".join(x for x in (given, opt) if x)}

    def accelerate_config(self) -> str:
        """The `accelerate launch --config_file` YAML of this plan, as `accelerate config`
        writes it: processes, precision, the engine's plugin (FSDP2) and `parallelism_config`
        (its degrees).

        Returns:
            `str`: the YAML text.
        """
        import yaml

        return yaml.safe_dump(ser.accelerate_config(self), sort_keys=False)

    def _engine(self) -> Engine:
        return ENGINES.get(self.parallel.get("engine", SINGLE.name))

    def write_deepspeed_config(self, path: str | os.PathLike = "ds_config.json") -> str:
        """Write the plan's DeepSpeed config as JSON (pass it as `deepspeed=path` too).

        Args:
            path (`str` or `os.PathLike`, *optional*, defaults to `"ds_config.json"`):
                The file to write.

        Returns:
            `str`: `path`.

        Raises:
            HfMemkitError: When the plan does not use DeepSpeed.
        """
        cfg = self._engine().config_of(self.training_args_kwargs)
        if cfg is None:
            named = next(e.name for e in ENGINES if e.config_file)
            raise HfMemkitError(f"this plan uses {self.parallel.get('label', 'no DeepSpeed')}; "
                                f"plan with engine={named!r} for a DeepSpeed config")
        with open(path, "w", encoding="utf-8") as f:
            json.dump(cfg, f, indent=2)
        return str(path)

    # -- reading it ---------------------------------------------------------------------------
    def explain(self) -> str:
        """`str`: the tables a person reads (also `str(plan)`)."""
        from .._views.text import plan_tables, render_to_text

        return render_to_text(*plan_tables(self))

    def __str__(self) -> str:
        return self.explain()

    def __repr__(self) -> str:
        from .._views.text import plan_repr

        return plan_repr(self)

    def _repr_html_(self) -> str:
        from .._views.html import plan_html

        return plan_html(self)

    def rejected_summary(self) -> dict[str, int]:
        """`dict[str, int]`: how many setups were not estimated, by kind of reason."""
        return ser.rejected_summary(self.candidates)

    def to_dict(self, *, full: bool = True) -> dict[str, Any]:
        """The plan as a JSON-ready dict, `"chosen"` first: the chosen setup, its memory and
        its arguments. A plan file is shared, so it never holds where the run's results go
        (`output_dir`, `report_to`, `push_to_hub`, `hub_*`): pass those to `to_training_args`.

        Args:
            full (`bool`, *optional*, defaults to `True`):
                `False` (`hf-memkit plan --json`): only the estimated setups, the full
                estimate on the chosen one, and the rest counted by reason in
                `candidates_not_estimated`. `from_dict` reads both forms.

        Returns:
            `dict[str, Any]`
        """
        cands = {"candidates": [c.to_dict() for c in self.candidates]} if full else {
            "candidates": ser.compact_candidates(self.candidates),
            "candidates_not_estimated": self.rejected_summary()}
        return {
            "chosen": ser.chosen_summary(self),
            "device": self.device.to_dict(), "model_name": ser.model_ref_to_json(self.model_name),
            "seq_len": self.seq_len,
            "target_batch_size": self.target_batch_size, "num_gpus": self.num_gpus,
            "method": self.method, "budget": self.budget, "budget_basis": self.budget_basis,
            "training_args_kwargs": ser.shareable_args(self.training_args_kwargs),
            "model_kwargs": ser.model_kwargs_to_json(self.model_kwargs),
            "peft_config": ser.peft_to_dict(self.peft_config),
            "accelerator_kwargs": self.accelerator_kwargs,
            **cands, "notes": list(self.notes),
            "num_nodes": self.num_nodes, "parallel": self.parallel, "ladder": self.ladder,
        }

    def to_json(self, *, full: bool = True, **kw: Any) -> str:
        """`to_dict(full=full)` as JSON.

        Args:
            full (`bool`, *optional*, defaults to `True`):
                As in `to_dict`.
            **kw:
                Passed to `json.dumps` (`indent=2`, ...).

        Returns:
            `str`
        """
        return json.dumps(self.to_dict(full=full), **kw)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Plan:
        """Inverse of `to_dict` (either form).

        What it reads is checked as `plan_training` would have made it (`_plan.read`).

        Args:
            d (`dict[str, Any]`):
                A plan's `to_dict()`.

        Returns:
            `Plan`

        Raises:
            ConfigError: One error naming every bad field.
        """
        return cls(**read.plan_kwargs(d, cls))

    @classmethod
    def from_json(cls, text: str | bytes) -> Plan:
        """`from_dict` of a plan's JSON (`to_json`).

        Args:
            text (`str` or `bytes`):
                The JSON text.

        Returns:
            `Plan`

        Raises:
            HfMemkitError: When the text does not parse as JSON.
            ConfigError: As `from_dict`: one error naming every bad field.
        """
        try:
            d = json.loads(text)
        except (ValueError, TypeError) as exc:  # JSONDecodeError, a str that is not UTF-8
            raise HfMemkitError(f"the plan JSON does not parse ({str(exc)[:200]}); "
                                f"{read.REMAKE}") from None
        except RecursionError:  # arrays or objects nested thousands deep
            raise HfMemkitError("the plan JSON nests too deep to read (a plan is a few levels "
                                f"deep); {read.REMAKE}") from None
        return cls.from_dict(d)


def with_fields(args: Any, values: dict[str, Any]) -> Any:
    """A copy of ``args`` (a ``TrainingArguments`` instance) with ``values`` set, re-derived as
    construction derives it: the class's ``__post_init__`` runs again on the copy (it converts
    and checks the fields, sets the mixed precision, the devices, the DeepSpeed and FSDP
    plugins; transformers writes it to be re-run, and ``to_dict()`` rebuilds rely on that).

    Not ``dataclasses.replace``: it calls ``__init__``, which a subclass may have written with
    another signature (a ``TypeError``), and it resets ``init=False`` fields and any attribute
    the user's own ``__init__`` set. The copy keeps them all; cached properties (the device
    ``_setup_devices`` found for the old fields) are dropped so they are found again."""
    import copy
    from functools import cached_property

    new = copy.copy(args)
    for klass in type(args).__mro__:
        for name, attr in vars(klass).items():
            if isinstance(attr, cached_property):
                new.__dict__.pop(attr.attrname or name, None)
    for k, v in values.items():
        setattr(new, k, v)
    post_init = getattr(new, "__post_init__", None)
    if post_init is not None:
        post_init()
    return new


def _rederived(args: Any, planned: dict[str, Any]) -> dict[str, Any]:
    """``planned`` plus what ``args``' config class must derive again from the planned batch:
    the trainer entry whose derived fields ``args`` holds says (``TrainerKind.rederive``)."""
    for kind in TRAINERS:
        if kind.derived and all(hasattr(args, f) for f in kind.derived):
            return kind.rederive(args, planned)
    return planned


def _with_objects(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The plan's JSON-able fields as the Trainer takes them: ``parallelism_config`` as
    accelerate's ``ParallelismConfig`` (the Trainer hands it to its ``Accelerator``)."""
    pc = kwargs.get("parallelism_config")
    if isinstance(pc, dict):
        dims = read_dims(pc)
        kwargs = {**kwargs, "parallelism_config": dims.to_accelerate() if dims else None}
    return kwargs


def _plain(v: Any) -> Any:
    """An enum field's value as the user wrote it."""
    return getattr(v, "value", v)


def _same(a: Any, b: Any) -> bool:
    a, b = _plain(a), _plain(b)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return [_plain(x) for x in a] == [_plain(x) for x in b]
    return a == b


def _defaults_of(cls: type, args: Any) -> dict[str, Any]:
    """Each field's value in ``cls`` built with nothing set (after ``__post_init__``, which fills
    some defaults in). A class that needs more than ``output_dir`` (its own ``__init__``): its
    nearest dataclass ancestor built so, and the field defaults for the fields it adds."""
    import dataclasses

    fresh = None
    for klass in (k for k in cls.__mro__ if dataclasses.is_dataclass(k)):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                fresh = klass(output_dir=args.output_dir)
            break
        except Exception:  # a class that needs more than output_dir: try its parent
            continue
    out = {f.name: f.default for f in dataclasses.fields(cls)
           if f.init and f.default is not dataclasses.MISSING}
    out.update({f.name: getattr(fresh, f.name) for f in dataclasses.fields(cls)
                if f.init and hasattr(fresh, f.name)} if fresh is not None else {})
    return out


@contextlib.contextmanager
def _environment(env: dict[str, str]) -> Iterator[None]:
    """``env`` set in ``os.environ`` for the block, as it was after it."""
    before = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
