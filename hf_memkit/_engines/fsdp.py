"""FSDP2 as accelerate 1.x prepares it (``accelerate/utils/fsdp_utils.py``, ``fsdp2_prepare_model``).

``fully_shard`` on every ``transformer_layer_cls_to_wrap`` module, the input embedding as its own
unit, ``[final norm, lm_head]`` as a tail unit that is not resharded after forward, then the root.

Precision. With ``mixed_precision != "no"`` (``bf16=True`` / ``fp16=True``) accelerate first
upcasts every *trainable* parameter that is not fp32 to fp32 (``fsdp2_prepare_model``: "Upcast to
fp32 master weights"; FSDP1 does the same per flat parameter in ``Accelerator.prepare_model``),
so a model loaded in bf16 (or ``dtype="auto"``) holds fp32 sharded weights, fp32 sharded
gradients and fp32 optimizer state for what it trains: 16 B per trainable parameter with AdamW,
not 8 (``master_itemsize``). Frozen parameters (a LoRA base) keep their load dtype. A model with
any bitsandbytes ``Params4bit`` is not upcast at all (FSDP2 skips the whole step; its adapters
keep their dtype, fp32 as peft makes them). ``MixedPrecisionPolicy(param_dtype, reduce_dtype)``
(``FullyShardedDataParallelPlugin.set_mixed_precision``; for QLoRA transformers'
``update_fsdp_plugin_peft`` sets both to ``bnb_4bit_quant_storage``) makes the gathered copies and
the unsharded gradients 16-bit, and each rank computes in it without autocast.

A 4-bit base: ``Params4bit`` stored in a float dtype (``bnb_4bit_quant_storage=torch.bfloat16``,
the FSDP-QLoRA recipe) is sharded like any parameter and gathered packed (2 weights per byte);
with the default uint8 storage accelerate leaves it out of FSDP (``ignored_params``), whole on
every rank. The absmax blocks live in the ``quant_state``, not a parameter: whole on every rank,
as are buffers, which ``fully_shard`` does not shard.

Sharded: weights, gradients and optimizer state / N. Transient: the gathered layers (the current
one, the prefetched one on CUDA, where all-gathers run on their own stream), the tail, one
layer's unsharded gradients (of what it trains) plus its reduce-scatter input.
``reshard_after_forward=False`` (SHARD_GRAD_OP, ZeRO-2 semantics) keeps every layer gathered from
its forward to its backward. ``CPUOffloadPolicy`` moves parameters, gradients and optimizer state
to the host together. With gradient accumulation the Trainer skips the reduce-scatter on
non-final micro-steps (``accelerator.no_sync`` -> ``set_requires_gradient_sync(False)``), which
keeps *unsharded* gradients; ``accelerator_config.gradient_accumulation_kwargs.sync_each_batch=
True`` avoids it. accelerate's ``activation_checkpointing_offload`` (pinned host copies of each
checkpointed layer's input) is read from the environment (``checkpoint_offload``) and modelled by
the ``checkpoint_offload`` technique.

A trainer's reference model (TRL's ``prepare_fsdp``, ``trl/models/utils.py``): FSDP2 applies
``fully_shard`` to its root alone, with the plugin's resharding, offload and mixed precision and no
upcast, so each rank keeps 1/N of it and its forward gathers the whole of it at once.
"""

from __future__ import annotations

import json
import os
import warnings
from typing import Any

from .._errors import ConfigError, did_you_mean
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
from .dims import CP_STRATEGIES, ParallelDims

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
RUNGS = [Rung("fsdp-grad-op", "FSDP2 shard-grad-op", "fsdp", 2, shards_params=True,
              shards_4bit=True),
         Rung("fsdp-full", "FSDP2 full shard", "fsdp", 3, shards_params=True, shards_4bit=True),
         Rung("fsdp-offload", "FSDP2 full shard + offload", "fsdp", 3, offload_params=True,
              offload_optimizer=True, shards_params=True, shards_4bit=True)]


