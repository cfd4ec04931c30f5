"""DeepSpeed ZeRO (16-bit training, DeepSpeed's own accounting, as its estimators
``estimate_zero2/3_model_states_mem_needs`` print it).

16-bit parameters (partitioned at stage 3), fp32 master weights, Adam moments and fp32 gradient
partitions / N (ZeRO-2: 18 B per parameter over N with 16-bit parameters whole; ZeRO-3: 18 B / N
plus two gathered copies of the largest module, 4 B x its parameters; gathered parameters beyond
those stay live up to ``stage3_max_live_parameters`` and are counted as a forward/backward
transient). ZeRO-1 partitions only master weights, moments and fp32 gradients (16 B / N) and
keeps 16-bit gradients whole. ``offload_optimizer`` moves master weights, moments and gradient
partitions to the host; ``offload_param`` (stage 3) the 16-bit partitions too. Reduce /
all-gather / prefetch buckets are counted as temporaries. The optimizer steps the fp32 master
partitions, so its state is fp32 whatever dtype the model was loaded in.

A trainer's reference model (TRL's ``prepare_deepspeed``, ``trl/models/utils.py``): under ZeRO-3
it is initialised as a ZeRO-3 engine without an optimizer (``DeepSpeedZeRoOffload``), its
parameters cast to the 16-bit dtype and partitioned over the ranks; TRL sets its
``stage3_param_persistence_threshold`` to 10 x hidden (parameters at most that large stay whole
after their first gather) and its prefetch bucket to 0.9 x hidden^2 elements, and keeps
``offload_param``. Its forward gathers a module at a time plus the prefetch bucket and releases
them after use (``PartitionedParameterCoordinator.release_sub_module``). Under ZeRO-0/1/2 TRL
sets the reference's stage to 0: a whole 16-bit replica on every rank.
"""

from __future__ import annotations

import json
from typing import Any

from .._errors import ConfigError
from . import base
from .base import (
    EmitContext,
    Engine,
    RankStates,
    ReferenceSizes,
    Rung,
    Sharding,
    StateSizes,
    register,
)
from .dims import ParallelDims

# DeepSpeed defaults the planner writes explicitly (HF's "auto" values: hidden^2 and 0.9 hidden^2).
DS_ALLGATHER_BUCKET = int(5e8)
SUB_GROUP = int(1e9)   # DeepSpeedZeroConfig.sub_group_size's default
HALF = ("bf16", "fp16")  # DeepSpeed is planned in 16-bit with fp32 master weights
RUNGS = [Rung("zero2", "ZeRO-2", "deepspeed", 2, precisions=HALF),
         Rung("zero3", "ZeRO-3", "deepspeed", 3, shards_params=True, precisions=HALF),
         Rung("zero3-offload-opt", "ZeRO-3 + optimizer offload", "deepspeed", 3,
              offload_optimizer=True, shards_params=True, precisions=HALF),
         Rung("zero3-offload", "ZeRO-3 + param/optimizer offload", "deepspeed", 3,
              offload_params=True, offload_optimizer=True, shards_params=True, precisions=HALF)]


def _zero_num(z: dict[str, Any], key: str, default: int) -> int:
    v = z.get(key, default)
    return default if v == "auto" else int(float(v))


def _grad_accum_itemsize(cfg: dict[str, Any]) -> int:
    """``data_types.grad_accum_dtype`` in bytes (``DeepSpeedEngine.get_data_types``: the model's
    dtype unless it is set; 0 = the model's)."""
    name = str((cfg.get("data_types") or {}).get("grad_accum_dtype") or "").lower()
    return {"fp32": 4, "float32": 4, "fp16": 2, "bf16": 2, "bfloat16": 2}.get(name, 0)


def _on_host(z: dict[str, Any], key: str) -> bool:
    v = z.get(key) or {}
    return str(v.get("device", "none")).lower() in ("cpu", "nvme")


