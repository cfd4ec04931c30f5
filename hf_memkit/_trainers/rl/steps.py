"""The traced steps of GRPO / RLOO (the entries in ``entry``): ``ScoreStep``, the policy's train
step and its no-grad scoring through TRL's fused head, and ``GenerateStep``, the policy's own
``generate`` at its two peaks (the prompts' prefill and the last decode step). Read from TRL 1.16
(``trl/trainer/grpo_trainer.py``: ``_compute_loss``, ``_generate_and_score_completions``,
``_get_per_token_logps_and_entropies``) and transformers' ``generate`` (``_sample``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from ..base import TraceStep, padded_length
from ..fused_head import add_head, fold_context

RL_OUTPUTS = ("log_probs", "entropy")   # GRPOTrainer / RLOOTrainer.__init__


def completion_width(options: Mapping[str, Any], *, padded: bool = True) -> int:
    """The completion positions of the widest generation batch: the longest completion
    expected (``completion_len``: ``estimate_memory(completion_len=N)`` or the longest of
    ``completion_lengths``; unset, ``max_completion_length``), at most ``max_completion_length``
    (``max_new_tokens``: generation stops there). ``_generate_and_score_completions`` pads
    every completion of a generation batch to its longest, a multiple of
    ``pad_to_multiple_of`` (``pad(completion_ids, ..., pad_to_multiple_of=...)``): ``padded``;
    generation itself runs to the longest completion unpadded (``generate`` stops when every
    row has emitted EOS)."""
    cap = int(options["max_completion_length"])
    c = min(int(options.get("completion_len") or cap), cap)
    return padded_length(options, c) if padded else c


def _completion_labels(batch: dict[str, Any], completion: int) -> dict[str, Any]:
    """The trainer's forward inputs: labels only on the last ``completion`` positions
    (``_get_per_token_logps_and_entropies``)."""
    ids, mask = batch["input_ids"], batch.get("attention_mask")
    labels = ids.masked_fill(mask == 0, -100) if mask is not None else ids.clone()
    labels[:, :-completion] = -100
    out = {"input_ids": ids, "labels": labels}
    if mask is not None:
        out["attention_mask"] = mask
    return out


def _logps(model: Any, inputs: dict[str, Any], completion: int) -> torch.Tensor:
    out = model(**inputs, fused_lm_head=True)
    return out.log_probs[:, -completion:]


class ScoreStep(TraceStep):
    """The policy's step through TRL's fused head: the loss of ``_compute_loss`` (train), or the
    no-grad scoring of ``_generate_and_score_completions`` (the eval trace of phase "score")."""

    title = "GRPOTrainer"

    def __init__(self, options: Mapping[str, Any]) -> None:
        super().__init__(options)
        self.completion = completion_width(options)     # logits_to_keep: the padded width
        self.beta = float(options.get("beta") or 0.0)

    def prepare(self, model: Any, *, adapters: bool) -> None:
        super().prepare(model, adapters=adapters)
        add_head(model, RL_OUTPUTS)

    def prepare_reference(self, model: Any) -> None:
        add_head(model)

    def kernels(self, target: Any) -> Any:
        # on CUDA the head scores the completion tokens (completion_mask), not their padding
        return fold_context(target, {**self.options, "completion_len": completion_width(
            self.options, padded=False)})

    def loss(self, model: Any, batch: dict[str, Any], reference: Any = None) -> Any:
        inputs, c = _completion_labels(batch, self.completion), self.completion
        if not torch.is_grad_enabled():     # phase "score": old and reference log-probs
            rows = self.options.get("generation_rows") or inputs["input_ids"].shape[0]
            kept = [torch.empty(rows, c)] if self.options.get("old_logps") else []
            if kept:
                kept[0][: inputs["input_ids"].shape[0]] = _logps(model, inputs, c)
            if self.beta and reference is not None:
                kept.append(torch.empty(rows, c))
                if hasattr(reference, "disable_adapter"):
                    with reference.disable_adapter():
                        kept[-1][: inputs["input_ids"].shape[0]] = _logps(reference, inputs, c)
                else:
                    kept[-1][: inputs["input_ids"].shape[0]] = _logps(reference, inputs, c)
            return kept
        out = model(**inputs, fused_lm_head=True)           # _compute_loss
        logps, entropy = out.log_probs[:, -c:], out.entropy[:, -c:]
        mask = inputs["labels"][:, -c:] != -100
        old = logps.detach()
        ratio = torch.exp(logps - old)
        advantages = torch.zeros(logps.shape[0], 1)
        eps = float(self.options.get("epsilon") or 0.2)
        per_token = -torch.min(ratio * advantages,
                               torch.clamp(ratio, 1 - eps, 1 + eps) * advantages)
        if self.beta:
            ref = torch.zeros_like(old)
            per_token = per_token + self.beta * (torch.exp(ref - logps) - (ref - logps) - 1)
        del entropy
        return (per_token * mask).sum() / mask.sum().clamp(min=1)


class GenerateStep(TraceStep):
    """The policy's ``generate`` at its two peaks (the prompts' prefill and the last decode
    step), recorded as phases "prefill" and "decode" of an eval trace (``rollout``)."""

    title = "GRPOTrainer"
    records_phases = True

    def __init__(self, options: Mapping[str, Any]) -> None:
        super().__init__(options)
        self.completion = completion_width(options, padded=False)

    def prepare(self, model: Any, *, adapters: bool) -> None:
        super().prepare(model, adapters=adapters)
        add_head(model, RL_OUTPUTS)

    def _sample(self, logits: torch.Tensor) -> torch.Tensor:
        """``_sample``'s token selection: an fp32 copy of the last logits, the logits processors
        TRL's generation config switches on, softmax, multinomial."""
        scores = logits[:, -1].to(copy=True, dtype=torch.float32)
        o = self.options
        if o.get("repetition_penalty", 1.0) != 1.0:   # RepetitionPenaltyLogitsProcessor
            scores = scores.scatter(1, torch.zeros_like(scores[:, :1], dtype=torch.long),
                                    scores[:, :1])
        if o.get("temperature", 1.0) not in (1.0, 0.0):  # TemperatureLogitsWarper
            scores = scores / float(o["temperature"])
        if o.get("top_k"):                                # TopKLogitsWarper
            scores = scores.masked_fill(scores < torch.topk(scores, int(o["top_k"]))[0][..., -1:],
                                        -float("inf"))
        if o.get("top_p", 1.0) < 1.0:                     # TopPLogitsWarper
            ordered, idx = torch.sort(scores, descending=False)
            drop = ordered.softmax(dim=-1).cumsum(dim=-1) <= 1 - float(o["top_p"])
            scores = scores.masked_fill(drop.scatter(1, idx, drop), -float("inf"))
        if o.get("min_p") is not None:                    # MinPLogitsWarper
            probs = torch.softmax(scores, dim=-1)
            scores = scores.masked_fill(probs < probs.amax(-1, keepdim=True) * float(o["min_p"]),
                                        -float("inf"))
        return torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1)

    def rollout(self, model: Any, batch: dict[str, Any], reference: Any,
                record: Callable[[str], None]) -> None:
        ids, mask = batch["input_ids"], batch.get("attention_mask")
        kw = {"attention_mask": mask} if mask is not None else {}
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1, **kw)
        self._sample(out.logits)
        cache = out.past_key_values
        del out
        record("prefill")
        total = ids.shape[1] + self.completion        # the last step attends to all of it
        grow_cache(cache, total - 1)
        step = ids[:, :1]
        if mask is not None:
            kw["attention_mask"] = torch.ones(ids.shape[0], total, dtype=mask.dtype)
        out = model(input_ids=step, past_key_values=cache, use_cache=True, logits_to_keep=1,
                    **kw)
        self._sample(out.logits)
        del out, cache
        record("decode")


def grow_cache(cache: Any, length: int) -> None:
    """Make each key/value layer of a transformers ``DynamicCache`` hold ``length`` tokens, as
    decoding up to there leaves it (a sliding-window layer keeps its last ``window - 1``; a
    layer of another kind, such as a linear-attention state, keeps its size)."""
    for layer in getattr(cache, "layers", ()):
        keys = getattr(layer, "keys", None)
        if not isinstance(keys, torch.Tensor) or keys.dim() < 2:
            continue
        window = getattr(layer, "sliding_window", None)
        n = min(length, window - 1) if window else length
        shape = (*keys.shape[:-2], n, keys.shape[-1])
        vshape = (*layer.values.shape[:-2], n, layer.values.shape[-1])
        layer.keys = torch.empty(shape, dtype=keys.dtype)
        layer.values = torch.empty(vshape, dtype=layer.values.dtype)
        if hasattr(layer, "cumulative_length"):
            layer.cumulative_length = length
