"""One rank's model under transformers' tensor parallelism (``tp_plan="auto"``, accelerate's
``ParallelismConfig(tp_size=N)``).

transformers 5.x ships each model's plan: the config's ``base_model_tp_plan`` (Llama, Qwen2/3,
Mistral, Gemma: ``q/k/v_proj`` and ``gate/up_proj`` "colwise", ``o_proj`` and ``down_proj``
"rowwise", Qwen3's and Gemma3's ``q/k_norm`` "replicated_with_grad_allreduce") and the class's
``_tp_plan`` (``{"lm_head": "colwise_gather_output"}``), and the input embedding, which
``init_parallel_plans`` adds as ``embedding_rowwise`` (split by vocabulary, its lookup
all-reduced). Norms and rotary tables are not in the plan: every rank holds them whole.

So one rank computes exactly what a model of the same hidden size with ``heads / tp`` query
heads, ``kv_heads / tp`` key/value heads and ``intermediate / tp`` MLP width computes: a
colwise projection makes a rank's heads (or MLP columns), a rowwise one maps them back to a
partial hidden state that an all-reduce sums into a new tensor. The head's and the embedding's
rows are split by vocabulary; the logits are gathered to the full vocabulary on every rank and
the embedding's output all-reduced to the full hidden size. ``narrowed`` builds that model
(``ModelSpec.narrowed``; the head's and embedding's weights count ``1 / tp`` of their rows) so
weights, gradients, optimizer state and the traced activations are one rank's; the
collectives' own buffers are added by ``_estimate.parallel``.
"""

from __future__ import annotations

import copy
from typing import Any

from .._units import divisors
from .spec import ModelSpec

# Plan styles a narrowed model reproduces, by the module they apply to (the plan's key, layer
# index as "*"): the projections split by heads and by MLP width, norms kept whole.
COLWISE = {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj",
           "mlp.up_proj"}
ROWWISE = {"self_attn.o_proj", "mlp.down_proj"}
REPLICATED = {"self_attn.q_norm", "self_attn.k_norm"}
HEAD_STYLES = {"colwise_gather_output"}


def tp_plan(spec: ModelSpec) -> dict[str, str]:
    """The model's plan as transformers applies it (base model's, then the class's head)."""
    text = spec.config.get_text_config()
    plan = dict(getattr(text, "base_model_tp_plan", None) or {})
    plan.update(getattr(spec.model_cls, "_tp_plan", None) or {})
    return plan


def _unsupported(plan: dict[str, str]) -> list[str]:
    bad = []
    for key, style in plan.items():
        local = key.removeprefix("layers.*.")
        ok = (local in COLWISE and style == "colwise") or (
            local in ROWWISE and style == "rowwise") or (
            local in REPLICATED and style.startswith("replicated")) or (
            "." not in key and style in HEAD_STYLES)
        if not ok:
            bad.append(f"{key}: {style}")
    return bad


def tp_problems(spec: ModelSpec, tp: int) -> list[str]:
    """Why ``spec`` cannot be split ``tp`` ways as transformers splits it (empty: it can)."""
    name = spec.model_cls.__name__
    plan = tp_plan(spec)
    if not plan:
        return [f"tp_size={tp}: {name} has no tensor-parallel plan in transformers "
                "(base_model_tp_plan); use tp_size=1 and shard with FSDP (dp_shard_size) or "
                "split the sequence (cp_size)"]
    bad = _unsupported(plan)
    if bad:
        return [f"tp_size={tp}: {name}'s tensor-parallel plan has entries hf_memkit does not "
                f"model ({'; '.join(bad[:4])}); it models colwise/rowwise attention and MLP "
                "projections and a gathered head"]
    if spec.quant_bits:
        return [f"tp_size={tp} with a {spec.quant_bits}-bit base: transformers' tensor "
                "parallelism shards floating weights; use tp_size=1"]
    text = spec.config.get_text_config()
    out = []
    for attr in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        v = getattr(text, attr, None)
        if isinstance(v, int) and v % tp:
            ok = [k for k in divisors(v) if k > 1 and k <= 64]
            out.append(f"tp_size={tp} does not divide {name}'s {attr} ({v}): each rank takes "
                       f"whole {attr.split('_')[-1]}; use tp_size in {ok[:8] or [1]}")
    return out


def narrowed_config(spec: ModelSpec, tp: int) -> Any:
    """The config of one rank's model: heads, key/value heads and MLP width divided by ``tp``,
    head size kept (set explicitly, as the rank's projections keep it)."""
    config = copy.deepcopy(spec.config)
    text = config.get_text_config()
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    text.head_dim = head_dim
    text.num_attention_heads //= tp
    kv = getattr(text, "num_key_value_heads", None)
    if isinstance(kv, int):
        text.num_key_value_heads = kv // tp
    text.intermediate_size //= tp
    return config


def narrowed(spec: ModelSpec, tp: int) -> ModelSpec:
    """One rank's model of ``spec`` under tensor parallelism of degree ``tp`` (``tp_problems``
    must be empty)."""
    if tp <= 1:
        return spec
    return spec.narrowed(narrowed_config(spec, tp), tp)