class DeepSpeed(Engine):
    name = "deepspeed"
    sharded = True
    launch_flag = "--use_deepspeed"
    config_file = "ds_config.json"
    fields = ("deepspeed",)
    # DeepSpeed's ZeRO stages (ZeRO-1: pin a config); "-offload": to the CPU (the optimizer,
    # and the parameters where that is not enough)
    stages = {"zero2": ("zero2",), "zero3": tuple(r.name for r in RUNGS if r.stage == 3),
              "zero3-offload": tuple(r.name for r in RUNGS if r.offload)}
    split_kind = "sequence"     # Ulysses (ALST) over every rank's ZeRO partitions
    accelerate_type = "DEEPSPEED"

    def selected(self, get) -> bool:
        return bool(get("deepspeed"))

    def from_args(self, get, world: int) -> Sharding:
        z = base.load_json(get("deepspeed"), "deepspeed").get("zero_optimization") or {}
        stage = int(z.get("stage", 0))
        return Sharding("deepspeed", world, stage, offload_params=_on_host(z, "offload_param"),
                        offload_optimizer=_on_host(z, "offload_optimizer"),
                        mixed_precision=bool(get("bf16") or get("fp16")),
                        reduce_bucket=_zero_num(z, "reduce_bucket_size", int(5e8)),
                        allgather_bucket=_zero_num(z, "allgather_bucket_size",
                                                   DS_ALLGATHER_BUCKET) if stage in (1, 2) else 0,
                        prefetch_bucket=_zero_num(z, "stage3_prefetch_bucket_size", int(5e7))
                        if stage == 3 else 0,
                        max_live=_zero_num(z, "stage3_max_live_parameters", int(1e9))
                        if stage == 3 else 0,
                        sub_group=_zero_num(z, "sub_group_size", SUB_GROUP) if stage == 3 else 0,
                        # DeepSpeedZeroConfig: overlap_comm defaults on for stage 3 only
                        overlap_comm=base.truthy(z.get("overlap_comm", stage == 3)) and stage < 3,
                        grad_accum_itemsize=_grad_accum_itemsize(base.load_json(
                            get("deepspeed"), "deepspeed")))

    def label(self, sh: Sharding) -> str:
        return f"DeepSpeed ZeRO-{sh.stage} x{sh.world_size}{base.offload_suffix(sh)}"

    def rungs(self) -> list[Rung]:
        return list(RUNGS)

    def launch_flags(self, config_file: str | None) -> str:
        return self.launch_flag + (f" --deepspeed_config_file {config_file}" if config_file
                                   else "")

    def rank_states(self, sh: Sharding, sizes: StateSizes, facts: Any,
                    device_kind: str) -> RankStates:
        n, stage, t = max(1, sh.world_size), sh.stage, sizes.n_trainable
        half = sh.mixed_precision
        p = 2 if half else sizes.load_itemsize
        psi = sizes.weight_bytes // max(1, sizes.load_itemsize)  # elements (incl. buffers)
        # fp32 master partitions: ZeRO-1/2/3 keep them apart from the parameters even in fp32
        # (stage3 _create_fp32_partitions; stage_1_and_2 single_partition_of_fp32_groups)
        master = 4 * t if half or stage >= 1 else 0
        g16 = p * t                                      # gradients in the training dtype
        g32 = 4 * t if half else 0                       # ZeRO-1/2: fp32 gradient partitions
        # ZeRO-3 keeps one flat buffer of gradient partitions in the gradient-accumulation
        # dtype (stage3.py _setup_for_real_optimizer: grad_partitions_flat_buffer, dtype
        # gradient_accumulation_dtype = the model's unless data_types.grad_accum_dtype is set)
        ga = sh.grad_accum_itemsize or p
        params16 = p * psi
        gathered = 2 * facts.module_params * p if stage == 3 else 0
        o_all = sizes.optimizer_state
        if stage == 0:
            w, g, o = params16 + master, g16 + g32, o_all
        elif stage in (1, 2):
            w = params16 + base.ceil_div(master, n)
            g = g16 + base.ceil_div(g32, n) if stage == 1 else base.ceil_div(g16 + g32, n)
            o = base.ceil_div(o_all, n)
        else:
            w = base.ceil_div(params16 + master, n) + gathered
            g, o = base.ceil_div(ga * t, n), base.ceil_div(o_all, n)
        tr = sizes.optimizer_transient
        r = RankStates(w, g, o, base.ceil_div(tr, n) if stage >= 1 else tr)
        largest = _largest_trainable(facts, t)
        group = self.stepped_elements(sh, t, facts)
        if group:
            r.optimizer_transient = _zero3_step_transient(group, ga, sizes.flat_transient)
        # ZeRO-1/2's setup_buckets (stage_1_and_2.py): one reduce buffer of reduce_bucket_size,
        # a second with overlap_comm ("double buffers to avoid data access conflict")
        reduce = sh.reduce_bucket * (2 if sh.overlap_comm else 1)
        r.buckets = (reduce + sh.allgather_bucket + sh.prefetch_bucket) * p
        if stage == 3 and not sh.offload_optimizer:
            # _setup_for_real_optimizer allocates every gradient partition as one flat buffer
            # (grad_partitions_flat_buffer) before the first step: alive in every phase
            r.resident_gradients = True
        if stage == 3:
            # gathered parameters stay resident up to stage3_max_live_parameters before
            # DeepSpeed releases them: beyond the estimator's two copies of the largest module
            # (counted in the model states above), the forward and backward can hold that many
            live = min(sh.max_live or psi, psi) * p
            r.gathered_forward = r.gathered_backward = max(0, live - gathered)
        if sh.offload_optimizer:  # master weights, moments and gradient partitions to the host
            r.host = base.ceil_div(master, n) + o + (base.ceil_div(g16 + g32, n) if stage >= 2
                                                else base.ceil_div(g32, n))
            r.weights = (params16 if stage < 3 else base.ceil_div(params16, n) + gathered)
            r.gradients = g16 if stage == 1 else 0
            r.optimizer = r.optimizer_transient = 0
        if sh.offload_optimizer and stage in (1, 2) and half:
            _offload_grad_copies(r, largest, base.ceil_div(t, n))
        if sh.offload_params and stage == 3:
            r.host += base.ceil_div(params16, n)
            r.weights = gathered
        return r

    def master_itemsize(self, sh: Sharding, itemsize: int, quantized_4bit: bool) -> int:
        return 4 if sh.mixed_precision else itemsize  # the fp32 master partitions

    def stepped_elements(self, sh: Sharding, n_trainable: int, facts: Any) -> int:
        # ZeRO-3 steps its partition one sub-group at a time (stage3.py _create_fp16_sub_groups:
        # a sub-group closes at the parameter that takes it to sub_group_size elements of this
        # rank's partition, so it can pass that size by one parameter's partition); with
        # offload_optimizer the step runs on the host
        if sh.stage != 3 or sh.offload_optimizer:
            return 0
        n = max(1, sh.world_size)
        return min(base.ceil_div(n_trainable, n), (sh.sub_group or SUB_GROUP)
                   + base.ceil_div(_largest_trainable(facts, n_trainable), n))

    def reference_share(self, sh: Sharding, ref: ReferenceSizes, facts: Any) -> tuple[int, int]:
        p = 2 if sh.mixed_precision else ref.load_itemsize   # the engine casts it to 16-bit
        if sh.stage < 3:
            return ref.n_params * p, 0
        persistent = sum(x for x in ref.numels if x <= 10 * ref.hidden)   # TRL's threshold
        shard = 0 if sh.offload_params else base.ceil_div(ref.n_params * p, max(1, sh.world_size))
        fetched = min(facts.module_params + int(0.9 * ref.hidden * ref.hidden), ref.n_params)
        return shard + persistent * p, fetched * p

    def grads_sharded(self, sh: Sharding) -> bool:
        return sh.stage >= 2

    def traces_half(self, sh: Sharding) -> bool:
        return True  # DeepSpeed in 16-bit keeps the model itself in 16-bit, without autocast

    def emit(self, rung: Rung, ctx: EmitContext) -> dict[str, Any]:
        sh = Sharding(self.name, ctx.ranks, rung.stage, offload_optimizer=rung.offload_optimizer,
                      offload_params=rung.offload_params)
        split = {"parallelism_config": {"sp_size": ctx.dims.sp, "sp_backend": "deepspeed"}} \
            if ctx.dims.sp > 1 else {}
        return {**split, "deepspeed": deepspeed_config_for(
            sh, micro_batch=ctx.micro_batch, grad_accum=ctx.grad_accum, precision=ctx.precision,
            hidden=ctx.hidden, data_parallel=ctx.dims.data_parallel,
            max_grad_norm=ctx.max_grad_norm)}

    def check_emitted(self, ta: dict[str, Any], sh: Sharding, dims: ParallelDims,
                      notes: list[str]) -> None:
        validate_deepspeed_config(ta["deepspeed"], world_size=dims.data_parallel)
        notes.append(f"{sh.label()}: DeepSpeed config in training_args_kwargs['deepspeed'] "
                     "(write it with Plan.write_deepspeed_config)")

    def accelerator_plugin(self, ta: dict[str, Any]) -> dict[str, Any]:
        cfg = ta.get("deepspeed")
        return {"deepspeed_plugin": {"hf_ds_config": cfg}} if isinstance(cfg, dict) else {}

    def comm_bytes_per_step(self, sh: Sharding, *, n_params: int, n_trainable: int,
                            grad_accum: int, mixed_precision: bool) -> float:
        if sh.stage < 3:  # ZeRO-1/2 reduce every micro-step
            ring = (sh.world_size - 1) / sh.world_size
            return 2 * ring * n_trainable * (2 if mixed_precision else 4) * max(1, grad_accum)
        return base.gather_scatter_bytes(sh, n_params=n_params, n_trainable=n_trainable,
                                    grad_accum=grad_accum, mixed_precision=mixed_precision)

    def step_overhead(self, sh: Sharding, **kw: Any) -> float:
        return base.gather_overhead(sh, **kw) if sh.stage == 3 else 0.0

    def optimizer_shards(self, sh: Sharding) -> int:
        return sh.world_size if sh.stage >= 1 else 1

    def zero3_enabled(self, sh: Sharding) -> bool:
        return sh.stage == 3

    def resident_at_init_fraction(self, sh: Sharding) -> float:
        # the Trainer leaves the model where it loaded under DeepSpeed (place_model_on_device);
        # ZeRO-3's zero.Init has partitioned it onto the device as it loaded, 1/N a rank, or
        # onto the host with offload_param (partition_parameters.py: Init, remote_device)
        return 1.0 / max(1, sh.world_size) if sh.stage == 3 and not sh.offload_params else 0.0

    # -- sequence parallelism (Ulysses): the planner's split of each sequence ------------------
    def sequence_splits(self, degree: int, heads: Any) -> list[ParallelDims]:
        h = heads()
        return [ParallelDims(sp=degree)] if h and h % degree == 0 else []  # it splits heads

    def split_rungs(self) -> list[Rung]:
        return [r for r in RUNGS if r.stage == 3]   # ZeRO-3 over every rank

    def split_note(self, dims: ParallelDims, ranks: int) -> str:
        return (f"sequence parallelism x{dims.sp} (DeepSpeed Ulysses; {ranks // dims.sp} "
                f"data-parallel group(s)): sequences must be a multiple of {dims.sp} tokens, "
                "batches carry position_ids")

    def accelerate_section(self, ta: dict[str, Any]) -> dict[str, Any]:
        return {"deepspeed_config": {"deepspeed_config_file": self.config_file}}

    def config_of(self, ta: dict[str, Any]) -> dict[str, Any] | None:
        cfg = ta.get("deepspeed")
        return cfg if isinstance(cfg, dict) else None