AC_OFFLOAD_ENV = "FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD"
IGNORED_AC_OFFLOAD = (
    "hf_memkit does not model fsdp_config['activation_checkpointing_offload']: transformers "
    "5.23 does not pass it on to accelerate (TrainingArguments._process_fsdp_args), so the run "
    "ignores it too. accelerate's FSDP2 plugin takes it from `accelerate launch "
    f"--fsdp_activation_checkpointing_offload true` ({AC_OFFLOAD_ENV}=true), which hf_memkit "
    "reads and models")


def _config(get) -> dict[str, Any]:
    cfg = base.load_json(get("fsdp_config"), "fsdp_config")
    return {k[5:] if k.startswith("fsdp_") else k: v for k, v in cfg.items()}


def checkpoint_offload(get) -> bool:
    """Whether accelerate's FSDP2 plugin offloads each checkpointed layer's input to pinned host
    memory (``FullyShardedDataParallelPlugin.activation_checkpointing_offload``, applied by
    ``accelerate/utils/fsdp_utils.py::fsdp2_apply_ac`` as ``offload_wrapper(checkpoint_wrapper(
    layer))``). transformers 5.23 maps no ``fsdp_config`` key onto it, so the Trainer's plugin
    reads ``FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD`` (``__post_init__``, accelerate's
    ``str_to_bool``), which ``accelerate launch --fsdp_activation_checkpointing_offload true``
    sets; it needs fsdp_config's ``activation_checkpointing`` and FSDP version 2."""
    if not get("fsdp") or os.environ.get(AC_OFFLOAD_ENV, "").strip().lower() not in (
            "y", "yes", "t", "true", "on", "1"):
        return False
    cfg = _config(get)
    return base.truthy(cfg.get("activation_checkpointing", False)) and \
        str(cfg.get("version", 2)) == "2"


def _reshard(fsdp: Any, cfg: dict[str, Any]) -> tuple[bool, bool]:
    """(reshard after forward, offload) from the config and legacy ``fsdp`` strings."""
    offload = base.truthy(cfg.get("cpu_offload", False))
    reshard = cfg.get("reshard_after_forward", True)
    if isinstance(fsdp, str):  # legacy strings: "full_shard auto_wrap offload"
        items = fsdp.split()
        offload = offload or "offload" in items
        if "shard_grad_op" in items:
            reshard = False
    if isinstance(reshard, str) and reshard.upper() in ("FULL_SHARD", "SHARD_GRAD_OP",
                                                        "NO_SHARD", "HYBRID_SHARD"):
        reshard = reshard.upper() in ("FULL_SHARD", "HYBRID_SHARD")
    return base.truthy(reshard), offload


