"""``trl.DistillationTrainer``: on-policy distillation, the student generating its completions and
matching a teacher's next-token distribution on them.

Read from TRL 1.16 (``trl/trainer/distillation_trainer.py``: ``__init__``,
``_generate_single_turn``, ``_prepare_inputs``, ``_compute_loss``, ``_get_last_hidden_state``,
``_chunked_divergence_loss``; ``trl/kernels/chunked_divergence.py``:
``ChunkedDivergenceFunction``; ``distillation_config.py``):
  * **generate** (``_prepare_inputs``): once every ``gradient_accumulation_steps`` micro-steps
    the student's own ``generate`` samples up to ``max_completion_length`` tokens for the local
    generation batch, ``per_device_train_batch_size x gradient_accumulation_steps`` prompts
    (one completion each), left-padded, under ``torch.no_grad()``: GRPO's generation with one
    completion per prompt and ``steps_per_generation`` = the accumulation, traced by the same
    ``GenerateStep`` (``rl``). A vLLM generates instead with ``use_vllm``;
  * **train** (``_compute_loss``): ``per_device_train_batch_size`` rows of prompt +
    completion. The student's backbone (``model.base_model``: no LM head) runs with grad, the
    teacher's under ``torch.no_grad()``, each giving the last hidden states of the completion
    positions; ``ChunkedDivergenceFunction`` then projects both through their own LM heads in
    tiles of at most 4096 tokens x 32768 vocabulary entries, an fp32 tile buffer for each
    model, so neither model's ``[tokens x vocab]`` logits ever exist, and the two tiles are
    alive together. ``beta`` strictly between 0 and 1 (the generalized JSD) runs a second pass
    over the tiles. The trace runs TRL's ``_chunked_divergence_loss`` itself;
  * the teacher (``teacher_model=``: a name loaded with ``teacher_model_init_kwargs``, or a
    model) is held on the device through training, prepared for evaluation. It may differ from
    the student in size and width (only ``vocab_size`` must match); the estimate holds a
    teacher of the student's own architecture and dtype (a copy, ``reference`` "copy"), so a
    larger teacher is an underestimate by its extra weights and its forward's extra
    temporaries. ``teacher_model_name_or_path`` is read by TRL's CLI script only;
  * on CUDA, the tile folds are Triton kernels that read and write the tiles in place, the
    projections write fp32 tiles straight from bf16/fp16 products, and only the completion
    positions are projected (``_use_triton``): ``divergence_fold`` traces that.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from .base import RolloutPhase, TraceStep, Unmodelled, register
from .rl.entry import GENERATION_UNMODELLED, GRPO
from .rl.inputs import value_problems
from .rl.steps import GenerateStep, completion_width


def _last_hidden(model: Any, ids: torch.Tensor, mask: Any, keep: int) -> torch.Tensor:
    """``DistillationTrainer._get_last_hidden_state``: the backbone's last hidden states at the
    ``keep`` positions that predict the completion (a PEFT model's LoRA layers included)."""
    if hasattr(model, "disable_adapter"):             # is_peft_model: base_model.model
        model = model.base_model.model
    kw = {"attention_mask": mask} if mask is not None else {}
    hidden = model.base_model(input_ids=ids, use_cache=False, logits_to_keep=keep + 1,
                              **kw).last_hidden_state
    return hidden[:, :-1, :][:, -keep:, :]


class DistillStep(TraceStep):
    """The student's train micro-step: both backbones, then TRL's chunked divergence."""

    title = "DistillationTrainer"

    def __init__(self, options: Mapping[str, Any]) -> None:
        super().__init__(options)
        # logits_to_keep: the generation batch's completion width (padded); the completion
        # tokens themselves (completion_mask) are what the CUDA path projects
        self.completion = completion_width(options)
        self.tokens = completion_width(options, padded=False)

    def prepare_reference(self, model: Any) -> None:
        """The teacher runs its backbone alone: nothing to patch."""

    def kernels(self, target: Any) -> Any:
        return divergence_fold(target, self.tokens / self.completion)

    def loss(self, model: Any, batch: dict[str, Any], reference: Any = None) -> Any:
        from trl.trainer.distillation_trainer import _chunked_divergence_loss

        ids, mask, c = batch["input_ids"], batch.get("attention_mask"), self.completion
        student = _last_hidden(model, ids, mask, c)
        with torch.no_grad():
            teacher = _last_hidden(reference, ids, mask, c)
        s_head, t_head = model.get_output_embeddings(), reference.get_output_embeddings()
        o = self.options
        mask = torch.zeros(ids.shape[0], c, dtype=torch.long)
        mask[:, : self.tokens] = 1                          # completion_mask, right-padded
        loss, _, _ = _chunked_divergence_loss(
            student, teacher, s_head.weight, t_head.weight, mask, float(o.get("beta", 1.0)),
            student_lm_head_bias=s_head.bias, teacher_lm_head_bias=t_head.bias,
            temperature=float(o.get("temperature") or 1.0))
        return loss


@contextlib.contextmanager
def divergence_fold(target: Any, share: float = 1.0) -> Iterator[None]:
    """On a CUDA target (``target`` not None): ``ChunkedDivergenceFunction`` allocates what its
    Triton path allocates. The folds (``_stats_kernel``, ``_jsd_kernel``, ``_backward_kernel``)
    update the tiles in place; a bf16/fp16 projection writes its fp32 tile directly
    (``torch.mm(..., out_dtype=float32, out=tile)`` after the weight chunk's cast), as does
    ``_addmm_fp32``; and ``_chunked_divergence_loss`` projects only the completion tokens (its
    ``compact`` branch), ``share`` of the positions it is given (the rest: padding)."""
    if target is None:
        yield
        return
    from trl.kernels import chunked_divergence as cd
    from trl.trainer import distillation_trainer as dt

    from .._trace.masked import MaskedSelect

    names = ("_stats_tile", "_jsd_tile", "_backward_tile", "_project", "_addmm_fp32")
    saved, use_triton = {n: getattr(cd, n) for n in names}, dt._use_triton
    project, addmm = saved["_project"], saved["_addmm_fp32"]

    def no_alloc(*args: Any, **kwargs: Any) -> None:
        """A Triton fold: reads and writes its arguments in place."""

    def cuda_project(tile: Any, hidden: Any, weight: Any, bias: Any, start: int, end: int,
                     dtype: Any) -> None:
        if dtype not in (torch.float16, torch.bfloat16):
            return project(tile, hidden, weight, bias, start, end, dtype)
        weight[start:end].to(dtype)             # the chunk's cast (a copy when it differs)
        if bias is not None:
            tile.add_(bias[start:end].float())
        return None

    def cuda_addmm(acc: Any, a: Any, b: Any) -> None:
        if a.dtype not in (torch.float16, torch.bfloat16):
            addmm(acc, a, b)

    cd._stats_tile = cd._jsd_tile = cd._backward_tile = no_alloc
    cd._project, cd._addmm_fp32 = cuda_project, cuda_addmm
    dt._use_triton = _on_cuda
    try:
        with MaskedSelect(lambda shape: round(shape[0] * share)):
            yield
    finally:
        for n, fn in saved.items():
            setattr(cd, n, fn)
        dt._use_triton = use_triton


def _on_cuda(device: Any) -> bool:
    return True


class Distillation(GRPO):
    name = "distillation"
    title = "DistillationTrainer"
    config_class = "trl.DistillationConfig"
    fields = ("max_completion_length", "beta", "temperature", "top_k", "top_p", "min_p",
              "repetition_penalty", "pad_to_multiple_of", "use_vllm", "vllm_mode",
              "vllm_gpu_memory_utilization", "vllm_max_model_length",
              "vllm_tensor_parallel_size", "vllm_enable_sleep_mode", "ds3_gather_for_generation")
    derived = ()
    takes_ref_model = False
    unmodelled_fields = {
        **{k: v for k, v in GENERATION_UNMODELLED.items()
           if k in ("cache_implementation", "generation_kwargs", "vllm_model_impl")},
        "max_tool_calling_iterations": Unmodelled("tool calls lengthen the completions past "
                                                  "max_completion_length"),
        "teacher_model_name_or_path": Unmodelled(
            "the teacher TRL's distillation script loads; the estimate holds a teacher of the "
            "student's architecture and dtype (a larger teacher holds more)"),
        "teacher_model_init_kwargs": Unmodelled(
            "the dtype / quantization the teacher is loaded with; the estimate holds the teacher "
            "in the student's dtype")}
    irrelevant = {
        "logging of completions": ("log_completions", "num_completions_to_print",
                                   "log_unique_prompts"),
        "prompt preparation on the host": ("chat_template_kwargs",),
        "which revision of the teacher is loaded, not its size": ("teacher_model_revision",),
        "vLLM server mode: the server's GPUs, addresses and decoding constraints": (
            "vllm_server_base_url", "vllm_server_host", "vllm_server_port",
            "vllm_server_timeout", "vllm_group_port", "vllm_structured_outputs_regex")}

    def rederive(self, args: Any, planned: dict[str, Any]) -> dict[str, Any]:
        return planned

    def read(self, get: Callable[[str], Any]) -> dict[str, Any]:
        o = {f: get(f) for f in self.fields}
        o["phase"] = "train"
        return o

    def old_logps(self, options: Mapping[str, Any], steps_per_generation: int,
                  grad_accum: int) -> bool:
        return False      # no old or reference log-probs: the teacher runs in the micro-step

    def phase_names(self, options: Mapping[str, Any], steps_per_generation: int,
                    grad_accum: int) -> tuple[str, ...]:
        return () if options.get("use_vllm") else ("generate",)

    def step(self, options: Mapping[str, Any]) -> TraceStep:
        step = GenerateStep(options) if options.get("phase") == "generate" else \
            DistillStep(options)
        step.title = self.title
        return step

    def reference(self, options: Mapping[str, Any], adapters: bool) -> str | None:
        return None if options.get("phase") == "generate" else "copy"   # the teacher

    def rollout_notes(self, setup: Any, phases: Mapping[str, RolloutPhase]) -> list[str]:
        return [n.replace("per_device_train_batch_size x steps_per_generation",
                          "per_device_train_batch_size x gradient_accumulation_steps")
                for n in super().rollout_notes(setup, phases)]

    def notes(self, options: Mapping[str, Any]) -> list[str]:
        cap, c = options["max_completion_length"], completion_width(options, padded=False)
        took = "the cap, the safe bound" if c == cap else "the longest completion given"
        return [f"{self.title}: the student generates one completion per prompt of up to {cap} "
                f"tokens (max_completion_length; estimated at {c}, {took}) after prompts of seq_len "
                "tokens, then trains on prompt + completion rows against the teacher's "
                "distribution through TRL's chunked divergence (fp32 tiles of both models' "
                "logits, never the full [tokens x vocab])",
                "the teacher is held as a copy of the student's architecture and dtype: a "
                "larger teacher holds more (its weights and its forward)"]

    def config_problems(self, options: Mapping[str, Any]) -> list[str]:
        beta = options.get("beta")
        out = value_problems({**options, "num_generations": 2}, "DistillationConfig", 2)
        if not isinstance(beta, (int, float)) or isinstance(beta, bool) or not 0 <= beta <= 1:
            out.append(f"`beta` must be in [0.0, 1.0], got {beta!r}: DistillationConfig refuses "
                       "others (0: forward KL, 1: reverse KL, between: generalized JSD)")
        return out

    def batch_problems(self, options: Mapping[str, Any], micro_batch: int, grad_accum: int,
                       ranks: int) -> list[str]:
        return []

    def target_problems(self, options: Mapping[str, Any], target: int, ranks: int) -> list[str]:
        return []

    def run_problems(self, *, where: str, synthetic: bool, task: str | None,
                     callbacks: tuple[str, ...]) -> list[str]:
        return [f"{where}: trainer: {self.name}: `hf-memkit train` does not run {self.title}, "
                "which needs your teacher model and prompts; build it yourself with "
                "plan.apply_to(DistillationConfig(...)) and hf_memkit.MemoryCallback(plan."
                f"estimate) (hf-memkit plan {where} works as it is)"]

    def build(self, *, model: Any, args: Any, rows: Any, data_collator: Any,
              processing_class: Any, callbacks: list[Any], oom_guard: bool) -> Any:
        """The trainer over prompts made from ``rows`` (words of the in-memory tokenizer), with
        a frozen copy of the student as its teacher (``hf-memkit train`` refuses it:
        ``run_problems``; this is the setup the estimate models)."""
        import copy

        import datasets
        import trl

        from .data import token_rows, word_tokenizer

        vocab = model.config.get_text_config().vocab_size
        prompts = [{"prompt": " ".join(f"w{t}" for t in r["input_ids"])}
                   for r in token_rows(rows)]
        return trl.DistillationTrainer(
            model=model, teacher_model=copy.deepcopy(model).eval(), args=args,
            train_dataset=datasets.Dataset.from_list(prompts),
            processing_class=processing_class or word_tokenizer(vocab), callbacks=callbacks)

    def completion_problem(self, options: Mapping[str, Any]) -> str | None:
        return None   # the longest completion a generation batch holds (completion_width)


register(Distillation())