DEEPSPEED_ENGINE = register(DeepSpeed())


def _largest_trainable(facts: Any, trainable: int) -> int:
    """The elements of the largest trainable parameter: the largest module's own parameters
    (an embedding or a head in full fine-tuning), at most what one layer or the tail trains
    (a LoRA layer's adapters)."""
    if facts is None:
        return trainable
    return min(facts.module_params, max(facts.layer_trainable, facts.tail_trainable) or
               facts.module_params, trainable)


def _zero3_step_transient(group: int, ga: int, flat_transient: int) -> int:
    """What ZeRO-3's step adds on the GPU for its largest sub-group of ``group`` elements, one
    sub-group at a time (stage3.py ``step``: ``_prepare_fp32_grad_for_sub_group``,
    ``_optimizer_step``, ``_release_sub_group``). ``_prepare_fp32_grad_for_sub_group`` flattens
    the sub-group's gradient partitions (a copy in the gradient-accumulation dtype, ``ga`` bytes)
    and casts it to fp32 (``.to(fp32_partitioned_groups_flat[i].dtype)``; no copy when ``ga`` is
    already 4), which stays as that fp32 partition's ``.grad`` through the optimizer's step on it
    (``flat_transient``: its temporaries on that one flat tensor) until the sub-group is
    released."""
    cast = (ga + 4) * group if ga != 4 else 4 * group
    return max(cast, 4 * group + flat_transient)


