"""Pick the fastest training setup that fits: ``plan_training`` -> ``Plan``.

Data flow: candidates (precision x optimizer x checkpointing x micro-batch x method) ->
``_cost`` (relative time per sample) -> ``estimate_for`` (memory, traces cached and
extrapolated in the micro-batch) -> the fastest candidate whose ``device_used`` fits the budget.

Fitting rules (DESIGN.md): budget = ``max_memory`` or ``total_memory x (1 - headroom)``, and no
more than ``free_memory`` when planning for the device this process runs on; the effective batch
(micro-batch x accumulation x ranks) equals ``target_batch_size`` exactly; with
``method="auto"`` full fine-tuning wins whenever some full setup fits (LoRA changes what is
trained, so it is a fallback, never a speed trick).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

from ._compat import is_bitsandbytes_available, is_flash_attn_available, is_peft_available
from ._device import DeviceInfo, probe_device, resolve_device
from ._errors import ConfigError, HfMemkitError
from ._estimate import (
    MemoryEstimate,
    TraceCache,
    _facts,
    _model_states,
    _resolve_model,
    estimate_for,
)
from ._optimizers import OptimizerContext, get_optimizer_profile
from ._setup import TrainingSetup, normalize_args, training_args_fields
from ._sharding import (
    Sharding,
    comm_seconds,
    deepspeed_config_for,
    fsdp_config_for,
    launch_commands,
    model_facts,
    rank_states,
    validate_deepspeed_config,
)
from ._units import format_bytes, parse_bytes

METHODS = ("auto", "full", "lora", "qlora")
ENGINES = ("auto", "ddp", "fsdp", "deepspeed")
# Data-parallel strategies, by tier: replicas first (fastest when they fit), then sharding, and
# offload only as the last rung (PCIe round trips every step).
PARALLEL_LABELS = {"single": "1 GPU", "pinned": "pinned engine", "ddp": "DDP", "fsdp-grad-op": "FSDP2 shard-grad-op",
                   "fsdp-full": "FSDP2 full shard", "fsdp-offload": "FSDP2 full shard + offload",
                   "zero2": "ZeRO-2", "zero3": "ZeRO-3",
                   "zero3-offload-opt": "ZeRO-3 + optimizer offload",
                   "zero3-offload": "ZeRO-3 + param/optimizer offload"}
OFFLOAD_STRATEGIES = ("fsdp-offload", "zero3-offload-opt", "zero3-offload")
# The optimizer step on the host under offload (DeepSpeed CPUAdam / torch on CPU): bytes of
# optimizer traffic per second one rank's host cores sustain (an assumption; memory-bound AVX).
HOST_OPTIM_BANDWIDTH = 20e9
# Launch latency of one NCCL collective (order of tens of microseconds on NVLink; NCCL tests),
# paid per FSDP unit and pass.
COLLECTIVE_LATENCY_S = 50e-6
# GPUs one node of the catalog cards holds (HGX/DGX boards); more need num_nodes.
MAX_GPUS_PER_NODE = 8
# LoRA defaults of the plan (peft.LoraConfig): the QLoRA paper's recipe, adapters on every linear.
LORA_DEFAULTS = dict(r=16, lora_alpha=32, lora_dropout=0.05, target_modules="all-linear")


@dataclass
class Candidate:
    """One setup the planner considered."""

    method: str                      # full | lora | qlora
    precision: str                   # bf16 | fp16 | fp32 (AMP) | pure-bf16
    optim: str
    checkpointing: bool
    micro_batch: int
    grad_accum: int
    attn: str
    rel_time: float                  # predicted time per sample, relative to the chosen one
    device_used: int | None = None   # None: not estimated (see reason)
    peak_allocated: int | None = None
    fits: bool = False
    chosen: bool = False
    reason: str = ""
    estimate: MemoryEstimate | None = field(default=None, repr=False)
    parallel: str = "single"         # single | ddp | fsdp-grad-op | fsdp-full | fsdp-offload |
    #                                  zero2 | zero3 | zero3-offload-opt | zero3-offload

    def label(self) -> str:
        parts = [self.method, self.precision, self.optim]
        if self.parallel != "single":
            parts.insert(0, PARALLEL_LABELS[self.parallel])
        if self.checkpointing:
            parts.append("checkpointing")
        parts.append(f"micro-batch {self.micro_batch} x {self.grad_accum}")
        return ", ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "estimate"}
        d["estimate"] = self.estimate.to_dict() if self.estimate else None
        return d


# ----------------------------------------------------------------------------------------------
# the cost model: relative time per sample
# ----------------------------------------------------------------------------------------------
# FLOPs per token (Kaplan et al. 2020; PaLM appendix B): forward 2N, backward 4N (input and
# weight gradients, 2N each); attention adds 12 * layers * hidden * seq per token for fwd+bwd.
# A frozen base (LoRA) skips the weight-gradient half of its backward: 4N. Checkpointing
# recomputes the forward: +2N. QLoRA dequantises every base weight in forward and backward;
# measured QLoRA throughput is ~0.7x LoRA's (Dettmers et al. 2023, Table/throughput notes), so
# its matmul work is scaled by 1/0.7.
QLORA_SLOWDOWN = 1 / 0.7
# LoRA on an LLM.int8 base: int8 matmuls with outlier decomposition. No throughput figure in
# shared/anchors; assumed between LoRA and QLoRA so the ladder orders them by memory.
INT8_SLOWDOWN = 1 / 0.8
ADAPTER_METHODS = ("lora", "lora-8bit", "qlora")   # candidate methods that train adapters
KBIT_METHODS = ("lora-8bit", "qlora")              # a quantized, frozen base
# Optimizer step time relative to fused AdamW (memory-bound: bytes moved per parameter).
OPTIM_STEP_COST = {"adamw_torch_fused": 1.0, "adamw_torch": 1.6, "adamw_bnb_8bit": 1.2,
                   "paged_adamw_8bit": 1.5, "adafactor": 2.0, "sgd": 0.5}
# Bytes moved per trainable parameter by a fused AdamW step (read p, g, m, v; write p, m, v):
# 7 x 4 B in fp32.
OPTIM_BYTES_PER_PARAM = 28
# GEMM efficiency grows with the tokens of a micro-batch and saturates (Narayanan et al. 2021:
# small micro-batches under-use tensor cores): eff = tokens / (tokens + TOKENS_HALF_EFF).
TOKENS_HALF_EFF = 512
# Micro-batches that are multiples of 8 (64 on A100-class) keep GEMM shapes tensor-core aligned
# (NVIDIA "Matrix multiplication background" guide): others pay this penalty.
MISALIGNED_PENALTY = 1.04
PER_MICRO_STEP_OVERHEAD_S = 2e-3     # launch/python overhead of one forward+backward
# Eager attention materialises the (heads x seq x seq) score matrix per layer: written by QK^T,
# read and written by softmax, read by PV in the forward, and about twice that traffic in the
# backward: ~8 passes over it, memory-bound. Fused SDPA/flash kernels keep it on chip
# (Dao et al. 2022, FlashAttention, Sec. 3).
EAGER_SCORE_PASSES = 8


def _peak_flops(dev: DeviceInfo, precision: str, tf32: bool) -> float:
    t = dev.peak_tflops or {}
    if dev.kind != "cuda" or not t:
        return 1e12  # CPU/MPS: only relative costs within one precision matter
    if precision in ("bf16", "pure-bf16"):
        return t.get("bf16", 0) * 1e12 or t.get("fp16", 1) * 1e12
    if precision == "fp16":
        return t.get("fp16", 1) * 1e12
    return (t.get("tf32") if tf32 and t.get("tf32") else t.get("fp32", 1)) * 1e12


def _cost(c: Candidate, *, n_params: int, n_trainable: int, layers: int, hidden: int,
          seq_len: int, target: int, dev: DeviceInfo, heads: int = 1,
          sharding: Sharding | None = None, nodes: int = 1) -> float:
    """Predicted seconds per sample on one rank (only ratios between candidates are used).

    ``target`` is the per-rank batch of one optimizer step. Data-parallel engines add the
    communication of a step that compute does not hide (``_sharding.comm_seconds``, from the
    catalog's interconnect bandwidth) and divide the optimizer step by the ranks that share it;
    offload steps the optimizer on the host."""
    attn_flops = 12 * layers * hidden * seq_len
    if c.method == "full":
        flops = 6 * n_params + attn_flops
    else:
        flops = 4 * n_params + 6 * n_trainable + attn_flops
    if c.checkpointing:
        flops += 2 * n_params + attn_flops / 3
    if c.method == "qlora":
        flops *= QLORA_SLOWDOWN
    elif c.method == "lora-8bit":
        flops *= INT8_SLOWDOWN
    tokens = c.micro_batch * seq_len
    eff = tokens / (tokens + TOKENS_HALF_EFF)
    align = 64 if dev.compute_capability == (8, 0) else 8
    if c.micro_batch % align and c.micro_batch < target:
        eff /= MISALIGNED_PENALTY
    compute = flops * seq_len / (_peak_flops(dev, c.precision, True) * eff)
    overhead = PER_MICRO_STEP_OVERHEAD_S / c.micro_batch
    bw = dev.memory_bandwidth or 5e10
    if c.attn == "eager":
        elem = 4 if c.precision == "fp32" else 2
        compute += EAGER_SCORE_PASSES * layers * heads * seq_len * seq_len * elem / bw
    optim = OPTIM_STEP_COST.get(c.optim, 1.5) * OPTIM_BYTES_PER_PARAM * n_trainable / bw / target
    comm = 0.0
    if sharding is not None and (sharding.engine == "fsdp" or (sharding.engine == "deepspeed"
                                                                and sharding.stage == 3)):
        # per micro-step: a collective per unit and pass (launch latency), and copying the
        # gathered parameters out of (and the gradients into) the flat collective buffers
        passes = 3 if sharding.stage == 3 else 2
        b = 4 if c.precision == "fp32" else 2
        overhead += (passes * (layers + 2) * COLLECTIVE_LATENCY_S
                     + passes * n_params * b / bw) / c.micro_batch
    if sharding is not None and sharding.engine in ("fsdp", "deepspeed"):
        shards = sharding.world_size if (sharding.engine == "fsdp" or sharding.stage >= 1) else 1
        optim /= shards
        if sharding.offload_optimizer:
            optim = OPTIM_BYTES_PER_PARAM * n_trainable / shards / HOST_OPTIM_BANDWIDTH / target
    if sharding is not None and sharding.world_size > 1:
        comm = comm_seconds(sharding, n_params=n_params, n_trainable=n_trainable,
                            grad_accum=c.grad_accum, mixed_precision=c.precision != "fp32",
                            intra_bw=dev.interconnect_bandwidth, num_nodes=nodes) / target
    return compute + overhead + optim + comm


# ----------------------------------------------------------------------------------------------
# the plan
# ----------------------------------------------------------------------------------------------


@dataclass
class Plan:
    """The chosen setup, every candidate considered, and how to apply it."""

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

    @property
    def chosen(self) -> Candidate:
        return next(c for c in self.candidates if c.chosen)

    @property
    def estimate(self) -> MemoryEstimate | None:
        return self.chosen.estimate

    # -- using it ---------------------------------------------------------------------------
    def to_training_args(self, **overrides: Any):
        """``TrainingArguments`` of the plan (build it on the target machine). An override that
        changes memory is re-estimated; if the result no longer fits, a warning shows it."""
        from transformers import TrainingArguments

        kwargs = dict(self.training_args_kwargs)
        kwargs.setdefault("output_dir", overrides.pop("output_dir", "hf_memkit_output"))
        kwargs.update(overrides)
        memory_keys = {"per_device_train_batch_size", "gradient_accumulation_steps", "bf16", "fp16",
                       "optim", "activation_checkpointing", "gradient_checkpointing",
                       "optim_args", "fsdp", "fsdp_config", "deepspeed"}
        if memory_keys & set(overrides) and self.chosen.estimate is not None:
            self._warn_if_override_does_not_fit(kwargs)
        return TrainingArguments(**kwargs)

    def _warn_if_override_does_not_fit(self, kwargs: dict[str, Any]) -> None:
        from ._estimate import estimate_memory

        fields = training_args_fields()
        args = {k: v for k, v in kwargs.items() if k in fields and k != "output_dir"}
        try:
            est = estimate_memory(self.model_name, args, seq_len=self.seq_len, device=self.device,
                                  num_gpus=self.num_gpus if self.num_gpus > 1 else None,
                                  **_estimate_kwargs(self.model_kwargs, self.peft_config))
        except Exception as exc:  # an override the estimator rejects: say so, do not block
            warnings.warn(f"could not re-estimate the overridden plan: {exc}", stacklevel=3)
            return
        if est.device_used > self.budget:
            warnings.warn(
                f"with these overrides the setup needs {format_bytes(est.device_used)}, over the "
                f"budget of {format_bytes(self.budget)} on {self.device.name}:\n{est.explain()}",
                stacklevel=3)

    def prepare(self, model: torch.nn.Module) -> torch.nn.Module:
        """Apply the plan to a loaded model: attention kernel, k-bit preparation, LoRA and
        checkpointing (non-reentrant, safe with PEFT)."""
        attn = self.model_kwargs.get("attn_implementation")
        if attn and hasattr(model, "set_attn_implementation"):
            try:
                model.set_attn_implementation(attn)
            except Exception as exc:  # the loaded model may not support it: keep its own
                warnings.warn(f"kept the model's attention ({exc})", stacklevel=2)
        # under FSDP, fsdp_config's activation_checkpointing applies it when accelerate wraps
        ckpt = self.chosen.checkpointing and self.parallel.get("engine") != "fsdp"
        if self.chosen.method in ADAPTER_METHODS:
            import peft

            if self.chosen.method in KBIT_METHODS:
                model = peft.prepare_model_for_kbit_training(
                    model, use_gradient_checkpointing=ckpt,
                    gradient_checkpointing_kwargs={"use_reentrant": False})
            model = peft.get_peft_model(model, copy.deepcopy(self.peft_config))
            if ckpt:
                model.enable_input_require_grads()
        if ckpt:
            from ._trace import enable_checkpointing

            base = model.get_base_model() if hasattr(model, "get_base_model") else model
            enable_checkpointing(base, {"use_reentrant": False})
        return model

    def launch_commands(self, script: str = "train.py") -> dict[str, str]:
        """``accelerate launch`` and ``torchrun`` command lines for this plan's GPUs and nodes.
        (With DeepSpeed, write the config first: ``write_deepspeed_config``.)"""
        engine = self.parallel.get("engine", "none")
        return launch_commands(script=script, num_gpus=self.num_gpus, num_nodes=self.num_nodes,
                               engine=engine, config_file="ds_config.json"
                               if engine == "deepspeed" else None)

    def write_deepspeed_config(self, path: str | os.PathLike = "ds_config.json") -> str:
        """Write the plan's DeepSpeed config as JSON (pass it as ``deepspeed=path`` too)."""
        cfg = self.training_args_kwargs.get("deepspeed")
        if not isinstance(cfg, dict):
            raise HfMemkitError(f"this plan uses {self.parallel.get('label', 'no DeepSpeed')}; "
                                "plan with engine='deepspeed' for a DeepSpeed config")
        with open(path, "w", encoding="utf-8") as f:
            json.dump(cfg, f, indent=2)
        return str(path)

    # -- reading it ---------------------------------------------------------------------------
    def explain(self) -> str:
        from ._render import plan_tables, render_to_text

        return render_to_text(*plan_tables(self))

    def __str__(self) -> str:
        return self.explain()

    def to_dict(self) -> dict[str, Any]:
        return {
            "device": self.device.to_dict(), "model_name": _model_ref_to_json(self.model_name),
            "seq_len": self.seq_len,
            "target_batch_size": self.target_batch_size, "num_gpus": self.num_gpus,
            "method": self.method, "budget": self.budget,
            "training_args_kwargs": self.training_args_kwargs,
            "model_kwargs": _jsonable_model_kwargs(self.model_kwargs),
            "peft_config": _peft_to_dict(self.peft_config),
            "accelerator_kwargs": self.accelerator_kwargs,
            "candidates": [c.to_dict() for c in self.candidates], "notes": list(self.notes),
            "num_nodes": self.num_nodes, "parallel": self.parallel,
        }

    def to_json(self, **kw: Any) -> str:
        return json.dumps(self.to_dict(), **kw)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Plan:
        cands = []
        for c in d["candidates"]:
            c = dict(c)
            est = c.pop("estimate", None)
            cand = Candidate(**c)
            if est is not None:
                cand.estimate = _estimate_from_dict(est)
            cands.append(cand)
        return cls(
            device=DeviceInfo.from_dict(d["device"]),
            model_name=_model_ref_from_json(d["model_name"]),
            seq_len=d["seq_len"], target_batch_size=d["target_batch_size"],
            num_gpus=d["num_gpus"], method=d["method"], budget=d["budget"],
            training_args_kwargs=dict(d["training_args_kwargs"]),
            model_kwargs=_model_kwargs_from_json(d["model_kwargs"]),
            peft_config=_peft_from_dict(d["peft_config"]),
            accelerator_kwargs=dict(d["accelerator_kwargs"]), candidates=cands,
            notes=list(d.get("notes", [])), num_nodes=d.get("num_nodes", 1),
            parallel=dict(d.get("parallel", {})))

    @classmethod
    def from_json(cls, text: str) -> Plan:
        return cls.from_dict(json.loads(text))


def _model_ref_to_json(ref: Any) -> Any:
    if isinstance(ref, str):
        return ref
    return {"config": ref.to_dict()}


def _model_ref_from_json(ref: Any) -> Any:
    if isinstance(ref, str):
        return ref
    from transformers import AutoConfig

    d = dict(ref["config"])
    return AutoConfig.for_model(d.pop("model_type"), **d)


def _estimate_from_dict(d: dict[str, Any]) -> MemoryEstimate:
    from ._setup import Sharding

    setup = dict(d["setup"])
    setup["sharding"] = Sharding(**setup["sharding"])
    setup["unmodelled"] = tuple(setup.get("unmodelled", ()))
    setup["notes"] = tuple(setup.get("notes", ()))
    return MemoryEstimate(
        peak_allocated=d["peak_allocated"], peak_reserved=d["peak_reserved"],
        device_used=d["device_used"], breakdown=dict(d["breakdown"]), peak_phase=d["peak_phase"],
        stage=d["stage"], device=DeviceInfo.from_dict(d["device"]),
        setup=TrainingSetup(**setup), seq_len=d["seq_len"], uncertainty=d["uncertainty"],
        notes=list(d["notes"]), model_states=d.get("model_states", 0),
        host_offloaded=d.get("host_offloaded", 0))


def _jsonable_model_kwargs(mk: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for k, v in mk.items():
        if isinstance(v, torch.dtype):
            out[k] = str(v).replace("torch.", "")
        elif k == "quantization_config" and v is not None:
            out[k] = v.to_dict() if hasattr(v, "to_dict") else dict(v)
        else:
            out[k] = v
    return out


def _model_kwargs_from_json(d: dict[str, Any]) -> dict[str, Any]:
    out = dict(d)
    if isinstance(out.get("dtype"), str):
        out["dtype"] = getattr(torch, out["dtype"])
    if out.get("quantization_config"):
        from transformers import BitsAndBytesConfig

        out["quantization_config"] = BitsAndBytesConfig.from_dict(out["quantization_config"])
    return out


def _peft_to_dict(cfg: Any) -> dict[str, Any] | None:
    if cfg is None:
        return None
    d = cfg.to_dict()
    return json.loads(json.dumps(d, default=lambda o: sorted(o) if isinstance(o, set) else str(o)))


def _peft_from_dict(d: dict[str, Any] | None) -> Any:
    if d is None:
        return None
    import peft

    return peft.LoraConfig(**{k: v for k, v in d.items() if k in
                              {f.name for f in dataclasses.fields(peft.LoraConfig)} and
                              k not in ("peft_type", "auto_mapping", "revision")})


def _estimate_kwargs(model_kwargs: dict[str, Any], peft_config: Any) -> dict[str, Any]:
    # a k-bit base loads in half precision, then prepare_model_for_kbit_training upcasts every
    # non-quantized parameter to fp32: the estimate takes the trained dtype (None = fp32)
    quant = model_kwargs.get("quantization_config")
    return {"dtype": None if quant is not None else model_kwargs.get("dtype"),
            "attn_implementation": model_kwargs.get("attn_implementation"),
            "quantization_config": model_kwargs.get("quantization_config"),
            "peft_config": peft_config}


# ----------------------------------------------------------------------------------------------
# plan_training
# ----------------------------------------------------------------------------------------------


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _budget(dev: DeviceInfo, headroom: float, max_memory: Any, probed: bool) -> int:
    if max_memory is not None:
        return parse_bytes(max_memory)
    budget = int(dev.total_memory * (1 - headroom))
    if probed and dev.free_memory is not None:  # this process's device: what is free now
        budget = min(budget, dev.free_memory)
    return budget


def _host_ram() -> int | None:
    """This machine's RAM (``MemTotal``), or None where /proc is missing."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _precisions(dev: DeviceInfo) -> list[str]:
    if dev.kind == "cuda":
        if dev.supports_bf16:
            return ["bf16", "pure-bf16"]
        if dev.supports_fp16_tensor_cores:
            return ["fp16"]
        return ["fp32"]
    return ["fp32"]  # CPU/MPS: AMP rarely speeds up and bf16 is emulated on most CPUs


def _optimizers(dev: DeviceInfo) -> list[str]:
    opts = ["adamw_torch_fused"]
    if is_bitsandbytes_available():
        opts.append("adamw_bnb_8bit")
    opts.append("adafactor")
    if is_bitsandbytes_available() and dev.kind == "cuda":
        opts.append("paged_adamw_8bit")
    return opts


def _attention(spec: Any, dev: DeviceInfo, precision: str) -> tuple[str, str]:
    supported = {"sdpa": getattr(spec.model_cls, "_supports_sdpa", False),
                 "flash_attention_2": getattr(spec.model_cls, "_supports_flash_attn", False)}
    if (supported["flash_attention_2"] and is_flash_attn_available() and dev.kind == "cuda"
            and dev.compute_capability and dev.compute_capability >= (8, 0)
            and precision in ("bf16", "fp16", "pure-bf16")):
        return "flash_attention_2", "flash-attn is installed and this GPU supports it"
    if supported["sdpa"]:
        why = "torch SDPA (flash/memory-efficient kernels)"
        if dev.kind == "cuda" and not is_flash_attn_available():
            why += "; flash_attention_2 not installed"
        return "sdpa", why
    try:
        import optimum.bettertransformer  # noqa: F401  (optimum < 2 only)

        return "eager", "model has no native SDPA; optimum's BetterTransformer is installed but " \
                        "not applied automatically"
    except ImportError:
        return "eager", "model has no native SDPA kernel; optimum 2.x has no BetterTransformer"


def _strategies(ranks: int, engine: str, method: str) -> list[str]:
    if ranks == 1:
        return ["single"]
    if method in KBIT_METHODS or engine == "ddp":
        return ["ddp"]  # sharding a frozen k-bit base (FSDP-QLoRA) is not planned
    if method == "lora":  # a frozen 16-bit base shards like any other weights
        return ["ddp", "zero3"] if engine == "deepspeed" else ["ddp", "fsdp-grad-op", "fsdp-full"]
    if engine == "deepspeed":
        return ["ddp", "zero2", "zero3", "zero3-offload-opt", "zero3-offload"]
    return ["ddp", "fsdp-grad-op", "fsdp-full", "fsdp-offload"]


def _tier(parallel: str) -> int:
    """Offload is the last rung. DDP and sharding are ranked together by the cost model, in
    which DDP wins whenever a replica fits without slower memory savers: sharding pays a
    collective per layer and copies in and out of its flat buffers every micro-step."""
    return 1 if parallel in OFFLOAD_STRATEGIES else 0


def _parallel_args(parallel: str, *, ranks: int, micro_batch: int, grad_accum: int,
                   precision: str, checkpointing: bool, hidden: int, layer_class: str | None,
                   max_grad_norm: float) -> dict[str, Any]:
    """The TrainingArguments fields that select and configure the engine."""
    if parallel == "pinned":
        return {}  # the user's own fsdp / deepspeed pins configure it
    if parallel in ("single", "ddp"):
        return {"ddp_find_unused_parameters": False} if parallel == "ddp" else {}
    if parallel.startswith("fsdp"):
        sh = Sharding("fsdp", ranks, 2 if parallel == "fsdp-grad-op" else 3,
                      offload_params=parallel == "fsdp-offload",
                      offload_optimizer=parallel == "fsdp-offload")
        out: dict[str, Any] = {"fsdp": True, "fsdp_config": fsdp_config_for(
            sh, layer_class, checkpointing=checkpointing)}
        if grad_accum > 1:  # reduce-scatter every micro-step: no unsharded gradients kept
            out["accelerator_config"] = {"gradient_accumulation_kwargs": {"sync_each_batch": True}}
        return out
    stage = 2 if parallel == "zero2" else 3
    sh = Sharding("deepspeed", ranks, stage, offload_optimizer="offload" in parallel,
                  offload_params=parallel == "zero3-offload")
    return {"deepspeed": deepspeed_config_for(
        sh, micro_batch=micro_batch, grad_accum=grad_accum, precision=precision, hidden=hidden,
        max_grad_norm=max_grad_norm)}


def plan_training(model: Any, *, seq_len: int, target_batch_size: int, device: Any = None,
                  num_gpus: int | None = None, method: str = "auto", headroom: float = 0.1,
                  max_memory: int | str | None = None, task: str | None = None,
                  num_nodes: int = 1, engine: str = "auto", host_memory: int | str | None = None,
                  **constraints: Any) -> Plan:
    """Choose the fastest setup whose predicted ``device_used`` fits the memory budget.

    ``constraints`` pin TrainingArguments fields (e.g. ``optim="adamw_torch_fused"``,
    ``activation_checkpointing=False``) or restrict the search (``micro_batch=4``).
    ``num_gpus`` ranks over ``num_nodes`` nodes: DDP when a replica fits, else FSDP2
    (``engine="fsdp"``, the default) or DeepSpeed ZeRO (``engine="deepspeed"``) sharding, and
    CPU offload only as the last rung; ``engine="ddp"`` never shards. ``host_memory`` (bytes or
    "512GiB", per node) bounds what offload may keep in CPU RAM; planning for this machine it
    defaults to its RAM, for a catalog GPU offload is only noted with what it needs.
    """
    problems = []
    if method not in METHODS:
        problems.append(f"method `{method}` is not one of {', '.join(METHODS)}")
    if not isinstance(seq_len, int) or seq_len <= 0:
        problems.append(f"seq_len must be a positive integer, got {seq_len!r}")
    if not isinstance(target_batch_size, int) or target_batch_size <= 0:
        problems.append(f"target_batch_size must be a positive integer, got {target_batch_size!r}")
    if not 0 <= headroom < 1:
        problems.append(f"headroom must be in [0, 1), got {headroom!r}")
    if engine not in ENGINES:
        problems.append(f"engine `{engine}` is not one of {', '.join(ENGINES)}")
    probed = device is None
    dev = probe_device() if probed else resolve_device(device)
    ok = True
    for name, v in (("num_gpus", num_gpus), ("num_nodes", num_nodes)):
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            problems.append(f"{name} must be a positive integer, got {v!r}")
            ok = False
    ranks = (num_gpus or 1) if ok else 1
    nodes = num_nodes if ok else 1
    if ok and ranks % nodes:
        problems.append(f"num_gpus={ranks} is not a multiple of num_nodes={nodes}; give the "
                        "total GPU count over all nodes")
    per_node = ranks // nodes if ok else 1
    if ok and probed and ranks > 1 and dev.kind != "cuda":
        problems.append(f"num_gpus={ranks} but this machine has no CUDA GPU ({dev.name}); "
                        "plan for a catalog GPU with device='H100-80GB' (see list_devices())")
    elif ok and probed and dev.kind == "cuda" and per_node > dev.count:
        problems.append(f"num_gpus={ranks} but this machine shows {dev.count} GPU(s) "
                        f"({per_node} needed per node over {nodes} node(s)); use num_gpus<="
                        f"{dev.count * nodes} or more nodes")
    elif ok and not probed and dev.kind == "cuda" and per_node > MAX_GPUS_PER_NODE:
        problems.append(f"num_gpus={ranks} on {nodes} node(s) is {per_node} {dev.name} per node; "
                        f"a node holds at most {MAX_GPUS_PER_NODE}: set num_nodes="
                        f"{-(-ranks // MAX_GPUS_PER_NODE)}")
    if isinstance(target_batch_size, int) and target_batch_size > 0 and target_batch_size % ranks:
        lo = target_batch_size - target_batch_size % ranks
        valid = [v for v in (lo, lo + ranks) if v > 0]
        problems.append(f"target_batch_size {target_batch_size} is not divisible by {ranks} "
                        f"ranks; nearest valid targets: {', '.join(map(str, valid))}")
    fields = training_args_fields()
    pins = {k: v for k, v in constraints.items() if k in fields}
    search = {k: v for k, v in constraints.items() if k not in fields}
    for k in search:
        if k not in ("micro_batch",):
            problems.append(f"unknown constraint `{k}`: give TrainingArguments fields or "
                            "micro_batch")
    if method in ("lora", "qlora") and not is_peft_available():
        problems.append(f"method `{method}` needs peft: pip install 'hf-memkit[peft]'")
    if method == "qlora" and not is_bitsandbytes_available():
        problems.append("method `qlora` needs bitsandbytes: pip install 'hf-memkit[bnb]'")
    if problems:
        raise ConfigError(problems, source="plan_training")
    budget = _budget(dev, headroom, max_memory, probed)
    host_budget = parse_bytes(host_memory) if host_memory is not None else (
        _host_ram() if probed else None)
    notes: list[str] = []

    # the ladder: full, LoRA, LoRA on an 8-bit base, QLoRA; method="lora" covers both LoRA rungs
    methods = {"auto": ["full", "lora", "lora-8bit", "qlora"], "full": ["full"],
               "lora": ["lora", "lora-8bit"], "qlora": ["qlora"]}[method]
    methods = [m for m in methods if m == "full" or is_peft_available()]
    methods = [m for m in methods if m not in KBIT_METHODS or is_bitsandbytes_available()]
    per_rank = target_batch_size // ranks
    micro_batches = [search["micro_batch"]] if "micro_batch" in search else _divisors(per_rank)
    if "per_device_train_batch_size" in pins:
        micro_batches = [pins["per_device_train_batch_size"]]
    bad = [m for m in micro_batches if per_rank % m]
    if bad:
        raise ConfigError([f"micro-batch {bad[0]} does not divide the per-rank batch {per_rank}"],
                          source="plan_training")

    cache = TraceCache()
    specs: dict[tuple[str, str], Any] = {}
    candidates: list[Candidate] = []
    meta_cache: dict = {}
    base_spec = _resolve_model(model, task=task, dtype=None, attn_implementation=None,
                               peft_config=None, quantization_config=None)
    supports_ckpt = base_spec.supports_checkpointing
    if not supports_ckpt:
        notes.append(f"{base_spec.model_cls.__name__} does not support gradient checkpointing; "
                     "the plan never enables it")
    n_params = sum(p.numel() for p in base_spec.meta.parameters())
    from ._profile import architecture_facts

    facts = architecture_facts(base_spec.config)
    layers, hidden = facts["num_layers"] or 1, facts["hidden_size"] or 1
    precisions = _precisions(dev)
    if "bf16" in pins or "fp16" in pins:
        precisions = ["bf16" if pins.get("bf16") else "fp16" if pins.get("fp16") else "fp32"]
    optimizers = [pins["optim"]] if "optim" in pins else _optimizers(dev)
    ckpt_pin = pins.get("activation_checkpointing", pins.get("gradient_checkpointing"))
    ckpts = [bool(ckpt_pin)] if ckpt_pin is not None else ([False, True] if supports_ckpt else [False])
    if not supports_ckpt and True in ckpts:
        raise HfMemkitError(f"{base_spec.model_cls.__name__} does not support gradient "
                            "checkpointing; drop the activation_checkpointing pin")
    attn_choice: dict[str, tuple[str, str]] = {}

    def spec_for(meth: str, precision: str):
        key = (meth, precision)
        if key not in specs:
            dtype = _load_dtype(meth, precision, dev)
            attn = _attention(base_spec, dev, precision)
            attn_choice[precision] = attn
            peft_cfg = quant = None
            if meth in ADAPTER_METHODS:
                import peft

                peft_cfg = peft.LoraConfig(**LORA_DEFAULTS, task_type=_peft_task(base_spec.task))
            if meth == "lora-8bit":
                from transformers import BitsAndBytesConfig

                quant = BitsAndBytesConfig(load_in_8bit=True)
            if meth == "qlora":
                from transformers import BitsAndBytesConfig

                quant = BitsAndBytesConfig(
                    load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                    bnb_4bit_compute_dtype=torch.bfloat16 if dev.supports_bf16 else torch.float16)
            specs[key] = (_resolve_model(model, task=task, dtype=dtype,
                                         attn_implementation=attn[0], peft_config=peft_cfg,
                                         quantization_config=quant, meta_cache=meta_cache),
                          peft_cfg, quant)
        return specs[key]

    pinned_engine = any(pins.get(k) for k in ("fsdp", "deepspeed"))
    layer_class = model_facts(base_spec.meta).layer_class
    for meth in methods:
        for par in (["pinned"] if pinned_engine else _strategies(ranks, engine, meth)):
            for precision in precisions:
                if meth != "full" and precision == "pure-bf16":
                    continue  # adapters train in fp32 under AMP; a bf16 base is the LoRA default
                if par.startswith("zero") and precision not in ("bf16", "fp16"):
                    continue  # DeepSpeed is planned in 16-bit with fp32 master weights
                for optim in optimizers:
                    if par not in ("single", "ddp", "pinned") and optim not in (
                            "adamw_torch_fused", "adamw_torch") and "optim" not in pins:
                        continue  # sharded/offloaded states: torch AdamW (DTensor, DeepSpeed)
                    for ckpt in ckpts:
                        for mb in micro_batches:
                            attn = _attention(base_spec, dev, precision)[0]
                            candidates.append(Candidate(meth, precision, optim, ckpt, mb,
                                                        per_rank // mb, attn, 0.0, parallel=par))

    n_trainable_of: dict[str, int] = {}

    def args_of(c: Candidate) -> dict[str, Any]:
        args = dict(pins)
        args.update(per_device_train_batch_size=c.micro_batch, gradient_accumulation_steps=c.grad_accum,
                    optim=c.optim, bf16=c.precision == "bf16", fp16=c.precision == "fp16")
        args.pop("gradient_checkpointing", None)
        args["activation_checkpointing"] = c.checkpointing
        if c.checkpointing:
            args["activation_checkpointing_kwargs"] = {"use_reentrant": False}
        args.setdefault("per_device_eval_batch_size", c.micro_batch)
        if c.parallel.startswith("fsdp") and c.checkpointing:
            args["activation_checkpointing"] = False  # FSDP's own (fsdp_config), as transformers
            args.pop("activation_checkpointing_kwargs")  # asks; same memory
        args.update(_parallel_args(c.parallel, ranks=ranks, micro_batch=c.micro_batch,
                                   grad_accum=c.grad_accum, precision=c.precision,
                                   checkpointing=c.checkpointing, hidden=hidden,
                                   layer_class=layer_class,
                                   max_grad_norm=float(pins.get("max_grad_norm", 1.0))))
        return args

    def setup_of(c: Candidate) -> TrainingSetup:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return normalize_args(args_of(c), source="plan", num_gpus=ranks)

    # model states alone (no trace): cheap lower bound that prunes hopeless setups
    shardings: dict[tuple, Sharding] = {}
    for c in candidates:
        spec, _, _ = spec_for(c.method, c.precision)
        weights, trainable = _model_states(spec)
        n_trainable_of[c.method] = sum(p.numel for p in trainable)
        om = get_optimizer_profile(c.optim).estimate(trainable, OptimizerContext(dev.kind))
        skey = (c.parallel, c.precision, c.grad_accum > 1)
        if skey not in shardings:
            shardings[skey] = setup_of(c).sharding
        sh = shardings[skey]
        rs = rank_states(sh, weight_bytes=weights, grad_bytes=sum(p.nbytes for p in trainable),
                         n_trainable=n_trainable_of[c.method], optimizer_state=om.state,
                         optimizer_transient=0, facts=_facts(spec)
                         if sh.engine in ("fsdp", "deepspeed") else None,
                         device_kind=dev.kind, load_itemsize=spec.dtype.itemsize)
        states = rs.model_states + rs.buckets
        c.rel_time = _cost(c, n_params=n_params, n_trainable=n_trainable_of[c.method],
                           layers=layers, hidden=hidden, seq_len=seq_len, target=per_rank, dev=dev,
                           heads=facts["num_attention_heads"] or 1, sharding=sh, nodes=nodes)
        if host_budget is not None and rs.host * (ranks // nodes) > host_budget:
            c.reason = (f"offload needs {format_bytes(rs.host * (ranks // nodes))} of host RAM "
                        f"per node > {format_bytes(host_budget)}")
        elif states > budget:
            c.reason = (f"weights + gradients + optimizer state alone need "
                        f"{format_bytes(states)} > budget {format_bytes(budget)}")

    # estimate in order of method preference, then speed; stop a method once its fastest fit
    # is known and every faster candidate was estimated
    chosen = None
    for meth in methods:
        for tier in (0, 1):  # DDP or sharding (by cost), then offload as the last rung
            pool = sorted((c for c in candidates if c.method == meth and not c.reason
                           and _tier(c.parallel) == tier), key=lambda c: c.rel_time)
            for c in pool:
                spec, _, _ = spec_for(c.method, c.precision)
                setup = setup_of(c)
                est = estimate_for(spec, setup, dev, seq_len=seq_len, cache=cache, exact=False)
                if est.lower_bound and est.device_used <= budget:  # verify before accepting
                    est = estimate_for(spec, setup, dev, seq_len=seq_len, cache=cache)
                c.estimate, c.device_used, c.peak_allocated = est, est.device_used, est.peak_allocated
                host = est.host_offloaded * (ranks // nodes)
                c.fits = est.device_used <= budget and (host_budget is None or host <= host_budget)
                if c.fits:
                    chosen = c
                    break
                at_least = "at least " if est.lower_bound else ""
                c.reason = (f"needs {at_least}{format_bytes(est.device_used)} > budget "
                            f"{format_bytes(budget)}"
                            if est.device_used > budget else
                            f"offload needs {format_bytes(host)} of host RAM per node > "
                            f"{format_bytes(host_budget)}")
            if chosen:
                break
        if chosen:
            break
        if meth == "full" and method == "auto" and len(methods) > 1:
            notes.append("no full fine-tuning setup fits; falling back to LoRA, which trains "
                         "adapters instead of all weights")
    if chosen is None:
        _raise_impossible(candidates, budget, dev, seq_len, spec_for, setup_of, cache)
    chosen.chosen = True
    chosen.reason = "fastest setup that fits"
    for c in candidates:
        if not c.reason and c.estimate is None:
            c.reason = "not estimated: slower than the chosen setup" if (
                c.method == chosen.method) else (
                "not needed: a full fine-tuning setup fits" if chosen.method == "full"
                else "not estimated")
    base_time = chosen.rel_time
    for c in candidates:
        c.rel_time = c.rel_time / base_time

    spec, peft_cfg, quant = spec_for(chosen.method, chosen.precision)
    eval_batch = _eval_batch(spec, setup_of(chosen), dev, seq_len, budget, cache)
    attn, attn_why = attn_choice[chosen.precision]
    notes.append(f"attention: {attn} ({attn_why})")
    if chosen.method == "lora-8bit":
        notes.append("LoRA on an 8-bit (LLM.int8) base: activations are traced with the base as "
                     "frozen linears; the int8 kernels' own temporaries are not modelled")
    if chosen.precision == "pure-bf16":
        notes.append("pure bf16: weights, gradients and optimizer state in bf16 with no fp32 "
                     "master copy (as torchtune defaults to); saves memory but changes numerics")
    if chosen.micro_batch < per_rank:
        notes.append(f"micro-batch {chosen.micro_batch} x {chosen.grad_accum} accumulation steps "
                     f"x {ranks} rank(s) = {target_batch_size}")
    ta = _training_args(chosen, pins, dev, eval_batch, ranks)
    ta.update(_parallel_args(chosen.parallel, ranks=ranks, micro_batch=chosen.micro_batch,
                             grad_accum=chosen.grad_accum, precision=chosen.precision,
                             checkpointing=chosen.checkpointing, hidden=hidden,
                             layer_class=layer_class,
                             max_grad_norm=float(pins.get("max_grad_norm", 1.0))))
    if chosen.parallel.startswith("fsdp") and chosen.checkpointing:
        for k in ("activation_checkpointing", "gradient_checkpointing"):  # fsdp_config's own
            if k in ta:
                ta[k] = False
            ta.pop(k + "_kwargs", None)
    parallel = _parallel_summary(chosen, ta, setup_of(chosen).sharding, nodes, notes,
                                 chosen.estimate)
    mk = {"attn_implementation": attn}
    load_dtype = _load_dtype(chosen.method, chosen.precision, dev)
    if chosen.method in KBIT_METHODS:  # loaded in half precision; prepare_model_for_kbit_training
        load_dtype = torch.bfloat16 if dev.supports_bf16 else torch.float16  # upcasts the rest
    if load_dtype is not None:
        mk["dtype"] = load_dtype
    if quant is not None:
        mk["quantization_config"] = quant
    acc = {"mixed_precision": {"bf16": "bf16", "fp16": "fp16"}.get(chosen.precision, "no"),
           "gradient_accumulation_steps": chosen.grad_accum,
           "optimizer": _optimizer_recipe(chosen.optim)}
    if "fsdp_config" in ta:
        from ._sharding import fsdp_plugin_args

        acc["fsdp_plugin"] = fsdp_plugin_args(ta["fsdp_config"])
    if "deepspeed" in ta and isinstance(ta["deepspeed"], dict):
        acc["deepspeed_plugin"] = {"hf_ds_config": ta["deepspeed"]}
    return Plan(device=dev, model_name=_model_name(model, base_spec), seq_len=seq_len,
                target_batch_size=target_batch_size, num_gpus=ranks, method=method,
                budget=budget, training_args_kwargs=ta, model_kwargs=mk, peft_config=peft_cfg,
                accelerator_kwargs=acc, candidates=candidates, notes=notes, num_nodes=nodes,
                parallel=parallel)


def _parallel_summary(c: Candidate, ta: dict[str, Any], sh: Sharding, nodes: int,
                      notes: list[str], est: MemoryEstimate | None) -> dict[str, Any]:
    """What the plan says about running on several GPUs (and checks its emitted configs)."""
    if c.parallel == "single":
        return {}
    out: dict[str, Any] = {"strategy": c.parallel, "engine": sh.engine, "label": sh.label(),
                           "num_nodes": nodes}
    if sh.engine == "ddp":
        notes.append(f"DDP: every rank holds a full replica ({sh.world_size} ranks); it fits, so "
                     "no sharding (the fastest data-parallel engine)")
    elif sh.engine == "fsdp":
        notes.append(f"{sh.label()}: a replica does not fit one GPU; launch with accelerate or "
                     "torchrun (FSDP through the Trainer needs CUDA)")
        if ta.get("accelerator_config"):
            notes.append("sync_each_batch=True: gradients are reduce-scattered every micro-step, "
                         "so accumulation never holds unsharded gradients")
    else:
        validate_deepspeed_config(ta["deepspeed"], world_size=sh.world_size)
        notes.append(f"{sh.label()}: DeepSpeed config in training_args_kwargs['deepspeed'] "
                     "(write it with Plan.write_deepspeed_config)")
    if est is not None and est.host_offloaded:
        per_node = est.host_offloaded * (sh.world_size // max(1, nodes))
        notes.append(f"offload keeps {format_bytes(per_node)} in host RAM per node "
                     f"({format_bytes(est.host_offloaded)} per rank); check the nodes have it")
        out["host_memory_per_node"] = per_node
    return out


def _load_dtype(method: str, precision: str, dev: DeviceInfo) -> torch.dtype | None:
    """The dtype weights are loaded in (None: fp32, transformers' from_config default).

    pure-bf16: everything bf16. LoRA on a GPU: the frozen base in half precision (peft keeps
    the adapters in fp32). QLoRA: None here, because prepare_model_for_kbit_training upcasts
    every non-quantized parameter to fp32 (the estimate follows it)."""
    if precision == "pure-bf16":
        return torch.bfloat16
    if method == "lora" and dev.kind == "cuda":
        return torch.bfloat16 if dev.supports_bf16 else torch.float16
    return None


def _model_name(model: Any, spec: Any) -> Any:
    if isinstance(model, (str, os.PathLike)):
        return str(model)
    return spec.config  # a config or a model: keep its config (re-estimates use it)


def _peft_task(task: str) -> str | None:
    return {"causal-lm": "CAUSAL_LM", "seq2seq-lm": "SEQ_2_SEQ_LM",
            "sequence-classification": "SEQ_CLS", "token-classification": "TOKEN_CLS",
            "question-answering": "QUESTION_ANS"}.get(task)


def _optimizer_recipe(optim: str) -> dict[str, Any]:
    return {"adamw_torch_fused": {"class": "torch.optim.AdamW", "kwargs": {"fused": True}},
            "adamw_torch": {"class": "torch.optim.AdamW", "kwargs": {}},
            "adamw_bnb_8bit": {"class": "bitsandbytes.optim.AdamW8bit", "kwargs": {}},
            "paged_adamw_8bit": {"class": "bitsandbytes.optim.PagedAdamW8bit", "kwargs": {}},
            "adafactor": {"class": "transformers.Adafactor",
                          "kwargs": {"scale_parameter": False, "relative_step": False}},
            }.get(optim, {"class": optim, "kwargs": {}})


def _training_args(c: Candidate, pins: dict[str, Any], dev: DeviceInfo, eval_batch: int,
                   ranks: int) -> dict[str, Any]:
    fields = training_args_fields()
    ckpt_field = "activation_checkpointing" if "activation_checkpointing" in fields else \
        "gradient_checkpointing"
    ta: dict[str, Any] = {
        "per_device_train_batch_size": c.micro_batch,
        "gradient_accumulation_steps": c.grad_accum,
        "per_device_eval_batch_size": eval_batch,
        "optim": c.optim,
        "bf16": c.precision == "bf16",
        "fp16": c.precision == "fp16",
        ckpt_field: c.checkpointing,
    }
    if c.checkpointing:
        ta[ckpt_field + "_kwargs"] = {"use_reentrant": False}
    if dev.kind == "cuda" and dev.supports_tf32:
        ta["tf32"] = True
    if dev.kind == "cpu":
        ta["use_cpu"] = True
    ta["dataloader_pin_memory"] = dev.kind == "cuda"
    ta["dataloader_num_workers"] = min(4, max(0, (os.cpu_count() or 1) // max(1, ranks) - 1)) \
        if dev.kind == "cuda" else 0
    ta["eval_accumulation_steps"] = 8
    ta.update(pins)
    return ta


def _eval_batch(spec: Any, setup: TrainingSetup, dev: DeviceInfo, seq_len: int, budget: int,
                cache: TraceCache) -> int:
    """The largest power of two (<= 4 x the micro-batch) whose eval step fits: searched on
    the cache's lower bounds, then confirmed by an exact trace (stepping down if needed)."""
    def used(b: int, exact: bool) -> int:
        return estimate_for(spec, setup.replace(eval_batch=b), dev, seq_len=seq_len,
                            stage="eval", cache=cache, exact=exact).device_used

    best, b = 1, 2
    while b <= 4 * setup.micro_batch and used(b, exact=False) <= budget:
        best, b = b, b * 2
    while best > 1 and used(best, exact=True) > budget:
        best //= 2
    return best


def _raise_impossible(candidates, budget, dev, seq_len, spec_for, setup_of, cache) -> None:
    """Say the smallest memory any setup needs, and which setup that is."""
    best = None
    for c in candidates:
        if c.micro_batch != 1 and c.estimate is None:
            continue
        if c.estimate is None:
            spec, _, _ = spec_for(c.method, c.precision)
            try:
                c.estimate = estimate_for(spec, setup_of(c), dev, seq_len=seq_len, cache=cache)
            except HfMemkitError:
                continue
            c.device_used = c.estimate.device_used
        if best is None or c.device_used < best.device_used:
            best = c
    if best is None:
        raise HfMemkitError("no setup could be estimated for this model")
    tried = {c.method for c in candidates}
    qlora = "" if "qlora" in tried else ", method='qlora'"
    if best.reason.startswith("offload needs") and best.device_used <= budget:
        raise HfMemkitError(
            f"the only setups that fit {dev.name} offload to CPU RAM, and {best.label()} "
            f"{best.reason[len('offload '):]}; give host_memory= if the nodes have more RAM, or "
            f"use more GPUs, a shorter seq_len{qlora}")
    raise HfMemkitError(
        f"needs at least {format_bytes(best.device_used)} with {best.label()} at seq {seq_len}; "
        f"{dev.name} has {format_bytes(budget)} usable; try a shorter seq_len{qlora}, more "
        "GPUs or a larger GPU")


def auto_training_args(model: Any, **kwargs: Any):
    """``plan_training(model, **kwargs).to_training_args()``; ``output_dir`` and other
    TrainingArguments that do not change memory may be passed and are applied as overrides."""
    overrides = {k: kwargs.pop(k) for k in list(kwargs)
                 if k in training_args_fields() and k not in _MEMORY_FIELDS}
    return plan_training(model, **kwargs).to_training_args(**overrides)


_MEMORY_FIELDS = {"per_device_train_batch_size", "gradient_accumulation_steps", "bf16", "fp16",
                  "optim", "activation_checkpointing", "gradient_checkpointing"}


# ----------------------------------------------------------------------------------------------
# reverse queries
# ----------------------------------------------------------------------------------------------


def max_batch_size(model: Any, args: Any = None, *, seq_len: int, device: Any = None,
                   max_memory: int | str | None = None, headroom: float = 0.1,
                   limit: int = 4096, **estimate_kwargs: Any) -> int:
    """The largest micro-batch of ``args`` whose step fits the device (0 if none)."""
    return _search(lambda b: _fits(model, args, b, seq_len, device, max_memory, headroom,
                                   estimate_kwargs), limit)


def max_seq_len(model: Any, args: Any = None, *, device: Any = None,
                max_memory: int | str | None = None, headroom: float = 0.1,
                limit: int = 1 << 20, multiple_of: int = 64, **estimate_kwargs: Any) -> int:
    """The longest ``seq_len`` (a multiple of ``multiple_of``) whose step fits (0 if none):
    "what context length can I train on this card?"."""
    batch = (dict(args) if isinstance(args, dict) else args)
    found = _search(lambda n: _fits(model, batch, None, n * multiple_of, device, max_memory,
                                    headroom, estimate_kwargs), limit // multiple_of)
    return found * multiple_of


def _fits(model, args, batch, seq_len, device, max_memory, headroom, kw) -> bool:
    from ._estimate import estimate_memory

    dev = resolve_device(device)
    a = dict(args or {}) if not hasattr(args, "to_dict") else {
        f.name: getattr(args, f.name) for f in dataclasses.fields(args)}
    if batch is not None:
        a["per_device_train_batch_size"] = batch
    try:
        est = estimate_memory(model, a, seq_len=seq_len, device=dev, **kw)
    except HfMemkitError:
        return False
    return est.device_used <= _budget(dev, headroom, max_memory, device is None)


def _search(fits, limit: int) -> int:
    """Largest n in [1, limit] with fits(n) (monotone), by doubling then bisection."""
    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi <= limit and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, limit + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


__all__ = ["Plan", "Candidate", "plan_training", "auto_training_args", "max_batch_size",
           "max_seq_len"]
