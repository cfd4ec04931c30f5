"""Per-rank memory of data-parallel engines: DDP, FSDP2 and DeepSpeed ZeRO-1/2/3 (+ CPU offload).

Data flow: ``TrainingArguments`` fields (``fsdp``/``fsdp_config``, ``deepspeed``,
``accelerator_config``) + ``num_gpus`` -> ``Sharding`` (``sharding_from_args``) ->
``rank_states`` (what one rank holds: sharded states, gathered layers, buckets, what lives on
the host) -> ``_estimate.estimate_for`` adds the replicated activations per phase.

What each engine keeps on one GPU (Psi = parameters, N = ranks):

* **DDP** (the Trainer through accelerate): a full replica, plus the reducer's gradient buckets,
  which are separate memory of the gradients' size unless ``gradient_as_bucket_view=True``
  (torch ``DistributedDataParallel``; accelerate's default leaves it False).
* **FSDP2** as accelerate 1.x prepares it (``accelerate/utils/fsdp_utils.py``,
  ``fsdp2_prepare_model``): ``fully_shard`` on every ``transformer_layer_cls_to_wrap`` module,
  the input embedding as its own unit, ``[final norm, lm_head]`` as a tail unit that is not
  resharded after forward, then the root. Parameters stay in their load dtype, upcast to fp32
  when ``mixed_precision != "no"`` (fp32 master shards); ``MixedPrecisionPolicy(param_dtype=
  bf16, reduce_dtype=bf16)`` makes the gathered copies and the unsharded gradients 16-bit.
  Sharded: weights, gradients and optimizer state / N. Transient: the gathered layers (the
  current one, the prefetched one on CUDA, where all-gathers run on their own stream), the tail,
  one layer's unsharded gradients plus its reduce-scatter input. ``reshard_after_forward=False``
  (SHARD_GRAD_OP, ZeRO-2 semantics) keeps every layer gathered from its forward to its backward.
  ``CPUOffloadPolicy`` moves parameters, gradients and optimizer state to the host together.
  With gradient accumulation the Trainer skips the reduce-scatter on non-final micro-steps
  (``accelerator.no_sync`` -> ``set_requires_gradient_sync(False)``), which keeps *unsharded*
  gradients; ``accelerator_config.gradient_accumulation_kwargs.sync_each_batch=True`` avoids it.
* **DeepSpeed ZeRO** (16-bit training, DeepSpeed's own accounting, as its estimators
  ``estimate_zero2/3_model_states_mem_needs`` print it): 16-bit parameters (partitioned at
  stage 3), fp32 master weights, Adam moments and fp32 gradient partitions / N (ZeRO-2: 18 B per
  parameter over N with 16-bit parameters whole; ZeRO-3: 18 B / N plus two gathered copies of the
  largest module, 4 B x its parameters; gathered parameters beyond those stay live up to
  ``stage3_max_live_parameters`` and are counted as a forward/backward transient). ZeRO-1
  partitions only master weights, moments and fp32 gradients (16 B / N) and keeps 16-bit
  gradients whole. ``offload_optimizer`` moves master
  weights, moments and gradient partitions to the host; ``offload_param`` (stage 3) the 16-bit
  partitions too. Reduce / all-gather / prefetch buckets are counted as temporaries.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from ._errors import ConfigError, HfMemkitError, did_you_mean

ENGINES = ("none", "ddp", "fsdp", "deepspeed")

# fsdp_config keys transformers 5.x reads (TrainingArguments._process_fsdp_args; a leading
# "fsdp_" is stripped first). TrainingArguments accepts any other key silently, so a typo would
# do nothing: validate_fsdp_config rejects them, and the test suite checks that every key here
# maps onto a field of accelerate's FullyShardedDataParallelPlugin.
FSDP_CONFIG_KEYS = {
    "version": "FSDP version (2; FSDP1 is deprecated)",
    "reshard_after_forward": "True = FULL_SHARD (ZeRO-3), False = SHARD_GRAD_OP (ZeRO-2)",
    "cpu_offload": "offload parameters, gradients and optimizer state to the host",
    "auto_wrap_policy": "TRANSFORMER_BASED_WRAP or SIZE_BASED_WRAP",
    "transformer_layer_cls_to_wrap": "decoder/encoder layer classes to shard one by one",
    "min_num_params": "size threshold of SIZE_BASED_WRAP",
    "activation_checkpointing": "FSDP's own activation checkpointing of each wrapped layer",
    "cpu_ram_efficient_loading": "only rank 0 materialises the weights when loading",
    "state_dict_type": "FULL_STATE_DICT or SHARDED_STATE_DICT for checkpoints",
    "forward_prefetch": "(FSDP1) prefetch the next all-gather in forward",
    "backward_prefetch": "(FSDP1) BACKWARD_PRE / BACKWARD_POST / NO_PREFETCH",
    "use_orig_params": "(FSDP1) keep original parameters visible",
    "sync_module_states": "(FSDP1) broadcast rank 0's weights",
    "limit_all_gathers": "(FSDP1) rate-limit all-gathers",
    "xla": "PyTorch/XLA FSDP", "xla_fsdp_v2": "PyTorch/XLA FSDPv2",
    "xla_fsdp_grad_ckpt": "PyTorch/XLA checkpointing", "xla_fsdp_settings": "PyTorch/XLA settings",
}
# DeepSpeed defaults the planner writes explicitly (HF's "auto" values: hidden^2 and 0.9 hidden^2).
DS_ALLGATHER_BUCKET = int(5e8)


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

    def label(self) -> str:
        if self.engine == "none":
            return "single device"
        if self.engine == "ddp":
            return f"DDP x{self.world_size}"
        off = []
        if self.offload_params:
            off.append("params")
        if self.offload_optimizer:
            off.append("optimizer")
        suffix = f" + CPU offload ({', '.join(off)})" if off else ""
        if self.engine == "fsdp":
            kind = "full shard" if self.stage == 3 else "shard-grad-op"
            return f"FSDP2 {kind} x{self.world_size}{suffix}"
        return f"DeepSpeed ZeRO-{self.stage} x{self.world_size}{suffix}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class ModelFacts:
    """What the sharding arithmetic needs from the model (from its meta instance)."""

    total_params: int
    layer_params: int          # largest transformer layer (FSDP unit)
    tail_params: int           # output head (+ tied embedding): accelerate's FSDP tail unit
    module_params: int         # largest single module's own parameters (DeepSpeed ZeRO-3 gather)
    layer_class: str | None    # the class FSDP auto-wraps
    tied: bool = False


def model_facts(meta: torch.nn.Module) -> ModelFacts:
    base = meta.get_base_model() if hasattr(meta, "get_base_model") else meta
    names = set(getattr(base, "_no_split_modules", None) or ())
    layers = [m for m in base.modules() if type(m).__name__ in names]
    layer_cls = type(layers[0]).__name__ if layers else None
    if layers:
        layer_cls = max({type(m).__name__ for m in layers},
                        key=lambda n: sum(1 for m in layers if type(m).__name__ == n))
    layer_params = max((sum(p.numel() for p in m.parameters()) for m in layers), default=0)
    inp = base.get_input_embeddings() if hasattr(base, "get_input_embeddings") else None
    out = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    tied = inp is not None and out is not None and out.weight is inp.weight
    # accelerate's tail unit [final norm, lm_head] (+ the input embedding when tied) is not
    # resharded after forward: gathered from the end of the forward to the start of backward
    tail = sum(p.numel() for p in out.parameters()) if out is not None else 0
    seen: dict[int, int] = {}
    for p in base.parameters():
        seen[id(p)] = p.numel()
    module_params = max((sum(p.numel() for p in m.parameters(recurse=False))
                         for m in base.modules()), default=0)
    return ModelFacts(sum(seen.values()), layer_params, tail, module_params, layer_cls, tied)


# ----------------------------------------------------------------------------------------------
# reading the arguments
# ----------------------------------------------------------------------------------------------


def _load_json(value: Any, what: str) -> dict[str, Any]:
    if value is None or value == "":
        return {}
    if isinstance(value, dict):
        return dict(value)
    if isinstance(value, (str, os.PathLike)) and os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return json.load(f)
    raise HfMemkitError(f"{what} must be a dict or the path of a JSON file; got {value!r}")


def _truthy(v: Any) -> bool:
    return str(v).strip().lower() in ("1", "true", "yes", "on")


def sharding_from_args(get, num_gpus: int | None) -> tuple[Sharding, list[str]]:
    """``get(field)`` reads a TrainingArguments field. Returns the sharding and notes."""
    notes: list[str] = []
    world = int(num_gpus or 1)
    fsdp, ds = get("fsdp"), get("deepspeed")
    acc = get("accelerator_config") or {}
    if not isinstance(acc, dict):
        acc = getattr(acc, "to_dict", lambda: {})()
    sync_each = bool((acc.get("gradient_accumulation_kwargs") or {}).get("sync_each_batch"))
    if fsdp and ds:
        raise HfMemkitError("both `fsdp` and `deepspeed` are set; choose one engine")
    if (fsdp or ds) and num_gpus is None:
        notes.append("fsdp/deepspeed given without num_gpus: estimated for 1 rank; pass "
                     "num_gpus=N for the per-rank memory of N ranks")
    if fsdp:
        cfg = _load_json(get("fsdp_config"), "fsdp_config")
        cfg = {k[5:] if k.startswith("fsdp_") else k: v for k, v in cfg.items()}
        offload = _truthy(cfg.get("cpu_offload", False))
        reshard = cfg.get("reshard_after_forward", True)
        if isinstance(fsdp, str):  # legacy strings: "full_shard auto_wrap offload"
            items = fsdp.split()
            offload = offload or "offload" in items
            if "shard_grad_op" in items:
                reshard = False
        if isinstance(reshard, str) and reshard.upper() in ("FULL_SHARD", "SHARD_GRAD_OP",
                                                            "NO_SHARD", "HYBRID_SHARD"):
            reshard = reshard.upper() in ("FULL_SHARD", "HYBRID_SHARD")
        stage = 3 if _truthy(reshard) else 2
        amp = bool(get("bf16") or get("fp16"))
        return Sharding("fsdp", world, stage, offload_params=offload, offload_optimizer=offload,
                        mixed_precision=amp, sync_each_batch=sync_each,
                        activation_checkpointing=_truthy(cfg.get("activation_checkpointing",
                                                                 False))), notes
    if ds:
        cfg = _load_json(ds, "deepspeed")
        z = cfg.get("zero_optimization") or {}
        stage = int(z.get("stage", 0))

        def dev(key: str) -> bool:
            v = z.get(key) or {}
            return str(v.get("device", "none")).lower() in ("cpu", "nvme")

        def num(key: str, default: int) -> int:
            v = z.get(key, default)
            return default if v == "auto" else int(float(v))

        return Sharding("deepspeed", world, stage, offload_params=dev("offload_param"),
                        offload_optimizer=dev("offload_optimizer"),
                        mixed_precision=bool(get("bf16") or get("fp16")),
                        reduce_bucket=num("reduce_bucket_size", int(5e8)),
                        allgather_bucket=num("allgather_bucket_size", DS_ALLGATHER_BUCKET)
                        if stage in (1, 2) else 0,
                        prefetch_bucket=num("stage3_prefetch_bucket_size", int(5e7))
                        if stage == 3 else 0,
                        max_live=num("stage3_max_live_parameters", int(1e9))
                        if stage == 3 else 0), notes
    if world > 1:
        # the reducer's buckets (ddp_bucket_cap_mb each) together hold every gradient
        return Sharding("ddp", world, 0), notes
    return Sharding(), notes


# ----------------------------------------------------------------------------------------------
# what one rank holds
# ----------------------------------------------------------------------------------------------


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
    notes: list[str] = field(default_factory=list)

    @property
    def model_states(self) -> int:
        """Resident weights + gradients + optimizer state (DeepSpeed ZeRO-3: with its two
        gathered copies of the largest module, as DeepSpeed's estimator counts them)."""
        return self.weights + self.gradients + self.optimizer


def rank_states(sh: Sharding, *, weight_bytes: int, grad_bytes: int, n_trainable: int,
                optimizer_state: int, optimizer_transient: int, facts: ModelFacts | None,
                device_kind: str, load_itemsize: int) -> RankStates:
    """Per-rank model states of ``sh`` for a model of ``weight_bytes`` (load dtype) whose
    trainable parameters have ``grad_bytes`` of gradients and ``optimizer_state`` of state."""
    n = max(1, sh.world_size)
    if sh.engine in ("none", "ddp"):
        r = RankStates(weight_bytes, grad_bytes, optimizer_state, optimizer_transient)
        if sh.engine == "ddp" and not sh.grad_as_bucket_view:
            r.buckets = grad_bytes
            r.notes.append(f"DDP gradient buckets: {grad_bytes / 2**30:.2f} GiB, a second copy of "
                           "the gradients (gradient_as_bucket_view=False, accelerate's default)")
        return r
    if facts is None:
        raise HfMemkitError(f"{sh.label()} needs the model's layer structure")
    if sh.engine == "fsdp":
        gather = 2 if sh.mixed_precision else load_itemsize
        red = 2 if sh.mixed_precision else 4
        L, T = facts.layer_params, facts.tail_params
        in_flight = 2 if device_kind == "cuda" else 1  # CPU: no separate all-gather stream
        # backward: the tail's unsharded weight and gradient at its start, later two gathered
        # layers (current + prefetched) and one layer's unsharded gradient + reduce-scatter
        # input; the tail reshards after its own backward, so the two never coexist
        unit = max((T, T), (2 * L, 2 * L), key=lambda u: u[0] * gather + u[1] * red)
        grads_unsharded = unit[1] * red if n_trainable else 0
        if sh.stage == 3:
            fwd = (T + in_flight * L) * gather
            bwd = unit[0] * gather
        else:  # every layer stays gathered from its forward to its backward
            fwd = bwd = facts.total_params * gather
        r = RankStates(
            weights=_ceil(weight_bytes, n), gradients=_ceil(grad_bytes, n),
            optimizer=_ceil(optimizer_state, n), optimizer_transient=_ceil(optimizer_transient, n),
            gathered_forward=fwd, gathered_backward=bwd, grad_buffers=grads_unsharded)
        if not sh.sync_each_batch:
            r.accum_gradients = n_trainable * gather + r.gradients
        if sh.offload_params:  # CPUOffloadPolicy: all three together
            r.host = r.weights + r.gradients + r.optimizer
            r.weights = r.gradients = r.optimizer = r.optimizer_transient = 0
            if r.accum_gradients is not None:
                r.accum_gradients = n_trainable * gather
        return r
    # DeepSpeed (its accounting: see the module docstring)
    half = sh.mixed_precision
    p = 2 if half else load_itemsize
    psi = weight_bytes // max(1, load_itemsize)      # parameter elements (incl. buffers)
    t = n_trainable
    master = 4 * t if half else 0                    # fp32 master weights
    g16 = p * t                                      # gradients in the training dtype
    g32 = (4 * t if sh.stage < 3 else 2 * t) if half else 0  # fp32 gradient partitions
    params16 = p * psi
    stage = sh.stage
    gathered = 2 * facts.module_params * p if stage == 3 else 0
    if stage == 0:
        w, g, o = params16 + master, g16 + g32, optimizer_state
    elif stage in (1, 2):
        w = params16 + _ceil(master, n)
        g = g16 + _ceil(g32, n) if stage == 1 else _ceil(g16 + g32, n)
        o = _ceil(optimizer_state, n)
    else:
        w = _ceil(params16 + master, n) + gathered
        g, o = _ceil(g16 + g32, n), _ceil(optimizer_state, n)
    r = RankStates(w, g, o, _ceil(optimizer_transient, n) if stage >= 1 else optimizer_transient)
    r.buckets = (sh.reduce_bucket + sh.allgather_bucket + sh.prefetch_bucket) * p
    if stage == 3:
        # gathered parameters stay resident up to stage3_max_live_parameters before DeepSpeed
        # releases them: beyond the estimator's two copies of the largest module (counted in
        # the model states above), the forward and backward can hold that many
        live = min(sh.max_live or psi, psi) * p
        r.gathered_forward = r.gathered_backward = max(0, live - gathered)
    if sh.offload_optimizer:  # master weights, moments and gradient partitions to the host
        r.host = _ceil(master, n) + o + (_ceil(g16 + g32, n) if stage >= 2 else _ceil(g32, n))
        r.weights = (params16 if stage < 3 else _ceil(params16, n) + gathered)
        r.gradients = g16 if stage == 1 else 0
        r.optimizer = r.optimizer_transient = 0
    if sh.offload_params and stage == 3:
        r.host += _ceil(params16, n)
        r.weights = gathered
    return r


def _ceil(x: int, n: int) -> int:
    return -(-int(x) // n)


# ----------------------------------------------------------------------------------------------
# emitted configs and their validation
# ----------------------------------------------------------------------------------------------


def fsdp_config_for(sh: Sharding, layer_class: str | None, *, checkpointing: bool) -> dict[str, Any]:
    """The ``fsdp_config`` of a plan (``fsdp=True`` goes with it; strings are deprecated)."""
    cfg: dict[str, Any] = {"version": 2, "reshard_after_forward": sh.stage == 3,
                           "cpu_offload": bool(sh.offload_params),
                           "state_dict_type": "SHARDED_STATE_DICT",
                           "cpu_ram_efficient_loading": True}
    if layer_class:
        cfg["auto_wrap_policy"] = "TRANSFORMER_BASED_WRAP"
        cfg["transformer_layer_cls_to_wrap"] = [layer_class]
    else:
        cfg["auto_wrap_policy"] = "SIZE_BASED_WRAP"
        cfg["min_num_params"] = int(1e8)
    if checkpointing:
        cfg["activation_checkpointing"] = True
    validate_fsdp_config(cfg)
    return cfg


def validate_fsdp_config(cfg: dict[str, Any], *, source: str = "fsdp_config") -> None:
    """Reject keys transformers would ignore silently; check the rest maps onto accelerate's
    ``FullyShardedDataParallelPlugin`` fields and that the plugin accepts the values."""
    problems = []
    for k in cfg:
        key = k[5:] if k.startswith("fsdp_") else k
        if key not in FSDP_CONFIG_KEYS:
            problems.append(f"unknown fsdp_config key `{k}`{did_you_mean(key, FSDP_CONFIG_KEYS)}; "
                            f"transformers ignores it silently. Known: "
                            f"{', '.join(sorted(FSDP_CONFIG_KEYS))}")
    if problems:
        raise ConfigError(problems, source=source)
    plugin_args = fsdp_plugin_args(cfg)
    import dataclasses

    from accelerate.utils import FullyShardedDataParallelPlugin

    fields = {f.name for f in dataclasses.fields(FullyShardedDataParallelPlugin)}
    unknown = sorted(set(plugin_args) - fields)
    if unknown:
        raise ConfigError([f"fsdp_config maps to {unknown}, which accelerate's "
                           "FullyShardedDataParallelPlugin does not have"], source=source)
    try:
        FullyShardedDataParallelPlugin(**plugin_args)
    except Exception as exc:
        raise ConfigError([f"accelerate's FullyShardedDataParallelPlugin rejects it: {exc}"],
                          source=source) from exc


def fsdp_plugin_args(cfg: dict[str, Any]) -> dict[str, Any]:
    """What transformers hands accelerate for this ``fsdp_config`` (read from TrainingArguments
    itself, so a change in transformers' mapping shows up here)."""
    import warnings

    from transformers import TrainingArguments

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = TrainingArguments(output_dir=os.devnull, use_cpu=True, fsdp=True,
                                 fsdp_config=json.loads(json.dumps(cfg)), report_to="none")
    return dict(args.fsdp_plugin_args)


def deepspeed_config_for(sh: Sharding, *, micro_batch: int, grad_accum: int, precision: str,
                         hidden: int, max_grad_norm: float = 1.0) -> dict[str, Any]:
    """A complete DeepSpeed config (no "auto" left, so DeepSpeed's own class can check it)."""
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
    cfg = {"train_micro_batch_size_per_gpu": micro_batch,
           "gradient_accumulation_steps": grad_accum,
           "train_batch_size": micro_batch * grad_accum * sh.world_size,
           "gradient_clipping": max_grad_norm, "zero_optimization": z,
           "bf16": {"enabled": precision == "bf16"},
           "fp16": {"enabled": precision == "fp16"}}
    return cfg


def validate_deepspeed_config(cfg: dict[str, Any], *, world_size: int,
                              source: str = "deepspeed config") -> None:
    """Check a DeepSpeed config with DeepSpeed's own config class (pydantic: unknown keys and
    bad values are errors), and the batch arithmetic against ``world_size``."""
    problems = []
    tb, mb, ga = (cfg.get("train_batch_size"), cfg.get("train_micro_batch_size_per_gpu"),
                  cfg.get("gradient_accumulation_steps"))
    if all(isinstance(v, int) for v in (tb, mb, ga)) and tb != mb * ga * world_size:
        problems.append(f"train_batch_size {tb} != micro-batch {mb} x accumulation {ga} x "
                        f"{world_size} ranks")
    try:
        from deepspeed.runtime.config import DeepSpeedConfig
    except ImportError:
        if problems:
            raise ConfigError(problems, source=source) from None
        return  # deepspeed not installed: the arithmetic above is all we can check
    if problems:
        raise ConfigError(problems, source=source)
    check = json.loads(json.dumps(cfg))
    if all(isinstance(v, int) for v in (tb, mb, ga)):
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


# ----------------------------------------------------------------------------------------------
# launching, and communication time per step (for the cost model)
# ----------------------------------------------------------------------------------------------


def launch_commands(*, script: str, num_gpus: int, num_nodes: int, engine: str,
                    config_file: str | None = None) -> dict[str, str]:
    """``accelerate launch`` and ``torchrun`` command lines for one node and for several."""
    per_node = num_gpus // max(1, num_nodes)
    out = {}
    acc = ["accelerate launch"]
    if engine == "fsdp":
        acc.append("--use_fsdp")
    elif engine == "deepspeed":
        acc.append("--use_deepspeed" + (f" --deepspeed_config_file {config_file}"
                                        if config_file else ""))
    elif num_gpus > 1:
        acc.append("--multi_gpu")
    acc.append(f"--num_processes {num_gpus}")
    if num_nodes > 1:
        acc.append(f"--num_machines {num_nodes} --machine_rank $NODE_RANK "
                   "--main_process_ip $MASTER_ADDR --main_process_port 29500")
    out["accelerate"] = " ".join(acc + [script])
    tr = [f"torchrun --nproc_per_node {per_node}"]
    if num_nodes > 1:
        tr.append(f"--nnodes {num_nodes} --node_rank $NODE_RANK --rdzv_backend c10d "
                  "--rdzv_endpoint $MASTER_ADDR:29500")
    out["torchrun"] = " ".join(tr + [script])
    return out


# Inter-node links when a plan spans nodes: InfiniBand NDR 400 Gb/s per GPU (DGX H100 has one
# 400 Gb/s NIC per GPU), the usual fabric for multi-node training. Bytes/s, one direction.
INTER_NODE_BANDWIDTH = 50e9


def comm_bytes_per_step(sh: Sharding, *, n_params: int, n_trainable: int, grad_accum: int,
                        mixed_precision: bool) -> float:
    """Bytes each rank sends per optimizer step (ring collectives: (N-1)/N of the payload).

    DDP: one all-reduce of the gradients per step (2x payload); ZeRO-1/2 reduce every
    micro-step. FSDP full shard / ZeRO-3: all-gather of the parameters in forward and again in
    backward, reduce-scatter of the gradients, per micro-step (3x); shard-grad-op gathers once. Offload adds host
    transfers (PCIe), counted by the caller's bandwidth choice."""
    n = sh.world_size
    if n <= 1:
        return 0.0
    ring = (n - 1) / n
    b = 2 if mixed_precision else 4
    if sh.engine == "ddp":  # the Trainer skips the all-reduce on non-final micro-steps
        return 2 * ring * n_trainable * b
    if sh.engine == "deepspeed" and sh.stage < 3:  # ZeRO-1/2 reduce every micro-step
        return 2 * ring * n_trainable * b * max(1, grad_accum)
    gathers = 2 if sh.stage == 3 else 1
    return (gathers * ring * n_params * b + ring * n_trainable * b) * max(1, grad_accum)


def comm_seconds(sh: Sharding, *, n_params: int, n_trainable: int, grad_accum: int,
                 mixed_precision: bool, intra_bw: float | None, num_nodes: int) -> float:
    """Seconds of communication per optimizer step that compute does not hide (assumed: half
    of it overlaps, as DDP buckets and FSDP prefetching overlap with compute)."""
    vol = comm_bytes_per_step(sh, n_params=n_params, n_trainable=n_trainable,
                              grad_accum=grad_accum, mixed_precision=mixed_precision)
    if vol == 0:
        return 0.0
    bw = (intra_bw or 32e9) / 2  # catalog figures are bidirectional
    if num_nodes > 1:
        bw = min(bw, INTER_NODE_BANDWIDTH)
    t = vol / bw
    if sh.offload_params or sh.offload_optimizer:
        t += 2 * n_params * 4 / max(1, sh.world_size) / 25e9  # PCIe 4 x16 host round trip
    return 0.5 * t