def _offload_grad_copies(r: RankStates, largest: int, partition: int) -> None:
    """ZeRO-1/2 with ``offload_optimizer`` in 16-bit (stage_1_and_2.py, DeepSpeed 0.19.8):
    ``__init__`` keeps ``temp_grad_buffer_for_gpu_offload``, a 16-bit buffer the size of the
    largest parameter, on the GPU for the run. In the backward, ``copy_grads_in_partition`` takes
    each reduced gradient's slice of this rank's partition and, on the GPU, first casts it to the
    norm dtype (``set_norm_for_param_grad_in_gpu``: ``.to(get_norm_dtype()).norm(2)``, fp64 where
    the device has it: 8 bytes an element), then to the fp32 master dtype before the host copy
    (``async_inplace_copy_grad_to_fp32_buffer_from_gpu``: ``src_tensor.to(self.master_weights_
    and_grads_dtype)``, 4 bytes). One after the other: the larger, at a parameter as large as
    the partition allows (an embedding or a head), is the transient."""
    r.buckets += 2 * largest
    r.grad_buffers += 8 * min(largest, partition)
    r.notes.append("ZeRO offload: a 16-bit buffer of the largest parameter stays on the GPU, and "
                   "each gradient slice is cast on the GPU (fp64 for its norm, fp32 for the host "
                   "copy) before it goes to the host")


