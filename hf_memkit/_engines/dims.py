"""The parallel dimensions of a run as one value: data-parallel replicate and shard, tensor,
context and sequence parallelism (accelerate's ``ParallelismConfig``, after torchtitan's
``ParallelDims``).

DDP, FSDP2, HSDP and ZeRO are points of this space: ``dp_replicate`` ranks hold replicas,
``dp_shard`` (x ``cp``: accelerate's ``dp_shard_cp`` mesh) ranks shard one replica's states, and
the non-data-parallel dimensions (``tp``, ``cp``, ``sp``) see the same batch. Derived sizes
follow accelerate 1.15 ``parallelism_config.py``: ``data_parallel_size`` (the batch rule's
degree), ``non_data_parallel_size`` and ``total_size``; ``sequence_divisor`` is what one
sequence is split (and padded) by.

The rules (accelerate 1.15 ``ParallelismConfig.__post_init__`` / ``_validate_accelerator``):
``total_size`` equals the processes (DeepSpeed's SP overlays DP: the processes are a multiple of
``sp``); CP and SP are mutually exclusive; TP or CP do not combine with replicate-only DP; FSDP
needs ``dp_shard > 1`` or ``cp > 1``; CP runs on FSDP2 (torch ring attention), SP on DeepSpeed
(ALST / Ulysses).
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass
from typing import Any

from .._errors import ConfigError, quoted
from .._units import divisors

DIMS = ("dp_replicate", "dp_shard", "tp", "cp", "sp")
CP_STRATEGIES = ("allgather", "alltoall")   # accelerate TorchContextParallelConfig
# ParallelismConfig's fields this reads; the rest (handlers' other options, backends) are fixed
FIELDS = tuple(f"{d}_size" for d in DIMS) + ("cp_backend", "sp_backend", "cp_handler",
                                               "sp_handler", "tp_handler")


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of one run; ``cp_comm``: torch ring attention's rotate method."""

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    cp: int = 1
    sp: int = 1
    cp_comm: str = "allgather"

    @property
    def total(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp * self.cp * self.sp

    @property
    def data_parallel(self) -> int:
        """Ranks that take different batches (the batch rule's degree)."""
        return self.dp_replicate * self.dp_shard

    @property
    def non_data_parallel(self) -> int:
        return self.tp * self.cp * self.sp

    @property
    def shard_group(self) -> int:
        """Ranks FSDP shards one replica over (accelerate's ``dp_shard_cp`` mesh)."""
        return self.dp_shard * self.cp

    @property
    def sequence_divisor(self) -> int:
        """What one sequence is padded to a multiple of: ``2 x cp`` for the ring attention's
        head-tail load balancing, ``sp`` for Ulysses, 1 otherwise."""
        return 2 * self.cp if self.cp > 1 else self.sp

    @property
    def splits_sequence(self) -> int:
        """Ranks one sequence is split across (cp or sp)."""
        return self.cp * self.sp

    @property
    def plain(self) -> bool:
        """No tensor, context or sequence parallelism (DDP, FSDP, ZeRO as before)."""
        return self.non_data_parallel == 1

    def rank_seq(self, seq_len: int) -> int:
        """Tokens of one sequence on one rank, after padding to ``sequence_divisor``."""
        n = self.splits_sequence
        if n == 1:
            return seq_len
        div = self.sequence_divisor
        return -(-seq_len // div) * div // n

    def over(self, processes: int) -> ParallelDims:
        """These tensor / context / sequence degrees launched on ``processes`` ranks: the rest
        are data-parallel (sharding) ranks."""
        return dataclasses.replace(self, dp_replicate=1,
                                   dp_shard=max(1, processes // self.non_data_parallel))

    @property
    def split_tag(self) -> str:
        """The sequence split in a rung's name (``cp8``, ``cp8-alltoall``, ``sp4``); "" for
        none. ``from_split_tag`` reads it back."""
        if self.cp > 1:
            return f"cp{self.cp}" + ("" if self.cp_comm == CP_STRATEGIES[0] else f"-{self.cp_comm}")
        return f"sp{self.sp}" if self.sp > 1 else ""

    @property
    def split_label(self) -> str:
        """The sequence split as a plan's label shows it ("CP x8 (allgather)")."""
        if self.cp > 1:
            return f"CP x{self.cp} ({self.cp_comm})"
        return f"SP x{self.sp} (Ulysses)" if self.sp > 1 else ""

    @classmethod
    def from_split_tag(cls, tag: str) -> ParallelDims:
        """Inverse of ``split_tag`` ("" -> no split)."""
        if tag.startswith("sp"):
            return cls(sp=int(tag[2:]))
        if tag.startswith("cp"):
            degree, _, comm = tag[2:].partition("-")
            return cls(cp=int(degree), cp_comm=comm or CP_STRATEGIES[0])
        return cls()

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_accelerate(self) -> Any:
        """accelerate's ``ParallelismConfig`` of these degrees (``TrainingArguments``'s
        ``parallelism_config``)."""
        from accelerate.parallelism_config import ParallelismConfig
        from accelerate.utils import TorchContextParallelConfig

        kw = {f"{d}_size": getattr(self, d) for d in DIMS}
        if self.cp > 1:
            kw["cp_handler"] = TorchContextParallelConfig(cp_comm_strategy=self.cp_comm)
        return ParallelismConfig(**kw)


def _degree(name: str, v: Any, problems: list[str]) -> int:
    if v is None:
        return 1
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        problems.append(f"parallelism_config {name}={quoted(v)}: a degree is a positive "
                        "integer (1 = the dimension is off)")
        return 1
    return v


def _as_dict(value: Any) -> dict[str, Any]:
    if isinstance(value, dict):
        return dict(value)
    d = {f: getattr(value, f, None) for f in FIELDS}
    handler = getattr(value, "cp_handler", None)
    d["cp_comm_strategy"] = getattr(handler, "cp_comm_strategy", None)
    return d


def read_dims(value: Any) -> ParallelDims | None:
    """``parallelism_config`` as accelerate's ``ParallelismConfig`` or a dict of its fields
    (``cp_comm_strategy`` may be given flat) -> ``ParallelDims``; None when unset. Every bad
    value in one ``ConfigError``."""
    if value is None or value == {}:
        return None
    if not isinstance(value, dict) and not hasattr(value, "dp_shard_size"):
        raise ConfigError([f"parallelism_config must be accelerate's ParallelismConfig or a dict "
                           f"of its fields ({', '.join(f'{d}_size' for d in DIMS)}), got "
                           f"{type(value).__name__}"], source="parallelism_config")
    d, problems = _as_dict(value), []
    known = set(FIELDS) | {"cp_comm_strategy"}
    for k in d:
        if k not in known:
            problems.append(f"parallelism_config has no field {k!r}; known: "
                            f"{', '.join(sorted(known))}")
    deg = {dim: _degree(f"{dim}_size", d.get(f"{dim}_size"), problems) for dim in DIMS}
    comm = d.get("cp_comm_strategy") or getattr(d.get("cp_handler"), "cp_comm_strategy", None) \
        or "allgather"
    if comm not in CP_STRATEGIES:
        problems.append(f"cp_comm_strategy={quoted(comm)} is not one of "
                        f"{', '.join(CP_STRATEGIES)} (torch ring attention's rotate methods)")
    for backend, allowed in (("cp_backend", "torch"), ("sp_backend", "deepspeed")):
        if d.get(backend) not in (None, allowed):
            problems.append(f"{backend}={quoted(d.get(backend))}: accelerate supports only "
                            f"{allowed!r}")
    if problems:
        raise ConfigError(problems, source="parallelism_config")
    return ParallelDims(**deg, cp_comm=comm)


def dims_problems(dims: ParallelDims, *, processes: int, engine: str) -> list[str]:
    """accelerate's rules for ``dims`` on ``processes`` ranks under ``engine`` (none | ddp |
    fsdp | deepspeed), each naming the rule and the nearest valid degrees."""
    out: list[str] = []
    if dims.cp > 1 and dims.sp > 1:
        out.append(f"cp_size={dims.cp} and sp_size={dims.sp}: context and sequence parallelism "
                   "are mutually exclusive (accelerate); keep one of them")
    if (dims.tp > 1 or dims.cp > 1) and dims.dp_replicate > 1 and dims.dp_shard == 1:
        out.append(f"tp_size={dims.tp} / cp_size={dims.cp} with dp_replicate_size="
                   f"{dims.dp_replicate} and dp_shard_size=1: tensor or context parallelism "
                   "does not combine with replicate-only data parallelism (accelerate); use "
                   f"dp_shard_size={dims.dp_replicate} and dp_replicate_size=1 (FSDP), or "
                   "dp_shard_size > 1 with dp_replicate_size > 1 (HSDP)")
    if dims.sp > 1:
        if processes % dims.sp:
            near = [k for k in divisors(processes) if k > 1]
            out.append(f"sp_size={dims.sp} does not divide the {processes} processes (DeepSpeed "
                       f"overlays SP on data parallelism); use sp_size in {near or [1]}")
    elif dims.total != processes:
        out.append(f"parallelism_config's total size {dims.total} (dp_replicate x dp_shard x tp x "
                   f"cp x sp = {dims.dp_replicate} x {dims.dp_shard} x {dims.tp} x {dims.cp} x "
                   f"{dims.sp}) must equal the number of processes ({processes}); "
                   + _nearest_total(dims, processes))
    out += engine_problems(dims, engine)
    return out


def _nearest_total(dims: ParallelDims, processes: int) -> str:
    other = dims.total // max(1, dims.dp_shard)
    if processes % other == 0:
        return f"with these other degrees use dp_shard_size={processes // other}"
    return (f"choose degrees whose product is {processes}, or num_gpus={dims.total}")


def engine_problems(dims: ParallelDims, engine: str) -> list[str]:
    """What ``engine`` cannot run of ``dims`` (context parallelism needs FSDP2, sequence
    parallelism DeepSpeed, ...)."""
    out = []
    # hf_memkit's own choices (accelerate's ParallelismConfig accepts these layouts, and its
    # Accelerator.prepare applies TP and CP whatever the engine): what is run in practice and
    # what hf_memkit models
    ours = "accelerate accepts the layout, but hf_memkit estimates only "
    if dims.cp > 1 and engine != "fsdp":
        out.append(f"cp_size={dims.cp} without FSDP2: {ours}context parallelism on FSDP2 "
                   "(torch ring attention over the dp_shard_cp mesh, the one accelerate "
                   "documents it with); add fsdp='full_shard' with fsdp_config={'version': 2}")
    if dims.sp > 1 and engine != "deepspeed":
        out.append(f"sp_size={dims.sp}: sequence parallelism (ALST / Ulysses) runs on DeepSpeed "
                   "(accelerate's sp_backend is 'deepspeed'); add a deepspeed config (ZeRO stage "
                   "1-3)")
    if engine == "fsdp" and dims.dp_shard == 1 and dims.cp == 1 and dims.total > 1:
        out.append("FSDP with dp_shard_size=1 and cp_size=1 has no dimension to shard across "
                   "(accelerate refuses it); raise dp_shard_size or launch without the FSDP "
                   "config")
    if dims.tp > 1 and engine == "deepspeed":
        out.append(f"tp_size={dims.tp} under DeepSpeed: {ours}tensor parallelism with FSDP2 or "
                   "alone (ZeRO's partitioning of TP-sharded weights is not modelled); drop the "
                   "deepspeed config or tp_size")
    if dims.dp_replicate > 1 and engine == "deepspeed":
        out.append(f"dp_replicate_size={dims.dp_replicate} under DeepSpeed: {ours}ZeRO over "
                   "every data-parallel rank (DeepSpeed keeps its own data-parallel group and "
                   "does not replicate over accelerate's mesh); use dp_shard_size")
    return out


def all_ones(dims: ParallelDims | None, processes: int) -> bool:
    """A ``parallelism_config`` of all ones on several processes: accelerate makes it plain
    data parallelism. ``build_device_mesh`` builds no mesh (no active dimension), and
    ``ParallelismConfig._validate_accelerator`` accepts it: under DDP it sets
    ``dp_replicate_size`` to the number of processes ("to ensure DDP works"); under FSDP2 and
    DeepSpeed (not ``multi_device``) it returns before any check."""
    return dims is not None and dims.total == 1 and processes > 1


def settled(dims: ParallelDims | None, processes: int, engine: str) -> ParallelDims:
    """The degrees a launch of ``processes`` ranks under ``engine`` runs with: without a
    ``parallelism_config`` every rank is a data-parallel rank (sharding ones for FSDP and ZeRO,
    replicas otherwise); DeepSpeed's SP leaves the processes it does not cover to its data
    parallelism."""
    if dims is None:
        sharding = engine in ("fsdp", "deepspeed")
        return ParallelDims(dp_shard=processes if sharding else 1,
                            dp_replicate=1 if sharding else processes)
    if dims.sp > 1 and dims.total != processes:
        return dataclasses.replace(dims, dp_shard=processes // (dims.sp * dims.tp * dims.cp), dp_replicate=1)
    return dims

