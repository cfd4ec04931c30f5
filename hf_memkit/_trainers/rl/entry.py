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
    clipped ratio loss (``steps.ScoreStep``).
Every micro-batch of a generation batch is as wide as its longest prompt plus its longest
completion (``_generate_and_score_completions`` pads the whole generation batch, then
``split_tensor_dict`` cuts it into micro-batches), and generation runs until every row of the
batch has stopped. The prompts are shuffled into batches (``RepeatSampler``) and completions are
sampled, so the widest batch the data can form holds the longest prompt and the longest
completion: ``seq_len`` is the longest prompt (``lengths=``: the longest of them), and the
completion is ``completion_len`` (``completion_lengths=``: the longest of them), at most
``max_completion_length``; unset, the cap, the safe bound (``steps.completion_width``). The
estimate's notes say which it took. A colocated vLLM generates instead of
the policy: its memory is a tenant of its own (``vllm``, ``colocate``: ``GRPO.tenant``), not
a phase traced here; in server mode it is on other GPUs.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

from ..base import (
    BatchShape,
    RolloutPhase,
    Tenant,
    TraceStep,
    TrlTrainerKind,
    Unmodelled,
    padded_length,
    register,
)
from ..data import token_rows, word_tokenizer
from . import colocate, inputs, rollout
from .steps import GenerateStep, ScoreStep, completion_width

