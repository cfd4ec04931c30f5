"""The engine registry: how one rank holds the model states, one ``Engine`` per file.

Data flow: ``TrainingArguments`` fields (``fsdp``/``fsdp_config``, ``deepspeed``,
``accelerator_config``) + ``num_gpus`` -> the engine whose arguments are set reads them into a
``Sharding`` (``Engine.from_args``) -> ``Engine.rank_states`` (what one rank holds: sharded
states, gathered layers, buckets, what lives on the host) -> the estimator adds the replicated
activations per phase. For the planner an engine offers ``Rung``s (strategies), emits the
TrainingArguments that select a rung, prices its communication, checks what it emitted, and
says in which dtype each rank computes (``traces_half``).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from .._errors import HfMemkitError, excerpt, quoted, read_json_file
from .._registry import Registry
from .dims import ParallelDims


@dataclass(frozen=True)
class Sharding:
    """How one rank holds the model states. ``engine``: none | ddp | fsdp | deepspeed.

    ``stage``: FSDP 3 = full shard (reshard after forward), 2 = shard-grad-op; DeepSpeed ZeRO
    stage 0-3. Bucket sizes are in elements (DeepSpeed's unit); 0 = not used.
    """

    engine: str = "none"
    world_size: int = 1
    stage: int = 0
    offload_params: bool = False
    offload_optimizer: bool = False
    mixed_precision: bool = False        # FSDP: param/reduce dtype 16-bit
    grad_as_bucket_view: bool = False    # DDP
    sync_each_batch: bool = False        # FSDP + accumulation: reduce-scatter every micro-step
    activation_checkpointing: bool = False  # FSDP's own (fsdp_config), instead of the Trainer's
    reduce_bucket: int = 0               # DeepSpeed reduce_bucket_size
    allgather_bucket: int = 0            # DeepSpeed allgather_bucket_size (ZeRO-1/2)
    prefetch_bucket: int = 0             # DeepSpeed stage3_prefetch_bucket_size
    max_live: int = 0                    # DeepSpeed stage3_max_live_parameters
    sub_group: int = 0                   # DeepSpeed sub_group_size (ZeRO-3 steps one at a time)
    fsdp_version: int = 2                # fsdp_config's version (1: FlatParameter FSDP)
    overlap_comm: bool = False           # DeepSpeed ZeRO-1/2 overlap_comm: two reduce buffers
    grad_accum_itemsize: int = 0         # DeepSpeed data_types.grad_accum_dtype (0: the model's)
    replicas: int = 1                    # HSDP: replicas of the sharded group (dp_replicate)

    def label(self) -> str:
        return ENGINES.get(self.engine).label(self)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class RankStates:
    """Bytes on one rank. ``weights``/``gradients``/``optimizer`` are resident (sharded where
    the engine shards); the rest are per-phase transients and host-side bytes."""

    weights: int
    gradients: int
    optimizer: int
    optimizer_transient: int
    gathered_forward: int = 0      # unsharded parameters alive at the forward peak
    gathered_backward: int = 0     # ... at the backward peak
    grad_buffers: int = 0          # unsharded gradients + reduce-scatter input of one layer
    accum_gradients: int | None = None  # gradients held between micro-steps (None: = gradients)
    buckets: int = 0               # persistent communication buffers (DDP buckets, DS buckets)
    host: int = 0                  # bytes moved to CPU memory by offload
    resident_gradients: bool = False  # the gradient shards are one buffer allocated at start
    notes: list[str] = field(default_factory=list)

    @property
    def model_states(self) -> int:
        """Resident weights + gradients + optimizer state (DeepSpeed ZeRO-3: with its two
        gathered copies of the largest module, as DeepSpeed's estimator counts them)."""
        return self.weights + self.gradients + self.optimizer


@dataclass(frozen=True)
class StateSizes:
    """What ``Engine.rank_states`` shares out: the unsharded model states of one replica."""

    weight_bytes: int            # weights (trainable ones in the master dtype, the rest in the
    #                              load dtype; incl. buffers and quant constants)
    grad_bytes: int
    n_trainable: int
    optimizer_state: int
    optimizer_transient: int
    load_itemsize: int
    # parts of weight_bytes a sharding engine may treat apart (``ModelSpec.weight_parts``)
    buffers: int = 0             # registered buffers
    packed_4bit: int = 0         # NF4 weights of a 4-bit base (2 per byte)
    quant_constants: int = 0     # their absmax blocks: the quant_state, not a parameter
    storage_floating: bool = False  # bnb_4bit_quant_storage is a float dtype (shardable)
    upcast: int = 0              # trainable elements held in fp32 instead of their load dtype
    # the optimizer's step temporaries on the one flat tensor the engine steps at a time
    # (``Engine.stepped_elements``; 0 where it steps the parameters themselves)
    flat_transient: int = 0


@dataclass(frozen=True)
class ReferenceSizes:
    """A frozen reference model (DPO's copy of the policy) as the trainer loads it."""

    weight_bytes: int            # in its load dtype, buffers included
    n_params: int                # elements (parameters and buffers)
    load_itemsize: int
    numels: tuple[int, ...] = ()  # each parameter's elements (ZeRO-3 persistence)
    hidden: int = 0              # the model's hidden size (TRL sizes ZeRO-3 buckets by it)


@dataclass(frozen=True)
class Rung:
    """One data-parallel strategy the planner can pick (``Candidate.parallel``)."""

    name: str
    label: str
    engine: str
    stage: int = 0
    offload_params: bool = False
    offload_optimizer: bool = False
    shards_params: bool = False           # frozen weights shard too (a LoRA base)
    shards_4bit: bool = False             # a 4-bit base (float quant storage) shards too
    precisions: tuple[str, ...] | None = None  # None: any precision
    replica: bool = False                 # every rank holds a full replica (DDP)
    # the run's degrees where each sequence is split over ranks (context / sequence
    # parallelism, ``split``); otherwise every rank is a data-parallel rank
    dims: ParallelDims = ParallelDims()

    @property
    def offload(self) -> bool:
        return self.offload_params or self.offload_optimizer

    def split(self, dims: ParallelDims) -> Rung:
        """This rung with each sequence split over ranks as ``dims`` says; its name and label
        carry the split (``ParallelDims.split_tag``)."""
        return dataclasses.replace(self, name=f"{self.name}+{dims.split_tag}",
                                   label=f"{self.label} + {dims.split_label}", dims=dims)

    @property
    def tier(self) -> int:
        """Offload is the last rung; DDP and sharding are ranked together by the cost model."""
        return 1 if self.offload else 0


@dataclass(frozen=True)
class EmitContext:
    """What an engine needs to write the TrainingArguments of a rung. ``dims``: the degrees the
    run launches with (the rung's over the ranks: ``ParallelDims.over``); the batch fields read
    the data-parallel degree from it."""

    ranks: int
    micro_batch: int
    grad_accum: int
    precision: str
    checkpointing: bool
    hidden: int
    layer_class: str | None
    max_grad_norm: float
    dims: ParallelDims


class Engine:
    """Base of the registered engines; each file overrides what its engine does."""

    name = "none"
    user_facing = True      # a value of plan_training(engine=...) and the CLI's --engine
    sharded = False         # shards model states (needs the model's layer structure)
    replicates = False      # a full replica per rank: the planner's first multi-GPU rung
    default_sharding = False  # the sharding engine of plan_training(engine="auto")
    owns_checkpointing = False  # checkpointing goes in the engine's config, not the Trainer's
    launch_flag = ""        # `accelerate launch` flag
    config_file: str | None = None  # the config file `launch_commands` names (DeepSpeed's)
    fields: tuple[str, ...] = ()    # the TrainingArguments fields it reads (field coverage)
    holds_masters = False   # its (sharded) parameters are the optimizer's fp32 masters: the
    #                         trainable weights and gradients take ``master_itemsize`` too
    # the engine's sharding strategies by the names its own library gives them ("zero3",
    # "fsdp-full-shard") -> the names of its rungs that run them: plan_training(engine=name)
    # plans those rungs alone ("zero3": its offload rungs included; "zero3-offload": those alone)
    stages: dict[str, tuple[str, ...]] = {}

    def selected(self, get) -> bool:
        """Whether TrainingArguments (``get(field)``) ask for this engine."""
        return False

    def from_args(self, get, world: int) -> Sharding:
        raise NotImplementedError

    def label(self, sh: Sharding) -> str:
        raise NotImplementedError

    def rungs(self) -> list[Rung]:
        return []

    def notes(self, sh: Sharding, device_kind: str) -> list[str]:
        """What an estimate of one rank says about the engine on a ``device_kind`` target."""
        return [f"per rank of {sh.label()}"]

    def launch_flags(self, config_file: str | None) -> str:
        """The engine's ``accelerate launch`` flags."""
        return self.launch_flag

    def rank_states(self, sh: Sharding, sizes: StateSizes, facts: Any,
                    device_kind: str) -> RankStates:
        raise NotImplementedError

    def master_itemsize(self, sh: Sharding, itemsize: int, quantized_4bit: bool) -> int:
        """Bytes per element of a trainable parameter of ``itemsize`` as the optimizer steps it
        (the optimizer's state follows its dtype); ``quantized_4bit``: the base is 4-bit."""
        return itemsize

    def stepped_elements(self, sh: Sharding, n_trainable: int, facts: Any) -> int:
        """The elements of the one flat fp32 tensor the optimizer steps at a time where the
        engine hands it flat partitions instead of the model's parameters (DeepSpeed ZeRO-3's
        sub-groups); 0: it steps the parameters themselves. The estimator prices the
        optimizer's temporaries on that tensor (``StateSizes.flat_transient``)."""
        return 0

    def reference_share(self, sh: Sharding, ref: ReferenceSizes, facts: Any) -> tuple[int, int]:
        """(bytes one rank holds of a trainer's frozen reference model through the step, bytes
        its forward gathers on top): a replica on every rank by default."""
        return ref.weight_bytes, 0

    def grads_sharded(self, sh: Sharding) -> bool:
        """Gradients are reduce-scattered layer by layer during the backward."""
        return False

    def traces_half(self, sh: Sharding) -> bool:
        """Each rank computes with a 16-bit model and no autocast (under mixed precision)."""
        return False

    def emit(self, rung: Rung, ctx: EmitContext) -> dict[str, Any]:
        return {}

    def check_emitted(self, ta: dict[str, Any], sh: Sharding, dims: ParallelDims,
                      notes: list[str]) -> None:
        """Validate what ``emit`` wrote (``dims``: the degrees the run launches with) and add
        the plan's notes about it."""

    def accelerator_plugin(self, ta: dict[str, Any]) -> dict[str, Any]:
        return {}

    def comm_bytes_per_step(self, sh: Sharding, *, n_params: int, n_trainable: int,
                            grad_accum: int, mixed_precision: bool) -> float:
        return 0.0

    def step_overhead(self, sh: Sharding, *, layers: int, n_params: int, itemsize: int,
                      bandwidth: float) -> float:
        """Seconds per micro-step the engine adds to compute (collective launches, copies)."""
        return 0.0

    def optimizer_shards(self, sh: Sharding) -> int:
        """Ranks that share one optimizer step."""
        return 1

    # -- what libraries built on it do differently ---------------------------------------------
    def zero3_enabled(self, sh: Sharding) -> bool:
        """What transformers' ``is_deepspeed_zero3_enabled()`` says under ``sh``: the model is
        partitioned as it loads (``zero.Init``). TRL branches on it: a PEFT model's adapters
        keep the base's dtype, and generation gathers the whole model at once."""
        return False

    def resident_at_init_fraction(self, sh: Sharding) -> float:
        """The fraction of the model's weights on this rank's device while a trainer's
        ``__init__`` runs, before ``accelerator.prepare`` (where TRL builds a colocated vLLM):
        the whole model here, since the Trainer moves it to the device in its ``__init__``
        (transformers ``trainer.py``: ``Trainer.__init__``, ``place_model_on_device``)."""
        return 1.0

    def parallel_notes(self, sh: Sharding, dims: ParallelDims) -> list[str]:
        """What an estimate says of the engine composed with ``dims``' tensor, context or
        sequence degrees."""
        return []

    # -- each sequence split over ranks (the planner's context / sequence parallelism) ---------
    split_kind: str | None = None   # the parallelism that splits sequences on it, in words

    def sequence_splits(self, degree: int, heads: Callable[[], int]) -> list[ParallelDims]:
        """The splits of each sequence over ``degree`` ranks it runs, in the order the planner
        tries them (``heads()``: the model's attention heads)."""
        return []

    def split_rungs(self) -> list[Rung]:
        """The rungs that run with a split (each takes it through ``Rung.split``)."""
        return []

    def split_note(self, dims: ParallelDims, ranks: int) -> str:
        """What a plan of ``ranks`` ranks says of the split ``dims``."""
        return ""

    def split_args(self, dims: ParallelDims) -> dict[str, Any]:
        """The TrainingArguments fields that run this engine with each sequence split as
        ``dims`` says (the reverse queries' longest sequence over several ranks)."""
        return {}

    # -- accelerate's config file and the engine's own ------------------------------------------
    accelerate_type: str | None = None  # accelerate's distributed_type (None: by the ranks)

    def accelerate_section(self, ta: dict[str, Any]) -> dict[str, Any]:
        """The engine's keys of ``accelerate config``'s YAML, from the plan's arguments."""
        return {}

    def config_of(self, ta: dict[str, Any]) -> dict[str, Any] | None:
        """The content of the file ``launch_commands`` names (``config_file``), from the plan's
        TrainingArguments; None where the engine has none."""
        return None


ENGINES: Registry[Engine] = Registry("engine")


def register(engine: Engine) -> Engine:
    return ENGINES.register(engine)


def engine_choices() -> list[str]:
    """The values of ``plan_training(engine=...)``, the CLI's ``--engine`` and recipes: each
    engine's name, then its stages by name (``Engine.stages``)."""
    return ["auto", *(n for e in ENGINES if e.user_facing for n in (e.name, *e.stages))]


def engine_stage(name: str) -> tuple[str, tuple[str, ...] | None]:
    """The engine and the rungs an ``engine=`` value names: ``("deepspeed", ("zero3",
    "zero3-offload-opt", "zero3-offload"))`` for ``"zero3"``, ``("fsdp", None)`` (every rung)
    for ``"fsdp"``."""
    for e in ENGINES:
        if name in e.stages:
            return e.name, e.stages[name]
    return name, None


def all_rungs() -> dict[str, Rung]:
    return {r.name: r for e in ENGINES for r in e.rungs()}


# ----------------------------------------------------------------------------------------------
# helpers the entries share
# ----------------------------------------------------------------------------------------------


def ceil_div(x: int, n: int) -> int:
    return -(-int(x) // n)


JSON_CAP = 2**20  # bytes of a DeepSpeed / FSDP config file (a few dozen keys)


def load_json(value: Any, what: str) -> dict[str, Any]:
    """``deepspeed`` / ``fsdp_config``: a dict, or the path of a JSON file holding one object
    (a regular UTF-8 file of at most ``JSON_CAP`` bytes); ``HfMemkitError`` naming the file and
    what is wrong with it otherwise."""
    if value is None or value == "":
        return {}
    if isinstance(value, dict):
        return dict(value)
    if not (isinstance(value, (str, os.PathLike)) and os.path.exists(value)):
        raise HfMemkitError(f"{what} must be a dict or the path of a JSON file; got "
                            f"{quoted(value)}")
    fix = f"give {what} a dict, or the path of a JSON file holding one object"
    out = read_json_file(value, name=f"{what}={excerpt(value)}", what=f"a JSON file for {what}",
                         cap=JSON_CAP, fix=fix)
    if not isinstance(out, dict):
        raise HfMemkitError(f"{what}={excerpt(value)} holds a JSON {type(out).__name__}, not an "
                            f"object; {fix}")
    return out


def offload_suffix(sh: Sharding) -> str:
    off = [k for k, on in (("params", sh.offload_params), ("optimizer", sh.offload_optimizer))
           if on]
    return f" + CPU offload ({', '.join(off)})" if off else ""


def truthy(v: Any) -> bool:
    return str(v).strip().lower() in ("1", "true", "yes", "on")


# Launch latency of one NCCL collective (order of tens of microseconds on NVLink; NCCL tests),
# paid per FSDP / ZeRO-3 unit and pass.
COLLECTIVE_LATENCY_S = 50e-6


def gather_scatter_bytes(sh: Sharding, *, n_params: int, n_trainable: int, grad_accum: int,
                         mixed_precision: bool) -> float:
    """Full shard / ZeRO-3: all-gather of the parameters in forward and again in backward,
    reduce-scatter of the gradients, per micro-step (ring: (N-1)/N of the payload each);
    shard-grad-op gathers once."""
    ring = (sh.world_size - 1) / sh.world_size
    b = 2 if mixed_precision else 4
    gathers = 2 if sh.stage == 3 else 1
    return (gathers * ring * n_params * b + ring * n_trainable * b) * max(1, grad_accum)


def gather_overhead(sh: Sharding, *, layers: int, n_params: int, itemsize: int,
                    bandwidth: float) -> float:
    """Per micro-step: a collective per unit and pass (launch latency), and copying the
    gathered parameters out of (and the gradients into) the flat collective buffers."""
    passes = 3 if sh.stage == 3 else 2
    return passes * (layers + 2) * COLLECTIVE_LATENCY_S + passes * n_params * itemsize / bandwidth


def sync_each_batch(get) -> bool:
    acc = get("accelerator_config") or {}
    if not isinstance(acc, dict):
        acc = getattr(acc, "to_dict", lambda: {})()
    return bool((acc.get("gradient_accumulation_kwargs") or {}).get("sync_each_batch"))