class FSDP(Engine):
    name = "fsdp"
    sharded = True
    default_sharding = True
    owns_checkpointing = True   # fsdp_config's activation_checkpointing, as transformers asks
    holds_masters = True        # the sharded parameters are the (upcast) fp32 masters
    launch_flag = "--use_fsdp"
    # accelerate's fsdp_sharding_strategy names (FSDP2: reshard_after_forward True / False);
    # "fsdp-offload": full shard with fsdp_offload_params
    stages = {"fsdp-full-shard": ("fsdp-full", "fsdp-offload"),
              "fsdp-shard-grad-op": ("fsdp-grad-op",), "fsdp-offload": ("fsdp-offload",)}
    fields = ("fsdp", "fsdp_config", "accelerator_config")
    split_kind = "context"      # torch ring attention over the dp_shard x cp mesh
    accelerate_type = "FSDP"

    def selected(self, get) -> bool:
        return bool(get("fsdp"))

    def from_args(self, get, world: int) -> Sharding:
        cfg = _config(get)
        if "activation_checkpointing_offload" in cfg:
            warnings.warn(IGNORED_AC_OFFLOAD, stacklevel=4)
        reshard, offload = _reshard(get("fsdp"), cfg)
        return Sharding("fsdp", world, 3 if reshard else 2, offload_params=offload,
                        offload_optimizer=offload, mixed_precision=bool(get("bf16") or get("fp16")),
                        sync_each_batch=base.sync_each_batch(get),
                        activation_checkpointing=base.truthy(cfg.get("activation_checkpointing",
                                                                False)),
                        fsdp_version=int(cfg.get("version", 2)))   # transformers' default: 2

    def label(self, sh: Sharding) -> str:
        kind = "full shard" if sh.stage == 3 else "shard-grad-op"
        hsdp = f" (HSDP: {sh.replicas} replicas)" if sh.replicas > 1 else ""
        return f"FSDP{sh.fsdp_version} {kind} x{sh.world_size}{hsdp}{base.offload_suffix(sh)}"

    def rungs(self) -> list[Rung]:
        return list(RUNGS)

    def notes(self, sh: Sharding, device_kind: str) -> list[str]:
        out = super().notes(sh, device_kind)
        if sh.fsdp_version == 1:
            out.append("FSDP1 (deprecated in transformers and accelerate): the root unit (the "
                       "embedding, final norm and head) stays gathered through the step; "
                       "accelerate upcasts every "
                       "FlatParameter that trains to fp32 (with PEFT only the adapters' own "
                       "units, which transformers wraps apart)")
        if device_kind != "cuda":
            out.append("FSDP through the Trainer needs CUDA: on a CPU, accelerate drops the FSDP "
                       "plugin and the Trainer silently trains DDP replicas; this estimate is "
                       "for FSDP2 applied directly (fully_shard / accelerate's "
                       "fsdp2_prepare_model)")
        return out

    def master_itemsize(self, sh: Sharding, itemsize: int, quantized_4bit: bool) -> int:
        # fsdp2_prepare_model: `mixed_precision != "no" and not model_has_params4bit` upcasts
        # every trainable parameter that is not fp32; FSDP1 (Accelerator.prepare_model) upcasts
        # every FlatParameter that requires grad, a 4-bit model's too
        if sh.fsdp_version == 1:
            return 4 if sh.mixed_precision else itemsize
        return 4 if sh.mixed_precision and not quantized_4bit else itemsize

    def rank_states(self, sh: Sharding, sizes: StateSizes, facts: Any,
                    device_kind: str) -> RankStates:
        n, t = max(1, sh.world_size), sizes.n_trainable
        gather = 2 if sh.mixed_precision else sizes.load_itemsize   # MixedPrecisionPolicy
        red = 2 if sh.mixed_precision else (sizes.grad_bytes // t if t else 4)
        # bytes of one gathered layer: its packed 4-bit weights (float storage) as they are
        q = facts.layer_quantizable if sizes.packed_4bit else 0
        layer = (facts.layer_params - q) * gather + (q // 2 if sizes.storage_floating else 0)
        tail = facts.tail_params * gather
        in_flight = 2 if device_kind == "cuda" else 1  # CPU: no separate all-gather stream
        # backward: the tail's unsharded weight and gradient at its start, later two gathered
        # layers (current + prefetched) and one layer's unsharded gradients (of what it trains)
        # + reduce-scatter input; the tail reshards after its own backward, so the two never
        # coexist
        unit = max((tail, facts.tail_trainable * red),
                   (2 * layer, 2 * facts.layer_trainable * red), key=sum)
        if sh.stage == 3 and sh.fsdp_version == 1:
            fwd, bwd = _fsdp1_root(facts, gather, layer, in_flight, unit)
        elif sh.stage == 3:
            fwd, bwd = tail + in_flight * layer, unit[0]
        else:  # every layer stays gathered from its forward to its backward
            packed = sizes.packed_4bit if sizes.storage_floating else 0
            fwd = bwd = (facts.total_params - 2 * sizes.packed_4bit) * gather + packed
        # whole on every rank: buffers, the 4-bit quant_state, 4-bit weights FSDP leaves out
        whole = sizes.buffers + sizes.quant_constants + \
            (0 if sizes.storage_floating else sizes.packed_4bit)
        r = RankStates(
            weights=base.ceil_div(sizes.weight_bytes - whole, n) + whole,
            gradients=base.ceil_div(sizes.grad_bytes, n),
            optimizer=base.ceil_div(sizes.optimizer_state, n),
            optimizer_transient=base.ceil_div(sizes.optimizer_transient, n),
            gathered_forward=fwd, gathered_backward=bwd, grad_buffers=unit[1] if t else 0)
        if not sh.sync_each_batch:
            r.accum_gradients = t * red + r.gradients
        if sizes.upcast:
            r.notes.append(f"accelerate upcasts the {sizes.upcast:,} trainable low-precision "
                           "parameters to fp32 under FSDP mixed precision: fp32 master shards, "
                           "fp32 gradient shards and fp32 optimizer state (computed in 16-bit)")
        if sizes.packed_4bit and not sizes.storage_floating:
            r.notes.append("the 4-bit base is stored as uint8, which accelerate leaves out of "
                           "FSDP2: every rank holds all of it (bnb_4bit_quant_storage="
                           "torch.bfloat16 lets FSDP shard it)")
        if sh.offload_params:  # CPUOffloadPolicy: all three together
            r.host = r.weights - whole + r.gradients + r.optimizer
            r.weights, r.gradients, r.optimizer, r.optimizer_transient = whole, 0, 0, 0
            if r.accum_gradients is not None:
                r.accum_gradients = t * red
        return r

    def reference_share(self, sh: Sharding, ref: ReferenceSizes, facts: Any) -> tuple[int, int]:
        # TRL's prepare_fsdp: fully_shard(ref) on the root alone, one unit of every parameter
        n = max(1, sh.world_size)
        gathered = ref.n_params * (2 if sh.mixed_precision else ref.load_itemsize)
        shard = 0 if sh.offload_params else base.ceil_div(ref.weight_bytes, n)
        if sh.stage == 2:  # not resharded after a forward that no backward follows
            return shard + gathered, 0
        return shard, gathered

    def grads_sharded(self, sh: Sharding) -> bool:
        return True

    def resident_at_init_fraction(self, sh: Sharding) -> float:
        return 0.0  # the Trainer leaves it on the host until prepare (place_model_on_device)

    def traces_half(self, sh: Sharding) -> bool:
        # accelerate's MixedPrecisionPolicy gathers 16-bit parameters, and the Trainer adds no
        # autocast on that path (Accelerator.prepare skips prepare_model for FSDP2)
        return True

    def emit(self, rung: Rung, ctx: EmitContext) -> dict[str, Any]:
        sh = Sharding("fsdp", ctx.ranks, rung.stage, offload_params=rung.offload_params,
                      offload_optimizer=rung.offload_optimizer)
        out: dict[str, Any] = {"fsdp": True, "fsdp_config": fsdp_config_for(
            sh, ctx.layer_class, checkpointing=ctx.checkpointing)}
        if ctx.grad_accum > 1:  # reduce-scatter every micro-step: no unsharded gradients kept
            out["accelerator_config"] = {"gradient_accumulation_kwargs": {"sync_each_batch": True}}
        dims = ctx.dims
        if dims.cp > 1:  # accelerate's ParallelismConfig fields (Plan builds the object)
            out["parallelism_config"] = {"dp_shard_size": dims.dp_shard, "cp_size": dims.cp,
                                         "cp_comm_strategy": dims.cp_comm}
        return out

    def check_emitted(self, ta: dict[str, Any], sh: Sharding, dims: ParallelDims,
                      notes: list[str]) -> None:
        notes.append(f"{sh.label()}: a replica does not fit one GPU; launch with accelerate or "
                     "torchrun (FSDP through the Trainer needs CUDA)")
        if ta.get("activation_checkpointing") or ta.get("gradient_checkpointing"):
            notes.append("checkpointing through the Trainer, not fsdp_config: its offload of each "
                         "layer's input to host memory is the Trainer's (activation_checkpointing_"
                         "kwargs); transformers warns that the recompute all-gathers each layer "
                         "once more")
        if ta.get("accelerator_config"):
            notes.append("sync_each_batch=True: gradients are reduce-scattered every "
                         "micro-step, so accumulation never holds unsharded gradients")

    def accelerator_plugin(self, ta: dict[str, Any]) -> dict[str, Any]:
        return {"fsdp_plugin": fsdp_plugin_args(ta["fsdp_config"])} if "fsdp_config" in ta else {}

    def comm_bytes_per_step(self, sh: Sharding, **kw: Any) -> float:
        vol = base.gather_scatter_bytes(sh, **kw)
        if sh.replicas > 1:  # HSDP: the gradient shards are all-reduced across the replicas
            b = 2 if kw["mixed_precision"] else 4
            vol += 2 * (sh.replicas - 1) / sh.replicas * kw["n_trainable"] / sh.world_size * b
        return vol

    def step_overhead(self, sh: Sharding, **kw: Any) -> float:
        return base.gather_overhead(sh, **kw)

    def optimizer_shards(self, sh: Sharding) -> int:
        return sh.world_size

    def parallel_notes(self, sh: Sharding, dims: ParallelDims) -> list[str]:
        if dims.tp == 1:
            return []
        return ["accelerate 1.15 composes FSDP2 with tensor parallelism through transformers' "
                "ReplicateParallel, which transformers 5.23 no longer has; load the model with "
                "DistributedConfig(tp_size=..., fsdp_size=...) instead"]

    # -- context parallelism: the planner's split of each sequence ------------------------------
    def sequence_splits(self, degree: int, heads: Any) -> list[ParallelDims]:
        # allgather (one collective, the whole key/value held during attention) before the
        # alltoall ring (two chunks in flight): the faster first, as memory savers are taken
        return [ParallelDims(cp=degree, cp_comm=comm) for comm in CP_STRATEGIES]

    def split_rungs(self) -> list[Rung]:
        return [r for r in RUNGS if r.stage == 3]   # FSDP2 over the dp_shard x cp mesh

    def split_note(self, dims: ParallelDims, ranks: int) -> str:
        return (f"context parallelism x{dims.cp} (torch ring attention, cp_comm_strategy="
                f"{dims.cp_comm!r}; {ranks // dims.cp} data-parallel group(s)): attention runs "
                f"on SDPA, sequences are padded to a multiple of {dims.sequence_divisor} tokens, "
                "and TRL refuses packing with it")

    def split_args(self, dims: ParallelDims) -> dict[str, Any]:
        return {"fsdp": "full_shard", "fsdp_config": {"version": 2},
                "parallelism_config": {"cp_size": dims.cp}}

    def accelerate_section(self, ta: dict[str, Any]) -> dict[str, Any]:
        fsdp = {}
        for k, v in (ta.get("fsdp_config") or {}).items():
            key = _FSDP_YAML.get(k, k if k.startswith("fsdp_") else f"fsdp_{k}")
            fsdp[key] = ",".join(v) if isinstance(v, list) else v
        return {"fsdp_config": fsdp}


# fsdp_config keys whose accelerate config-file name is not ``fsdp_<key>``
_FSDP_YAML = {"cpu_offload": "fsdp_offload_params", "version": "fsdp_version"}

FSDP_ENGINE = register(FSDP())


def _fsdp1_root(facts: Any, gather: int, layer: int, in_flight: int,
                unit: tuple[int, int]) -> tuple[int, int]:
    """FSDP1's full shard (``FullyShardedDataParallel`` as accelerate wraps it: one FSDP unit
    per ``transformer_layer_cls_to_wrap`` layer, the root unit holding every parameter in no
    layer: the embedding, the final norm and the head). Returns the gathered bytes at the
    forward's and at the backward's peak.

    ``torch/distributed/fsdp/_runtime_utils.py`` ``_post_forward_reshard`` does not free the
    root's parameters after the forward ("with the intention that they are immediately used for
    backward"): the whole root stays gathered from its pre-forward to its post-backward, where
    FSDP2 (accelerate's units: the embedding alone, [norm, head]) frees the embedding after its
    forward. The backward holds what FSDP2's does (``unit``) and the rest of the root. Measured
    on 2 gloo ranks (bench/_dist_cases.py ``fsdp1-full-shard`` against ``fsdp2-full-shard``): the
    step's peak is 8.3 MB higher, the fp32 embedding (8.4 MB).

    With PEFT, transformers (``update_fsdp_plugin_peft``) wraps each trainable leaf module
    (peft's ``fsdp_auto_wrap_policy``: the LoRA A and B) as a unit of its own, so the layers' and
    the root's FlatParameters hold only frozen weights and are not upcast."""
    rest = (facts.root_params - facts.tail_params) * gather
    return facts.root_params * gather + in_flight * layer, unit[0] + rest


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