# fields of GRPOConfig / RLOOConfig that change what generation holds, not modelled
GENERATION_UNMODELLED = {
    name: Unmodelled(what, when=when) for name, what, when in (
        ("cache_implementation", "the KV cache generation uses (\"static\" allocates "
         "prompt + max_completion_length at once; quantized or offloaded caches)", {}),
        ("generation_kwargs", "generation settings that may change the KV cache or the "
         "sampling's [rows x vocab] temporaries", {}),
        ("use_transformers_continuous_batching", "transformers' continuous batching "
         "generates from a paged KV cache of its own size", {}),
        ("transformers_continuous_batching_config", "the paged KV cache's size",
         {"use_transformers_continuous_batching": (True,)}),
        ("use_transformers_paged", "generation from a paged KV cache of its own size", {}),
        ("vllm_model_impl", "the colocated vLLM's model implementation (vLLM's or "
         "transformers' modelling code, with activations of their own)",
         {"use_vllm": (True,)}))}


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
    sequence_split = False    # its rollout's generation and scoring are not split over ranks
    takes_ref_model = False
    derived = ("generation_batch_size", "steps_per_generation")   # GRPOConfig.__post_init__
    unmodelled_fields = {
        **GENERATION_UNMODELLED,
        "cast_lm_head_to_fp32": Unmodelled("an fp32 copy of the LM head and fp32 logits"),
        "max_tool_calling_iterations": Unmodelled("tool calls lengthen the completions past "
                                                  "max_completion_length")}
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

    def rederive(self, args: Any, planned: dict[str, Any]) -> dict[str, Any]:
        # GRPOConfig.__post_init__ derives generation_batch_size and steps_per_generation from
        # each other and refuses both set, and an instance holds both: steps per generation
        # that were the accumulation follow the plan's; others are kept
        out = {"generation_batch_size": None, **planned}
        if args.steps_per_generation == args.gradient_accumulation_steps:
            out.setdefault("steps_per_generation", None)
        return out

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
        return BatchShape(batch, padded_length(options, seq) + completion_width(options),
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

    def phase_names(self, options: Mapping[str, Any], steps_per_generation: int,
                       grad_accum: int) -> tuple[str, ...]:
        """The phases besides the train step, each an eval trace of its own: generation by
        the policy (not where vLLM generates), and scoring where old or reference log-probs
        are computed."""
        phases = () if options.get("use_vllm") else ("generate",)
        if self.old_logps(options, steps_per_generation, grad_accum) or options.get("beta"):
            phases += ("score",)
        return phases

    def rollout(self, spec: Any, setup: Any, rs: Any, *, held: int,
                trace: Callable[[Any], Any]) -> dict[str, RolloutPhase]:
        phases = self.phase_names(setup.trainer_options, rollout.steps_of(setup),
                                     setup.grad_accum)
        return rollout.rollout_phases(phases, spec, setup, rs, held=held, trace=trace)

    def rollout_notes(self, setup: Any, phases: Mapping[str, RolloutPhase]) -> list[str]:
        return rollout.rollout_notes(setup, phases)

    def tenant(self, spec: Any, setup: Any, dev: Any, *, seq_len: int, held: int,
               parts: Mapping[str, int], rs: Any, used: int, phase: str) -> Tenant | None:
        return colocate.tenant(spec, setup, dev, seq_len=seq_len, held=held, parts=parts,
                               rs=rs, used=used, phase=phase)

    def plan_around(self, req: Any, run: Callable[[Any], Any], base: Callable[[], Any]) -> Any:
        return colocate.plan_beside_vllm(req, run, base)

    def unmodelled(self, options: Mapping[str, Any]) -> list[str]:
        return []

    def notes(self, options: Mapping[str, Any]) -> list[str]:
        cap, given = options["max_completion_length"], options.get("completion_len")
        c = completion_width(options, padded=False)
        if given and given < cap:
            said = (f"estimated at {c}, the longest completion given (completion_len / the "
                    "longest of completion_lengths): TRL pads every row of a generation batch "
                    "to its longest completion")
        else:
            said = (f"estimated at {c}, the cap: generation runs until every row of the batch "
                    "stops, and no shorter longest completion was given (completion_len=N or "
                    "completion_lengths=[...]; the cap is the safe bound)")
            if given and given > cap:
                said += f"; completion_len={given} is past the cap, where generation stops"
        return [f"{self.title}: generates {options['num_generations']} completions per prompt "
                f"of up to {cap} tokens (max_completion_length; {said}) after prompts of "
                "seq_len tokens (the longest prompt: TRL left-pads a generation batch to its "
                "longest), scores them and trains on prompt + completion rows through TRL's "
                "fused log-prob head"]

    def config_problems(self, options: Mapping[str, Any]) -> list[str]:
        # the fields on their own: num_generations >= 2 (GRPOConfig.__post_init__), the
        # counts, vLLM's share and the completion's length (``inputs``)
        default = {f.name: f.default for f in dataclasses.fields(self.config_type())}
        return inputs.value_problems(options, self.config_name, default["num_generations"])

    def batch_problems(self, options: Mapping[str, Any], micro_batch: int, grad_accum: int,
                       ranks: int) -> list[str]:
        # GRPOConfig.__post_init__ on the generation batch (``inputs``); bad values are
        # config_problems' to say
        if self.config_problems(options):
            return []
        return inputs.generation_problems(options, self.config_name, micro_batch=micro_batch,
                                          grad_accum=grad_accum, ranks=ranks)

    @property
    def config_name(self) -> str:
        return self.config_class.rpartition(".")[2]

    def target_problems(self, options: Mapping[str, Any], target: int, ranks: int) -> list[str]:
        # GRPOConfig.__post_init__: the generation batch (per-device batch x processes x
        # steps_per_generation) must hold whole groups of num_generations completions. With
        # neither steps_per_generation nor generation_batch_size given it is the effective
        # batch; with one of them, the planner keeps to per-device batches that make it whole
        # (batch_problems)
        g = options.get("num_generations")
        if self.config_problems(options) or options.get("steps_per_generation") is not None \
                or options.get("generation_batch_size") is not None or target % g == 0:
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
                f"plan.apply_to({self.config_name}(...)) and "
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
        return None   # the longest completion a generation batch holds (completion_width)


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
    unmodelled_fields = GENERATION_UNMODELLED

    def old_logps(self, options: Mapping[str, Any], steps_per_generation: int,
                  grad_accum: int) -> bool:
        return True   # RLOOTrainer._generate_and_score_completions scores them every time


register(GRPO())
register(RLOO())