def deepspeed_config_for(sh: Sharding, *, micro_batch: int, grad_accum: int, precision: str,
                         hidden: int, data_parallel: int,
                         max_grad_norm: float = 1.0) -> dict[str, Any]:
    """A complete DeepSpeed config (no "auto" left, so DeepSpeed's own class can check it).
    ``train_batch_size`` is micro-batch x accumulation x the data-parallel ranks
    (``data_parallel``, from ``ParallelDims``): under sequence parallelism DeepSpeed takes its
    world size from the data-parallel group (``DeepSpeedConfig``: the world / ``sp``)."""
    z: dict[str, Any] = {"stage": sh.stage, "overlap_comm": True, "contiguous_gradients": True,
                         "reduce_bucket_size": sh.reduce_bucket or hidden * hidden}
    if sh.stage in (1, 2):
        z["allgather_bucket_size"] = sh.allgather_bucket or DS_ALLGATHER_BUCKET
    if sh.stage == 3:
        z.update(stage3_prefetch_bucket_size=sh.prefetch_bucket or int(0.9 * hidden * hidden),
                 stage3_param_persistence_threshold=10 * hidden,
                 stage3_max_live_parameters=sh.max_live or int(1e9),
                 stage3_gather_16bit_weights_on_model_save=True)
    if sh.offload_optimizer:
        z["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if sh.offload_params and sh.stage == 3:
        z["offload_param"] = {"device": "cpu", "pin_memory": True}
    return {"train_micro_batch_size_per_gpu": micro_batch,
            "gradient_accumulation_steps": grad_accum,
            "train_batch_size": micro_batch * grad_accum * data_parallel,
            "gradient_clipping": max_grad_norm, "zero_optimization": z,
            "bf16": {"enabled": precision == "bf16"},
            "fp16": {"enabled": precision == "fp16"}}


def validate_deepspeed_config(cfg: dict[str, Any], *, world_size: int,
                              source: str = "deepspeed config") -> None:
    """Check a DeepSpeed config with DeepSpeed's own config class (pydantic: unknown keys and
    bad values are errors), and the batch arithmetic against ``world_size``."""
    problems = []
    tb, mb, ga = (cfg.get("train_batch_size"), cfg.get("train_micro_batch_size_per_gpu"),
                  cfg.get("gradient_accumulation_steps"))
    ints = all(isinstance(v, int) for v in (tb, mb, ga))
    if ints and tb != mb * ga * world_size:
        problems.append(f"train_batch_size {tb} != micro-batch {mb} x accumulation {ga} x "
                        f"{world_size} ranks")
    if problems:
        raise ConfigError(problems, source=source)
    try:
        from deepspeed.runtime.config import DeepSpeedConfig
    except ImportError:
        return  # deepspeed not installed: the arithmetic above is all we can check
    check = json.loads(json.dumps(cfg))
    if ints:
        # DeepSpeedConfig takes the world size from torch.distributed (1 outside a launch):
        # the batch arithmetic was checked above, so check the rest at world size 1
        check["train_batch_size"] = mb * ga
    try:
        _quiet_deepspeed(lambda: DeepSpeedConfig(check))
    except Exception as exc:
        raise ConfigError([f"DeepSpeed rejects it: {str(exc).splitlines()[0]} "
                           f"({' '.join(str(exc).split())[:300]})"], source=source) from exc


def _quiet_deepspeed(fn):
    import logging

    logger = logging.getLogger("DeepSpeed")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        return fn()
    finally:
        logger.setLevel(level)
