"""JSON forms of what a ``Plan`` holds: the model reference, load kwargs and LoRA config."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import torch

from .._engines import ENGINES
from .._errors import HfMemkitError
from .._setup.fields import OUTBOUND_FIELDS


def shareable_args(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The trainer config's fields a plan file holds: all but where the run's results go
    (``OUTBOUND_FIELDS``; ``_plan.read`` refuses them in a file)."""
    return {k: v for k, v in kwargs.items() if k not in OUTBOUND_FIELDS}


def model_ref_to_json(ref: Any) -> Any:
    if isinstance(ref, str):
        return ref
    return {"config": ref.to_dict()}


def model_ref_from_json(ref: Any) -> Any:
    if isinstance(ref, str):
        return ref
    from transformers import AutoConfig

    d = dict(ref["config"])
    return AutoConfig.for_model(d.pop("model_type"), **d)


def model_kwargs_to_json(mk: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for k, v in mk.items():
        if isinstance(v, torch.dtype):
            out[k] = str(v).replace("torch.", "")
        elif k == "quantization_config" and v is not None:
            out[k] = v.to_dict() if hasattr(v, "to_dict") else dict(v)
        else:
            out[k] = v
    return out


# the load dtypes a plan writes (``model_kwargs['dtype']``), and what each reads back as: never
# ``getattr(torch, name)`` on what a file says
LOAD_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
               "auto": "auto"}


def model_kwargs_from_json(d: dict[str, Any]) -> dict[str, Any]:
    """Inverse of ``model_kwargs_to_json`` (``_plan.read`` checks the keys and values first)."""
    out = dict(d)
    if out.get("dtype") is not None:
        if out["dtype"] not in LOAD_DTYPES:
            raise HfMemkitError(f"model_kwargs.dtype: expected one of {', '.join(LOAD_DTYPES)}, "
                                f"got {out['dtype']!r}")
        out["dtype"] = LOAD_DTYPES[out["dtype"]]
    if out.get("quantization_config"):
        from transformers import BitsAndBytesConfig

        out["quantization_config"] = BitsAndBytesConfig.from_dict(out["quantization_config"])
    return out


def peft_to_dict(cfg: Any) -> dict[str, Any] | None:
    if cfg is None:
        return None
    d = cfg.to_dict()
    return json.loads(json.dumps(d, default=lambda o: sorted(o) if isinstance(o, set) else str(o)))


def peft_from_dict(d: dict[str, Any] | None) -> Any:
    if d is None:
        return None
    import peft

    return peft.LoraConfig(**{k: v for k, v in d.items() if k in
                              {f.name for f in dataclasses.fields(peft.LoraConfig)} and
                              k not in ("peft_type", "auto_mapping", "revision")})


def estimate_kwargs(model_kwargs: dict[str, Any], peft_config: Any) -> dict[str, Any]:
    """``estimate_memory`` kwargs that reproduce a plan's model. A k-bit base loads in half
    precision, then prepare_model_for_kbit_training upcasts every non-quantized parameter to
    fp32: the estimate takes the trained dtype (None = fp32)."""
    quant = model_kwargs.get("quantization_config")
    return {"dtype": None if quant is not None else model_kwargs.get("dtype"),
            "attn_implementation": model_kwargs.get("attn_implementation"),
            "quantization_config": quant, "peft_config": peft_config}


# -- what `hf-memkit plan --json` prints by default: the choice first, the search summarised ----

def rejection_kind(reason: str) -> str:
    """A rejected setup's reason without its numbers, so that like rejections group together."""
    if "gathers for the forward alone need" in reason:
        return "weights + optimizer state + the forward's gathered parameters exceed the budget"
    if "alone need" in reason:
        return "weights + gradients + optimizer state alone exceed the budget"
    if reason.startswith("offload needs"):
        return "offload needs more host RAM per node than host_memory"
    if reason.startswith("a smaller micro-batch"):
        return "a smaller micro-batch of the same setup already does not fit"
    return reason


def rejected_summary(candidates: list) -> dict[str, int]:
    """How many setups were not estimated, by kind of reason."""
    out: dict[str, int] = {}
    for c in candidates:
        if c.estimate is None and c.device_used is None:
            key = rejection_kind(c.reason)
            out[key] = out.get(key, 0) + 1
    return out


def estimate_summary(est: Any) -> dict[str, Any] | None:
    """The memory of one setup in a few numbers (bytes), with its verdict."""
    if est is None:
        return None
    return {"device_used": est.device_used, "upper": est.upper,
            "required": est.required, "required_at_least": est.required_at_least,
            "margin": est.upper - est.required,
            "budget": est.budget, "fits": est.fits, "verdict": est.verdict,
            "peak_allocated": est.peak_allocated, "peak_reserved": est.peak_reserved,
            "peak_phase": est.peak_phase,
            "breakdown": dict(est.breakdown), "host_offloaded": est.host_offloaded}


def chosen_summary(plan: Any) -> dict[str, Any]:
    """The chosen setup, its memory and the arguments that apply it."""
    c = plan.chosen
    return {"label": c.label(), "method": c.method, "precision": c.precision, "optim": c.optim,
            "techniques": list(c.techniques), "micro_batch": c.micro_batch,
            "grad_accum": c.grad_accum, "num_gpus": plan.num_gpus, "attn": c.attn,
            "parallel": c.parallel, "rel_time": c.rel_time, "fits": c.fits,
            "verdict": plan.verdict, "env": plan.env, "memory": estimate_summary(c.estimate),
            "training_args_kwargs": shareable_args(plan.training_args_kwargs),
            "model_kwargs": model_kwargs_to_json(plan.model_kwargs)}


def compact_candidates(candidates: list) -> list[dict[str, Any]]:
    """The estimated setups (``Candidate`` fields; the full estimate on the chosen one only):
    ``Plan.from_dict`` reads them back."""
    out = []
    for c in candidates:
        if c.estimate is None and c.device_used is None:
            continue
        d = c.to_dict()
        if not c.chosen:
            d["estimate"] = None
        out.append(d)
    return out


def accelerate_config(plan: Any) -> dict[str, Any]:
    """What ``accelerate config`` would write for ``plan`` (``Plan.accelerate_config``): the
    engine's distributed type and section (``Engine.accelerate_type``,
    ``Engine.accelerate_section``)."""
    ta, name = plan.training_args_kwargs, plan.parallel.get("engine")
    engine = ENGINES.get(name) if name in ENGINES else None
    kind = (engine.accelerate_type if engine is not None else None) or (
        "MULTI_GPU" if plan.num_gpus > 1 else "NO")
    cfg: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE", "distributed_type": kind,
        "mixed_precision": plan.accelerator_kwargs.get("mixed_precision", "no"),
        "num_machines": plan.num_nodes, "num_processes": plan.num_gpus, "machine_rank": 0,
        "rdzv_backend": "static", "same_network": True, "use_cpu": False}
    if engine is not None:
        cfg.update(engine.accelerate_section(ta))
    pc = ta.get("parallelism_config")
    if isinstance(pc, dict):
        cfg["parallelism_config"] = {f"parallelism_config_{k}": v for k, v in pc.items()}
    return cfg
