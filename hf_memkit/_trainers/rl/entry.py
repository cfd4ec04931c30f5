"""TRL's online RL trainers, ``GRPOTrainer`` and ``RLOOTrainer``: a step of phases.

Read from TRL 1.16 (``trl/trainer/grpo_trainer.py``, ``rloo_trainer.py``, ``grpo_config.py``):
  * **generate** (``_generate_single_turn``, ``use_vllm=False``): once every
    ``steps_per_generation x num_iterations`` micro-steps, the policy's own ``generate`` samples
    ``max_completion_length`` tokens for the local generation batch, ``per_device_train_batch_size
    x steps_per_generation`` rows (each prompt repeated ``num_generations`` times by the
    sampler), left-padded prompts, under ``torch.no_grad()``, with the KV cache
    (``DynamicCache``: ``torch.cat`` per layer and token). Traced as its two peaks
    (``GenerateStep``): the prefill of the prompts (``logits_to_keep=1``, transformers
    ``generate``) and the last decode step, the cache at ``prompt + completion - 1`` tokens,
    with the sampling's fp32 logits, processors and softmax (``_sample``);
  * **score** (``_generate_and_score_completions``, no grad, checkpointing off): the old
    log-probs (GRPO: when ``gradient_accumulation_steps % (steps_per_generation x
    num_iterations) != 0``, or with vLLM's importance-sampling correction; RLOO: always) and the
    reference's (``beta != 0``: a frozen copy, or the PEFT policy with its adapters disabled),
    through the fused head in chunks of ``per_device_train_batch_size`` rows;
  * **train** (``_compute_loss``): ``per_device_train_batch_size`` rows of prompt + completion,
    labels only on the completion, ``add_fused_lm_head(outputs=("log_probs", "entropy"))``, the
    clipped ratio loss (``ScoreStep`` / ``TrainStep``).
Completions run to ``max_completion_length`` (generation stops when every row has), so that is
the length estimated; ``seq_len`` is the longest prompt. A colocated vLLM generates instead of
the policy: its memory is a tenant of its own (``vllm``, ``_estimate.rollout.colocated``), not
a phase traced here; in server mode it is on other GPUs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch

from .base import BatchShape, TraceStep, TrlTrainerKind, padded_length, register
from .data import token_rows, word_tokenizer
from .fused_head import add_head, fold_context

RL_OUTPUTS = ("log_probs", "entropy")   # GRPOTrainer / RLOOTrainer.__init__


def generation_steps(options: Mapping[str, Any], micro_batch: int, grad_accum: int,
                     ranks: int) -> int:
    """``steps_per_generation`` as ``GRPOConfig.__post_init__`` resolves it: given, else
    ``generation_batch_size / (per_device_train_batch_size x processes)``, else the
    accumulation steps."""
    if options.get("steps_per_generation"):
        return int(options["steps_per_generation"])
    if options.get("generation_batch_size"):
        return max(1, int(options["generation_batch_size"]) // (micro_batch * max(1, ranks)))
    return grad_accum


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
        self.completion = int(options["max_completion_length"])
        self.beta = float(options.get("beta") or 0.0)

    def prepare(self, model: Any, *, adapters: bool) -> None:
        super().prepare(model, adapters=adapters)
        add_head(model, RL_OUTPUTS)

    def prepare_reference(self, model: Any) -> None:
        add_head(model)

    def kernels(self, target: Any) -> Any:
        return fold_context(target, self.options)

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
    """The policy's ``generate`` at its two peaks (module docstring), recorded as phases
    "prefill" and "decode" of an eval trace (``rollout``)."""

    title = "GRPOTrainer"

    def __init__(self, options: Mapping[str, Any]) -> None:
        super().__init__(options)
        self.completion = int(options["max_completion_length"])

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


class GRPO(TrlTrainerKind):
    name = "grpo"
    title = "GRPOTrainer"
    config_class = "trl.GRPOConfig"
    fields = ("num_generations", "max_completion_length", "steps_per_generation",
              "generation_batch_size", "beta", "num_iterations", "temperature", "top_k",
              "top_p", "min_p", "repetition_penalty", "pad_to_multiple_of", "epsilon",
              "use_vllm", "vllm_mode", "vllm_importance_sampling_correction",
              "vllm_gpu_memory_utilization", "vllm_max_model_length",
              "vllm_tensor_parallel_size", "vllm_enable_sleep_mode",
              "ds3_gather_for_generation")
    eval_is_forward = False   # its eval generates completions
    takes_ref_model = False
    derived = ("generation_batch_size", "steps_per_generation")   # GRPOConfig.__post_init__
    irrelevant = {
        "the loss's arithmetic on [rows x completion] per-token values and per-row rewards": (
            "loss_type", "importance_sampling_level", "delta", "epsilon_high",
            "sapo_temperature_neg", "sapo_temperature_pos", "vespo_k_pos", "vespo_lambda_pos",
            "vespo_k_neg", "vespo_lambda_neg", "off_policy_mask_threshold",
            "top_entropy_quantile", "use_bias_correction_kl", "mask_truncated_completions",
            "multi_objective_aggregation", "scale_rewards", "reward_weights", "entropy_coef",
            "use_adaptive_entropy", "entropy_coef_min", "entropy_coef_max",
            "entropy_coef_delta", "entropy_target", "vllm_importance_sampling_mode",
            "vllm_importance_sampling_clip_max", "vllm_importance_sampling_clip_min",
            "vllm_importance_sampling_cap", "normalize_advantages", "reward_clip_range"),
        "logging of completions and the evaluation's generation count": (
            "log_completions", "log_completions_hub_repo", "log_multimodal",
            "log_unique_prompts", "num_completions_to_print", "num_generations_eval"),
        "prompt preparation on the host": ("chat_template_kwargs",),
        "vLLM server mode: the server's GPUs, addresses and decoding constraints": (
            "vllm_server_base_url", "vllm_server_host", "vllm_server_port",
            "vllm_server_timeout", "vllm_group_port", "vllm_structured_outputs_regex"),
        "the reference (a held copy) is mixed in place between steps": (
            "sync_ref_model", "ref_model_mixup_alpha", "ref_model_sync_steps")}

    def read(self, get: Callable[[str], Any]) -> dict[str, Any]:
        o = {f: get(f) for f in self.fields}
        o["completion_len"] = o["max_completion_length"]   # the positions the head scores
        o["phase"] = "train"
        return o

    def old_logps(self, options: Mapping[str, Any], steps_per_generation: int,
                  grad_accum: int) -> bool:
        """Whether the old policy's log-probs are scored (``_generate_and_score_completions``):
        when the accumulation is not a multiple of a generation's reuse, or for vLLM's
        importance-sampling correction."""
        every = steps_per_generation * int(options.get("num_iterations") or 1)
        return grad_accum % every != 0 or bool(
            options.get("use_vllm") and options.get("vllm_importance_sampling_correction"))

    def seq_len(self, options: Mapping[str, Any]) -> int | None:
        return None    # the longest prompt: GRPOConfig has no max_prompt_length (TRL >= 1.0)

    def shape(self, options: Mapping[str, Any], batch: int, seq: int) -> BatchShape:
        if options.get("phase") == "generate":    # left-padded prompts
            return BatchShape(batch, padded_length(options, seq), padded=True)
        return BatchShape(batch, padded_length(options, seq) + options["max_completion_length"],
                          padded=True)

    def step(self, options: Mapping[str, Any]) -> TraceStep:
        step = GenerateStep(options) if options.get("phase") == "generate" else \
            ScoreStep(options)
        step.title = self.title
        return step

    def reference(self, options: Mapping[str, Any], adapters: bool) -> str | None:
        if not options.get("beta") or options.get("phase") == "generate":
            return None
        return "adapters" if adapters else "copy"

    def rollout(self, options: Mapping[str, Any], steps_per_generation: int,
                grad_accum: int) -> tuple[str, ...]:
        """The phases besides the train step, each an eval trace of its own (``_estimate``)."""
        phases = () if options.get("use_vllm") else ("generate",)
        if self.old_logps(options, steps_per_generation, grad_accum) or options.get("beta"):
            phases += ("score",)
        return phases

    def unmodelled(self, options: Mapping[str, Any]) -> list[str]:
        return []

    def notes(self, options: Mapping[str, Any]) -> list[str]:
        c = options["max_completion_length"]
        return [f"{self.title}: generates {options['num_generations']} completions per prompt "
                f"of up to {c} tokens (max_completion_length; estimated at {c}, since "
                "generation runs until every row of the batch stops) after prompts of seq_len "
                "tokens, scores them and trains on prompt + completion rows through TRL's fused "
                "log-prob head"]

    def target_problems(self, options: Mapping[str, Any], target: int, ranks: int) -> list[str]:
        # GRPOConfig.__post_init__: the generation batch (per-device batch x processes x
        # steps_per_generation, = the effective batch when steps_per_generation is the
        # accumulation) must hold whole groups of num_generations completions
        g = int(options.get("num_generations") or 1)
        if target % g == 0:
            return []
        lo = target - target % g
        near = ", ".join(str(v) for v in (lo, lo + g) if v > 0 and v % ranks == 0) or \
            f"a multiple of {g * ranks // math.gcd(g, ranks)}"
        return [f"target_batch_size {target} does not hold whole generation groups of "
                f"num_generations={g} completions ({self.title} refuses a generation batch "
                f"that is not a multiple of it); nearest valid targets: {near}"]

    def run_problems(self, *, where: str, synthetic: bool, task: str | None,
                     callbacks: tuple[str, ...]) -> list[str]:
        return [f"{where}: trainer: {self.name}: `hf-memkit train` does not run {self.title}, "
                "which needs your reward functions and prompts; build it yourself with "
                f"plan.apply_to({self.config_class.rpartition('.')[2]}(...)) and "
                f"hf_memkit.MemoryCallback(plan.estimate) (hf-memkit plan {where} works as "
                "it is)"]

    def build(self, *, model: Any, args: Any, rows: Any, data_collator: Any,
              processing_class: Any, callbacks: list[Any], oom_guard: bool) -> Any:
        """The trainer over prompts made from ``rows`` (their ``input_ids`` as words of the
        in-memory tokenizer, ``data``), rewarded by each completion's share of even token ids,
        generating with the policy's own ``generate``: what ``bench/gpu_truth.py`` measures
        (``hf-memkit train`` refuses it: ``run_problems``). With ``beta > 0`` and no PEFT, TRL
        loads the reference from the policy's ``_name_or_path``, which a model built from a
        config lacks: give ``beta=0`` or a saved model."""
        import importlib

        import datasets

        vocab = model.config.get_text_config().vocab_size
        prompts = [{"prompt": " ".join(f"w{t}" for t in r["input_ids"])}
                   for r in token_rows(rows)]
        module, _, cls = self.config_class.replace("Config", "Trainer").rpartition(".")
        trainer_cls = getattr(importlib.import_module(module), cls)
        return trainer_cls(model=model, reward_funcs=even_ids, args=args,
                           train_dataset=datasets.Dataset.from_list(prompts),
                           processing_class=processing_class or word_tokenizer(vocab),
                           callbacks=callbacks)

    def completion_problem(self, options: Mapping[str, Any]) -> str | None:
        return (f"completion_len does not apply to {self.title}: its completions are "
                "max_completion_length tokens (set that in its config)")


def even_ids(completions: list[str], **kwargs: Any) -> list[float]:
    """A reward for synthetic runs: the share of a completion's words ``w<id>`` with an even
    id (rewards are host floats: any function costs the device nothing)."""
    out = []
    for text in completions:
        ids = [w[1:] for w in text.split() if w[1:].isdigit()]
        out.append(sum(int(i) % 2 == 0 for i in ids) / max(1, len(ids)))
    return out


class RLOO(GRPO):
    name = "rloo"
    title = "RLOOTrainer"
    config_class = "trl.RLOOConfig"
    fields = tuple(f for f in GRPO.fields if not f.startswith("vllm_importance"))

    def old_logps(self, options: Mapping[str, Any], steps_per_generation: int,
                  grad_accum: int) -> bool:
        return True   # RLOOTrainer._generate_and_score_completions scores them every time


register(GRPO())
register(RLOO())
