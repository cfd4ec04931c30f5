"""What a plan is asked for, validated once: ``PlanRequest.problems()``.

``plan_training``, the CLI and the recipe loader all build a ``PlanRequest`` and report its
problems; each problem names the request field it is about (``Problem.field``), so a recipe can
say which YAML key holds the bad value. Fitting rules (docs/fitting.md): budget = ``max_memory`` or
``total_memory x (1 - headroom)``, and no more than ``free_memory`` when planning for the device
this process runs on; the effective batch (micro-batch x accumulation x ranks) equals
``target_batch_size`` exactly.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, NamedTuple

from .._cuda.runtime import parse_cuda_version
from .._device.precision import PrecisionIssue, precision_issues
from .._device.probe import DeviceInfo, probe_device, resolve_device
from .._engines import ENGINES, Engine, ParallelDims, engine_choices, engine_stage
from .._engines.dims import read_dims
from .._errors import ConfigError, HfMemkitError, did_you_mean, excerpt, quoted
from .._estimate.budget import (
    DEFAULT_HEADROOM,
    Budget,
    headroom_problem,
    max_memory_problem,
    memory_budget,
    unplannable,
)
from .._methods import METHODS, method_choices
from .._setup.fields import check_field, config_fields
from .._trainers import TRAINER, TRAINER_KEY, TRAINERS, TrainerKind
from .._trainers.packing import MAX_BATCH, MAX_TOKENS
from .._units import divisors, is_positive_int, parse_bytes

# GPUs one node of the catalog cards holds (HGX/DGX boards); more need num_nodes.
MAX_GPUS_PER_NODE = 8
MAX_RANKS = 2**17   # GPUs (and nodes) a request may name: above the largest clusters (~100k)
SEARCH_CONSTRAINTS = ("micro_batch",)
# the request's fields that decide the per-device batches searched
BATCH_FIELDS = ("target_batch_size", "num_gpus", "num_nodes", "micro_batch",
                "per_device_train_batch_size", "gradient_accumulation_steps")


class Problem(NamedTuple):
    field: str     # the PlanRequest field (or TrainingArguments pin) the problem is about
    message: str   # a sentence that stands on its own
    detail: str | None = None  # the same, said under the field's name (default: message)

    @property
    def under_key(self) -> str:
        return self.detail or self.message


def _choice_problem(name: str, value: Any, allowed: list[str]) -> Problem:
    detail = (f"expected one of {', '.join(allowed)}, got {quoted(value)}"
              f"{did_you_mean(str(value), allowed)}")
    return Problem(name, f"{name} `{excerpt(value)}` is unknown; {detail}", detail)


@dataclass
class PlanRequest:
    """The arguments of ``plan_training``. With ``partial=True`` (a recipe being checked) a
    field that is None is unknown and its rules are skipped, and the device is not probed."""

    model: Any = None
    seq_len: int | None = None
    target_batch_size: int | None = None
    device: Any = None
    num_gpus: int | None = None
    method: str = "auto"
    headroom: float = DEFAULT_HEADROOM
    max_memory: int | str | None = None
    task: str | None = None
    num_nodes: int | None = 1
    engine: str = "auto"
    host_memory: int | str | None = None
    constraints: dict[str, Any] = field(default_factory=dict)
    partial: bool = False
    cuda_version: str | None = None
    trainer: str | None = None        # a registered trainer (_trainers); None: Trainer
    lengths: Any = None               # _plan.lengths.Lengths: the rows' lengths (SFT)
    # the planner's own split of each sequence over ranks (context or sequence parallelism,
    # ``_plan.sequence``): its non-data-parallel degrees; none by default
    split: ParallelDims = field(default_factory=ParallelDims)
    # the second pass of plan_training, after no setup fit with its margin (sequence splits
    # included): the search may then take a setup that fits at the centre (``tight``)
    allow_tight: bool = False

    # -- derived ------------------------------------------------------------------------------
    @property
    def probed(self) -> bool:
        return self.device is None

    @cached_property
    def dev(self) -> DeviceInfo:
        return probe_device() if self.probed else resolve_device(self.device)

    @property
    def ranks(self) -> int:
        return self.num_gpus if is_positive_int(self.num_gpus) else 1

    @property
    def nodes(self) -> int:
        return self.num_nodes if is_positive_int(self.num_nodes) else 1

    @property
    def trainer_kind(self) -> TrainerKind:
        """The registered trainer the plan is for (``_trainers``)."""
        return TRAINERS.get(self.trainer or TRAINER.name)

    @property
    def sharding_engine(self) -> Engine:
        """The engine that shards when a replica does not fit: the one asked for, else the
        default sharding engine (``Engine.default_sharding``)."""
        if self.engine != "auto":
            return ENGINES.get(engine_stage(self.engine)[0])
        return next(e for e in ENGINES if e.default_sharding)

    @property
    def engine_stage(self) -> tuple[str, ...] | None:
        """The rungs of the sharding stage asked for by name (``engine="zero3-offload"``:
        ``("zero3-offload-opt", "zero3-offload")``), else None."""
        return engine_stage(self.engine)[1]

    @property
    def splits_sequences(self) -> bool:
        """Whether the planner may split sequences over ranks (``Engine.sequence_splits``:
        context parallelism on FSDP2, sequence parallelism on DeepSpeed): several ranks, an
        engine that splits them, a trainer whose step is split (``TrainerKind.sequence_split``),
        no engine or parallelism_config of the user's."""
        return self.ranks > 1 and self.sharding_engine.split_kind is not None and \
            self.trainer_kind.sequence_split and "parallelism_config" not in self.pins and \
            not any(e.selected(self.pins.get) for e in ENGINES)

    @cached_property
    def pinned_dims(self) -> ParallelDims | None:
        """A pinned ``parallelism_config``'s degrees (read once here), else None."""
        pinned = self.pins.get("parallelism_config")
        if not pinned:
            return None
        try:
            return read_dims(pinned)
        except ConfigError:  # said by normalize_args, with the other problems
            return None

    @property
    def dims(self) -> ParallelDims:
        """The run's tensor / context / sequence degrees: a pinned ``parallelism_config``'s,
        else the planner's ``split``."""
        return self.pinned_dims or self.split

    @property
    def data_parallel(self) -> int:
        """Ranks that take different sequences (``ParallelDims``: all of them but for the
        tensor / context / sequence degrees)."""
        return max(1, self.ranks // self.dims.non_data_parallel)

    @property
    def per_rank(self) -> int:
        return self.target_batch_size // self.data_parallel

    @cached_property
    def config_defaults(self) -> dict[str, Any]:
        """Every field of the trainer's installed config class with its default
        (``_setup.fields``), read once."""
        return config_fields(self.trainer_kind.config_type())

    def get(self, name: str) -> Any:
        """A field of the trainer's config as the plan will emit it: the pin, else the
        config's default."""
        return self.pins.get(name, self.config_defaults.get(name))

    @cached_property
    def pins(self) -> dict[str, Any]:
        """The constraints that are fields of the trainer's config; a TRL trainer's
        ``max_length`` is the planned ``seq_len`` unless pinned (it truncates the rows)."""
        fields = self.config_defaults
        out = {k: v for k, v in self.constraints.items() if k in fields}
        if "max_length" in fields and "max_length" not in out and self.seq_len:
            out["max_length"] = self.seq_len
        return out

    @cached_property
    def search(self) -> dict[str, Any]:
        return {k: v for k, v in self.constraints.items() if k not in self.pins}

    def micro_batches(self) -> list[int]:
        """The per-device batches searched: the pinned one, else the divisors of the per-rank
        batch that the trainer accepts (``trainer_batch_problems``)."""
        if "per_device_train_batch_size" in self.pins:
            return [self.pins["per_device_train_batch_size"]]
        if "micro_batch" in self.search:
            return [self.search["micro_batch"]]
        return self._accepted_micro_batches

    @cached_property
    def _accepted_micro_batches(self) -> list[int]:
        return [mb for mb in divisors(self.per_rank) if not self.trainer_batch_problems(mb)]

    def budget(self) -> int:
        return self.budget_of().bytes

    def budget_of(self) -> Budget:
        """The budget and how it was derived: one rule for plans and estimates
        (``_estimate.budget``)."""
        return memory_budget(self.dev, headroom=self.headroom, max_memory=self.max_memory,
                             this_machine=self.probed)

    def host_budget(self) -> int | None:
        """Host RAM per node that offload may use: ``host_memory``; planning for this machine,
        its RAM; for a catalog GPU, what a typical host of that card holds
        (``typical_host_memory``)."""
        if self.host_memory is not None:
            return parse_bytes(self.host_memory)
        if self.probed:
            return host_ram()
        return typical_host_memory(self.dev, self.ranks // self.nodes)

    def host_basis(self) -> str:
        """Where ``host_budget`` comes from, for a person."""
        if self.host_memory is not None:
            return "host_memory"
        if self.probed:
            return "this machine's RAM"
        return (f"assumed for a typical host of {self.ranks // self.nodes} x {self.dev.name}: "
                f"{HOST_PER_GPU_MEMORY:g} x its GPUs' memory; pass host_memory= for yours")

    # -- validation ---------------------------------------------------------------------------
    def problems(self) -> list[Problem]:
        out = self._value_problems() + self._choice_problems()
        if not any(p.field in ("num_gpus", "num_nodes") for p in out):
            out += self._rank_problems()
        out += self._batch_problems()
        if not any(p.field in BATCH_FIELDS for p in out):
            out += self._searched_batch_problems()
        return out

    def raise_problems(self, source: str = "plan_training") -> None:
        problems = self.problems()
        if problems:
            raise ConfigError([p.message for p in problems], source=source)

    def _value_problems(self) -> list[Problem]:
        out = []
        for name in ("seq_len", "target_batch_size"):
            v = getattr(self, name)
            if not (self.partial and v is None) and not is_positive_int(v):
                out.append(Problem(name, f"{name} must be a positive integer, got {v!r}"))
        out += self._size_problems()
        if headroom_problem(self.headroom):
            out.append(Problem("headroom", headroom_problem(self.headroom)))
        if max_memory_problem(self.max_memory):
            out.append(Problem("max_memory", max_memory_problem(self.max_memory)))
        if self.host_memory is not None:
            try:
                parse_bytes(self.host_memory)
            except HfMemkitError as exc:
                out.append(Problem("host_memory", f"host_memory: {exc}"))
        for name in ("num_gpus", "num_nodes"):
            v = getattr(self, name)
            if v is not None and not is_positive_int(v):
                out.append(Problem(name, f"{name} must be a positive integer, got {v!r}"))
        if self.cuda_version is not None:
            try:
                parse_cuda_version(self.cuda_version)
            except ConfigError as exc:
                out.append(Problem("cuda_version", exc.problems[0]))
        out += self._pin_problems()
        for k in self.search:
            if k not in SEARCH_CONSTRAINTS:
                out.append(Problem(k, f"unknown constraint `{k}`: give TrainingArguments fields "
                                      "or micro_batch"))
        return out

    def _size_problems(self) -> list[Problem]:
        """Sizes above what any run uses, refused before a trace (a target batch of 10**9 made
        the search enumerate its divisors for minutes)."""
        out = []
        if is_positive_int(self.seq_len) and self.seq_len > MAX_TOKENS:
            out.append(Problem("seq_len", f"seq_len must be at most {MAX_TOKENS} tokens (2**24), "
                                          f"got {self.seq_len}"))
        for name, v in (("target_batch_size", self.target_batch_size),
                        ("micro_batch", self.search.get("micro_batch"))):
            if is_positive_int(v) and v > MAX_BATCH:
                out.append(Problem(name, f"{name} must be at most {MAX_BATCH} samples (2**20; "
                                         f"the largest published batches are 65,536), got {v}"))
            elif name == "micro_batch" and v is not None and not is_positive_int(v):
                out.append(Problem(name, f"micro_batch must be a positive integer, got "
                                         f"{quoted(v)}"))
        for name in ("num_gpus", "num_nodes"):
            v = getattr(self, name)
            if is_positive_int(v) and v > MAX_RANKS:
                out.append(Problem(name, f"{name} must be at most {MAX_RANKS} (2**17, more GPUs "
                                         f"than the largest training clusters hold), got {v}"))
        return out

    def _pin_problems(self) -> list[Problem]:
        """Pins by their field's type and range, as Python values: ``bf16="False"`` is refused
        (transformers reads it as true), as in an ``estimate_memory`` dict (``_setup.fields``)."""
        kind = self.trainer_kind
        cls = kind.config_type()
        out = []
        for k, v in self.pins.items():
            try:
                check_field(k, v, cls=cls, text=False)
            except HfMemkitError as exc:
                out.append(Problem(k, str(exc)))
        if out or self.partial:  # a recipe's pins: normalize_args (check_pins) says it
            return out
        # what the trainer refuses when it is built, as the plan would emit it
        why = "" if "max_length" in self.constraints or "max_length" not in \
            self.config_defaults else " (a plan's max_length is its seq_len unless pinned)"
        options = self.trainer_options
        target = self.target_batch_size if is_positive_int(self.target_batch_size) else None
        return [Problem(self._field_of(m), m + why) for m in kind.config_problems(options)] + [
            Problem("target_batch_size", m) for m in (
                kind.target_problems(options, target, self.ranks) if target else [])]

    def _field_of(self, message: str) -> str:
        """The config field a trainer's problem is about: the one it starts with (```name`
        must be ...``, ``name=value ...``, ``name (value) ...``), else the trainer itself
        (``TRAINER_KEY``, the request's ``trainer``)."""
        name = re.match(r"`?(\w*)", message).group(1)  # type: ignore[union-attr]
        return name if name in self.config_defaults else TRAINER_KEY

    @cached_property
    def trainer_options(self) -> dict[str, Any]:
        """The trainer's options (``TrainerKind.read``) as the plan would emit its config:
        planned from lengths, padding-free rows take max_length=None unless it is pinned; a
        field its config's ``__post_init__`` derives (``TrainerKind.derived``) is None unless
        pinned, as in a dict given to ``estimate_memory``."""
        kind = self.trainer_kind
        free = self.lengths is not None and "max_length" not in self.constraints

        def get(name: str) -> Any:
            if (free and name == "max_length") or (name in kind.derived and
                                                   name not in self.pins):
                return None
            v = self.get(name)
            return getattr(v, "value", v)  # enums -> str, as normalize_args reads them

        return dict(kind.read(get))

    def trainer_batch_problems(self, micro_batch: int) -> list[str]:
        """What the trainer refuses of ``micro_batch`` rows per device completing the per-rank
        batch (``TrainerKind.batch_problems``: TRL's whole generation groups)."""
        return list(self.trainer_kind.batch_problems(
            self.trainer_options, micro_batch, self.per_rank // micro_batch, self.ranks))

    def _choice_problems(self) -> list[Problem]:
        out = []
        if self.method not in method_choices():
            out.append(_choice_problem("method", self.method, method_choices()))
        else:
            wanted = [m for m in METHODS if self.method in m.selected_by]
            if self.method != "auto" and not any(m.available() for m in wanted):
                out.append(Problem("method", f"method `{self.method}` {wanted[0].missing()}"))
        if self.engine not in engine_choices():
            out.append(_choice_problem("engine", self.engine, engine_choices()))
        if not self.partial:
            out += [Problem(i.field, i.message) for i in self.precision_issues() if i.refused]
        return out

    def precision_issues(self) -> list[PrecisionIssue]:
        """What the device makes of the pinned precision (``_device.precision``: the rule
        estimates and recipes share); the planner never picks a precision with an issue."""
        return precision_issues(self.dev, bf16=self.pins.get("bf16") is True,
                                fp16=self.pins.get("fp16") is True,
                                tf32=self.pins.get("tf32") is True)

    def data_parallel_warning(self) -> str | None:
        """A one-process plan on a machine whose process sees several GPUs, outside torchrun:
        transformers then sets ``n_gpu`` to the device count and wraps the model in
        ``nn.DataParallel`` (the batch split over the GPUs, outputs gathered on GPU 0), which
        no plan models."""
        dev = self.dev
        if not (self.probed and dev.kind == "cuda" and dev.count > 1 and self.ranks == 1
                and int(os.environ.get("WORLD_SIZE", "1") or 1) <= 1):
            return None
        return (f"this process sees {dev.count} GPUs and was not started by torchrun: "
                "transformers' Trainer would wrap the model in nn.DataParallel (the batch split "
                "over the GPUs, outputs gathered on GPU 0), which this one-GPU plan does not "
                f"model. Train on one GPU with CUDA_VISIBLE_DEVICES=0 (`hf-memkit train` pins "
                f"one itself), or on all of them with num_gpus={dev.count} and torchrun "
                f"--nproc-per-node {dev.count}")

    def _rank_problems(self) -> list[Problem]:
        ranks, nodes = self.ranks, self.nodes
        if ranks % nodes:
            return [Problem("num_nodes", f"num_gpus={ranks} is not a multiple of num_nodes="
                                         f"{nodes}; give the total GPU count over all nodes")]
        if self.partial:
            return []
        per_node, dev = ranks // nodes, self.dev
        if unplannable(dev):
            return [Problem("device", unplannable(dev))]
        if self.probed and ranks > 1 and dev.kind != "cuda":
            return [Problem("num_gpus", f"num_gpus={ranks} but this machine has no CUDA GPU "
                                        f"({dev.name}); plan for a catalog GPU with "
                                        "device='H100-80GB' (see list_devices())")]
        if self.probed and dev.kind == "cuda" and per_node > dev.count:
            return [Problem("num_gpus", f"num_gpus={ranks} but this machine shows {dev.count} "
                                        f"GPU(s) ({per_node} needed per node over {nodes} "
                                        f"node(s)); use num_gpus<={dev.count * nodes} or more "
                                        "nodes")]
        if not self.probed and dev.kind == "cuda" and per_node > MAX_GPUS_PER_NODE:
            return [Problem("num_nodes", f"num_gpus={ranks} on {nodes} node(s) is {per_node} "
                                         f"{dev.name} per node; a node holds at most "
                                         f"{MAX_GPUS_PER_NODE}: set num_nodes="
                                         f"{-(-ranks // MAX_GPUS_PER_NODE)}")]
        return []

    def _batch_problems(self) -> list[Problem]:
        """The target-batch rule: ranks divide the target, the micro-batch divides the per-rank
        batch, and a pinned accumulation completes it exactly."""
        target, ranks = self.target_batch_size, self.data_parallel
        if not is_positive_int(target):
            return []
        if target % ranks and not (ranks % target == 0 and self.splits_sequences):
            lo = target - target % ranks
            valid = [v for v in (lo, lo + ranks) if v > 0]
            dp = "" if ranks == self.ranks else " data-parallel"
            return [Problem("target_batch_size",
                            f"target_batch_size {target} is not divisible by {ranks}{dp} ranks; "
                            f"nearest valid targets: "
                            f"{', '.join(map(str, valid))}")]
        return self._micro_batch_problems(self.per_rank)

    def _micro_batch_problems(self, per_rank: int) -> list[Problem]:
        pinned = "per_device_train_batch_size" in self.pins
        mb = self.pins.get("per_device_train_batch_size", self.search.get("micro_batch"))
        if not is_positive_int(mb):
            return []
        key = "per_device_train_batch_size" if pinned else "micro_batch"
        gpus = f"target_batch_size {self.target_batch_size} / {self.ranks} GPU(s)"
        if per_rank % mb:
            return [Problem(key, f"micro-batch {mb} does not divide the per-GPU batch {per_rank}"
                                 f" ({gpus}); divisors: "
                                 f"{', '.join(map(str, divisors(per_rank)))}")]
        accum = self.pins.get("gradient_accumulation_steps")
        if is_positive_int(accum) and mb * accum != per_rank:
            return [Problem("gradient_accumulation_steps",
                            f"micro-batch {mb} x accumulation {accum} x {self.ranks} GPU(s) = "
                            f"{mb * accum * self.ranks}, not target_batch_size "
                            f"{self.target_batch_size}; drop the accumulation pin (the plan "
                            f"derives it) or set it to {per_rank // mb}")]
        return [Problem(key, m) for m in self.trainer_batch_problems(mb)]

    def _searched_batch_problems(self) -> list[Problem]:
        """Where the planner searches the per-device batch and the trainer refuses every one
        dividing the per-rank batch: what it refuses of all of them (a pin of its own), else
        of the largest."""
        if self.partial or any(k in self.pins or k in self.search for k in (
                "per_device_train_batch_size", "micro_batch")):
            return []
        per_rank = self.per_rank
        refused = [self.trainer_batch_problems(mb) for mb in divisors(per_rank)]
        if not refused or not all(refused):
            return []
        common = [m for m in refused[-1] if all(m in r for r in refused)]
        head = (f"no per_device_train_batch_size dividing the per-GPU batch {per_rank} "
                f"(target_batch_size {self.target_batch_size} / {self.ranks} GPU(s)) is "
                f"accepted by {self.trainer_kind.title}'s config; at {per_rank}: ")
        return [Problem(self._field_of(m), m) for m in common] or \
            [Problem("target_batch_size", head + m) for m in refused[-1]]


# Host RAM a typical training machine has per GPU, as a multiple of the GPU's memory: the sizing
# rule system builders publish ("at least twice the total VRAM", Puget Systems' hardware
# recommendations for ML/AI workstations); NVIDIA's DGX A100 has 1 TiB for 8 x 80 GB (1.6x), the
# DGX H100 2 TiB for 8 x 80 GB (3.2x). A plan for a catalog GPU never asks offload for more.
HOST_PER_GPU_MEMORY = 2.0


def typical_host_memory(dev: Any, gpus_per_node: int) -> int:
    """The host RAM per node assumed for a catalog GPU with no ``host_memory`` given."""
    return int(HOST_PER_GPU_MEMORY * dev.total_memory * max(1, gpus_per_node))


def host_ram() -> int | None:
    """This machine's RAM (``MemTotal``), or None where /proc is missing."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
