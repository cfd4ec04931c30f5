"""The case matrix of ``bench/gpu_truth.py``: real ``transformers.Trainer`` runs on one CUDA GPU.

Plain data, no torch or transformers import, so ``gpu_truth.py --list`` and the CPU tests read it
anywhere. Models are built from configs with random weights (no downloads): bundled configs of
``hf_memkit/model_configs`` (read as JSON here) or public ``config.json`` hyperparameters written
below (Qwen2.5-0.5B / 1.5B, gpt2-medium, t5-base), some shortened to keep the matrix short.

Sizes are picked so that the whole matrix runs in about 7 minutes on one H100 (8.5 minutes at
most; timed with 51 cases, before the two ``load="pretrained"`` ones of issue 25 and a fresh
calibration cache per child, which makes each estimate build its traces anew): 53 cases, 49
without bitsandbytes, each ~6-12 s (the 7 TRL / Liger ones ~10-15 s: TRL's
import and dataset preparation), almost all of it the child process's start (imports, CUDA
context, model init on the GPU); the 3 measured steps of every case take well under 2 s of GPU
time (the largest, Qwen2.5-1.5B at 4 x 1024 tokens with checkpointing, does ~50 TFLOP per step).
The TRL cases (``trainer="sft"`` / ``"dpo"`` / ``"grpo"``; 57 cases in all since issue 26) need
``trl``, the Liger ones ``liger_kernel``;
each runs only where its needs import, and Liger / TRL activation offloading only on a GPU.
Six bisect cases come first (``BISECT_CASES``): each finds the smallest allocator capacity at
which 2 steps complete, one child process a probe (~3.5 minutes for the six, not yet timed).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MODEL_CONFIGS = Path(__file__).resolve().parents[1] / "hf_memkit" / "model_configs"

FAMILIES = ("llama", "qwen2", "gpt2", "bert-cls", "t5")
PRECISIONS = ("fp32", "amp_bf16", "amp_fp16", "pure_bf16")
METHODS = ("full", "lora", "qlora", "lora_8bit")
# methods whose base is quantized by bitsandbytes at load (from_pretrained with a
# BitsAndBytesConfig): QLoRA's 4-bit NF4, LoRA on an 8-bit (LLM.int8) base
QUANTIZED = ("qlora", "lora_8bit")
STAGES = ("train", "forward_backward")
# transformers.Trainer, trl.SFTTrainer, trl.DPOTrainer, trl.GRPOTrainer (its own generate)
TRAINERS = ("trainer", "sft", "dpo", "grpo")
# how the model is built: from_config straight on the device, or saved then
# from_pretrained(dir, device_map=<device>) (transformers' caching_allocator_warmup runs)
LOADS = ("config", "pretrained")
# optimizer each method/optim needs beyond torch + transformers (+ peft for LoRA)
OPTIM_NEEDS = {"adamw_bnb_8bit": ("bitsandbytes",)}
METHOD_NEEDS = {"full": (), "lora": ("peft",), "qlora": ("peft", "bitsandbytes"),
                "lora_8bit": ("peft", "bitsandbytes")}
TRAINER_NEEDS = {"trainer": (), "sft": ("trl",), "dpo": ("trl",), "grpo": ("trl",)}
LIGER_NEEDS = ("liger_kernel",)
# TrainingArguments fields of each precision; pure_bf16 loads the weights in bf16 instead
PRECISION_ARGS = {"fp32": {}, "amp_bf16": {"bf16": True}, "amp_fp16": {"fp16": True},
                  "pure_bf16": {}}
# attention dropout under the name each family's config uses
DROPOUT_KEYS = ("attention_probs_dropout_prob", "attn_pdrop", "attention_dropout", "dropout_rate")
NF4 = {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_compute_dtype": "bfloat16"}


@dataclass(frozen=True)
class Model:
    """One model of the matrix: a bundled config (plus overrides) or a config written here."""

    key: str = field(metadata={"help": "Short name used in case ids, e.g. 'llama-160m'."})
    family: str = field(metadata={"help": "One of FAMILIES."})
    task: str = field(metadata={"help": "Head: causal-lm, sequence-classification, seq2seq-lm."})
    bundled: str | None = field(default=None, metadata={"help": "hf_memkit/model_configs name."})
    config: dict[str, Any] = field(default_factory=dict, metadata={
        "help": "Config fields (model_type included unless bundled); override the bundled ones."})
    lora_targets: tuple[str, ...] = field(default=(), metadata={"help": "LoRA target modules."})
    smoke: dict[str, Any] = field(default_factory=dict, metadata={
        "help": "Overrides that shrink the model for --cpu-smoke (plumbing check on a CPU)."})

    def config_dict(self, *, smoke: bool = False) -> dict[str, Any]:
        """The config as a dict with ``model_type``; dtype keys dropped (each case sets it)."""
        d: dict[str, Any] = {}
        if self.bundled:
            d = json.loads((MODEL_CONFIGS / f"{self.bundled}.json").read_text())
        d.update(self.config)
        if smoke:
            d.update(self.smoke)
        for k in ("torch_dtype", "dtype"):
            d.pop(k, None)
        return d

    def attention_dropout(self) -> float | None:
        d = self.config_dict()
        return next((float(d[k]) for k in DROPOUT_KEYS if k in d), None)


_LLAMA_SMOKE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                "vocab_size": 512}
_QWEN_SMOKE = {k: v for k, v in _LLAMA_SMOKE.items() if k != "head_dim"}
_GPT2_SMOKE = {"n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 512}
_BERT_SMOKE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
               "num_attention_heads": 4, "vocab_size": 512}
_T5_SMOKE = {"d_model": 64, "d_ff": 128, "d_kv": 16, "num_heads": 4, "num_layers": 2,
             "num_decoder_layers": 2, "vocab_size": 512}
_ATTN_LORA = ("q_proj", "k_proj", "v_proj", "o_proj")
# Qwen2.5-0.5B / -1.5B config.json (GQA: 14/2 and 12/2 heads, tied embeddings)
_QWEN = {"model_type": "qwen2", "vocab_size": 151936, "max_position_embeddings": 32768,
         "tie_word_embeddings": True, "attention_dropout": 0.0, "rms_norm_eps": 1e-6}

MODELS: dict[str, Model] = {m.key: m for m in (
    # 160 M: 8 layers of width 1024, GQA 16/8 heads, untied 32k vocabulary
    Model("llama-160m", "llama", "causal-lm",
          config={"model_type": "llama", "hidden_size": 1024, "intermediate_size": 2816,
                  "num_hidden_layers": 8, "num_attention_heads": 16, "num_key_value_heads": 8,
                  "vocab_size": 32000, "max_position_embeddings": 4096,
                  "tie_word_embeddings": False, "attention_dropout": 0.0},
          lora_targets=_ATTN_LORA, smoke=_LLAMA_SMOKE),
    Model("llama-1.2b", "llama", "causal-lm", bundled="Llama-3.2-1B", lora_targets=_ATTN_LORA,
          smoke=_LLAMA_SMOKE),
    Model("qwen2-0.5b", "qwen2", "causal-lm",
          config={**_QWEN, "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
                  "num_attention_heads": 14, "num_key_value_heads": 2},
          lora_targets=_ATTN_LORA, smoke=_QWEN_SMOKE),
    Model("qwen2-1.5b", "qwen2", "causal-lm",
          config={**_QWEN, "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
                  "num_attention_heads": 12, "num_key_value_heads": 2},
          lora_targets=_ATTN_LORA, smoke=_QWEN_SMOKE),
    Model("gpt2-124m", "gpt2", "causal-lm", bundled="gpt2", smoke=_GPT2_SMOKE),
    Model("gpt2-355m", "gpt2", "causal-lm", bundled="gpt2",  # gpt2-medium's config.json
          config={"n_embd": 1024, "n_layer": 24, "n_head": 16}, smoke=_GPT2_SMOKE),
    # classification head, attention dropout 0.1 (bert's own default, stated explicitly)
    Model("bert-base-cls", "bert-cls", "sequence-classification", bundled="bert-base-uncased",
          config={"attention_probs_dropout_prob": 0.1, "num_labels": 2}, smoke=_BERT_SMOKE),
    Model("bert-large-cls", "bert-cls", "sequence-classification", bundled="bert-large-uncased",
          config={"attention_probs_dropout_prob": 0.1, "num_labels": 2}, smoke=_BERT_SMOKE),
    # t5-base's config.json (v1.0: relu FFN, tied embeddings)
    Model("t5-220m", "t5", "seq2seq-lm",
          config={"model_type": "t5", "d_model": 768, "d_ff": 3072, "d_kv": 64, "num_heads": 12,
                  "num_layers": 12, "num_decoder_layers": 12, "vocab_size": 32128,
                  "feed_forward_proj": "relu", "dropout_rate": 0.1, "tie_word_embeddings": True,
                  "decoder_start_token_id": 0, "pad_token_id": 0, "eos_token_id": 1,
                  "relative_attention_num_buckets": 32, "n_positions": 512},
          smoke=_T5_SMOKE),
)}


@dataclass(frozen=True)
class Case:
    """One measured run. ``stage="forward_backward"`` is a custom loop (no Trainer, no optimizer)."""

    model: str = field(metadata={"help": "Key of MODELS."})
    precision: str = field(metadata={"help": "One of PRECISIONS."})
    optim: str = field(default="adamw_torch", metadata={"help": "TrainingArguments.optim."})
    batch: int = field(default=4, metadata={"help": "per_device_train_batch_size."})
    seq_len: int = field(default=1024, metadata={"help": "Tokens per example (no padding)."})
    target_len: int | None = field(default=None, metadata={"help": "Label length (seq2seq)."})
    accum: int = field(default=1, metadata={"help": "gradient_accumulation_steps."})
    ckpt: bool = field(default=False, metadata={"help": "Activation (gradient) checkpointing."})
    offload: bool = field(default=False, metadata={
        "help": "With ckpt: layer inputs in pinned host memory (checkpointing kwargs offload)."})
    attn: str | None = field(default="sdpa", metadata={
        "help": "attn_implementation; None = the model's default."})
    stage: str = field(default="train", metadata={"help": "One of STAGES."})
    method: str = field(default="full", metadata={"help": "One of METHODS."})
    steps: int = field(default=3, metadata={
        "help": "Optimizer steps (train) or forward+backward passes; steps 2.. are measured."})
    trainer: str = field(default="trainer", metadata={
        "help": "One of TRAINERS: transformers.Trainer, trl.SFTTrainer or trl.DPOTrainer "
                "(SFTConfig / DPOConfig with max_length = seq_len; for DPO each chosen / "
                "rejected row is at most seq_len tokens)."})
    completion_len: int | None = field(default=None, metadata={
        "help": "GRPO: max_completion_length (seq_len is the prompt; 4 generations a prompt, "
                "beta 0, the policy's own generate)."})
    liger: bool = field(default=False, metadata={
        "help": "use_liger_kernel=True (Liger's Triton kernels: a GPU only)."})
    trl_offload: bool = field(default=False, metadata={
        "help": "TRL's activation_offloading=True (sft / dpo only; needs an accelerator)."})
    at_required: bool = field(default=False, metadata={
        "help": "Cap the caching allocator at the estimate's `required` "
                "(torch.cuda.set_per_process_memory_fraction((required - context) / total)): "
                "issue #24's fit test says the step completes there, freeing cached blocks "
                "instead of growing; the run records whether it did (a GPU only)."})
    bisect: bool = field(default=False, metadata={
        "help": "Find on the GPU the smallest allocator capacity at which the steps complete: "
                "each probe a child process capped with torch.cuda.set_per_process_memory_"
                "fraction, bisected between bounds from the estimate (bench/_gpu_bisect.py); "
                "recorded next to the estimate's `required`."})
    completion_only: int | None = field(default=None, metadata={
        "help": "SFT: the last N tokens of each row are the completion (a completion_mask "
                "column; completion_only_loss=True), the rest the prompt; the estimate gets "
                "completion_len=N."})
    row_lens: tuple[int, ...] | None = field(default=None, metadata={
        "help": "SFT packing: rows of these lengths (cycled) packed by TRL's BFD into sequences "
                "of seq_len tokens (SFTConfig packing=True, max_length=seq_len); the estimate "
                "gets the rows' lengths, as users give them."})
    alloc_conf: str | None = field(default=None, metadata={
        "help": "PYTORCH_CUDA_ALLOC_CONF of the case's processes (measured run, probes and the "
                "estimate, which reads it), e.g. 'expandable_segments:True'; None: unset."})
    load: str = field(default="config", metadata={
        "help": "One of LOADS: 'config' builds the random model on the device (from_config); "
                "'pretrained' saves it to a temporary folder and loads it with "
                "from_pretrained(dir, device_map=<device>), whose caching_allocator_warmup "
                "reserves one model-sized block first (QLoRA always loads that way)."})

    def __post_init__(self) -> None:
        problems = []
        if self.model not in MODELS:
            problems.append(f"unknown model `{self.model}`; known: {', '.join(MODELS)}")
        if self.precision not in PRECISIONS:
            problems.append(f"precision `{self.precision}` not in {PRECISIONS}")
        if self.stage not in STAGES or self.method not in METHODS:
            problems.append(f"stage/method `{self.stage}`/`{self.method}` not in {STAGES}/{METHODS}")
        if self.stage == "forward_backward" and (self.precision.startswith("amp") or self.ckpt
                                                 or self.accum != 1 or self.method != "full"):
            problems.append("forward_backward cases are plain fp32 / pure_bf16 full models")
        if self.offload and not self.ckpt:
            problems.append("offload moves checkpointed inputs: it needs ckpt=True")
        if self.trainer not in TRAINERS:
            problems.append(f"trainer `{self.trainer}` not in {TRAINERS}")
        elif self.trainer != "trainer" and (self.task != "causal-lm" or self.stage != "train"):
            problems.append(f"trainer `{self.trainer}` (TRL) trains causal LMs: task causal-lm, "
                            "stage train")
        problems += self._trl_problems()
        if self.liger and self.stage != "train":
            problems.append("liger is a Trainer argument (use_liger_kernel): it needs stage train")
        if self.load not in LOADS:
            problems.append(f"load `{self.load}` not in {LOADS}")
        elif self.load == "pretrained" and self.method in QUANTIZED:
            problems.append(f"a {self.method} case loads with from_pretrained already: keep "
                            "load 'config'")
        problems += [why for bad, why in (
            (self.bisect and self.at_required,
             "bisect searches the capacity that at_required fixes: not both"),
            (self.steps < 2, "steps must be >= 2 (step 1 is warm-up, steps 2.. are measured)"))
            if bad]
        if problems:
            raise ValueError(f"bad case {self}: " + "; ".join(problems))

    def _trl_problems(self) -> list[str]:
        """What is wrong with the case's TRL-only settings."""
        problems: list[str] = []
        if (self.trainer == "grpo") != (self.completion_len is not None):
            problems.append("completion_len is GRPO's max_completion_length: give it with "
                            "trainer 'grpo' and only then")
        if self.row_lens is not None and (self.trainer != "sft" or not self.row_lens
                                          or max(self.row_lens) > self.seq_len):
            problems.append("row_lens are SFT rows packed into seq_len tokens: trainer 'sft', "
                            "each row at most seq_len")
        if self.completion_only is not None and (self.trainer != "sft"
                                                 or not 0 < self.completion_only < self.seq_len):
            problems.append("completion_only is the completion's share of an SFT row: trainer "
                            "'sft', between 0 and seq_len tokens")
        if self.trl_offload and self.trainer not in ("sft", "dpo"):
            problems.append("trl_offload is TRL's activation_offloading: it needs trainer "
                            "'sft' or 'dpo'")
        return problems

    @property
    def family(self) -> str:
        return MODELS[self.model].family if self.model in MODELS else "?"

    @property
    def task(self) -> str:
        return MODELS[self.model].task if self.model in MODELS else "?"

    @property
    def needs(self) -> tuple[str, ...]:
        """Python modules the case needs beyond torch, transformers and accelerate."""
        extra = OPTIM_NEEDS.get(self.optim, ()) if self.stage == "train" else ()
        return tuple(dict.fromkeys(METHOD_NEEDS[self.method] + TRAINER_NEEDS[self.trainer]
                                   + (LIGER_NEEDS if self.liger else ()) + extra))

    @property
    def id(self) -> str:
        parts = [self.model, self.precision]
        if self.trainer != "trainer":
            parts.append(self.trainer)
        if self.method != "full":
            parts.append(self.method)
        parts.append(self.optim if self.stage == "train" else "fwd-bwd")
        parts.append(self.attn or "default-attn")
        if self.liger:
            parts.append("liger")
        if self.ckpt:
            parts.append("ckpt-offload" if self.offload else "ckpt")
        if self.trl_offload:
            parts.append("trl-offload")
        if self.row_lens:
            parts.append("packed-" + "-".join(map(str, self.row_lens)))
        if self.completion_only:
            parts.append(f"completion{self.completion_only}")
        if self.accum > 1:
            parts.append(f"acc{self.accum}")
        if self.steps != 3:
            parts.append(f"{self.steps}steps")
        if self.at_required:
            parts.append("at-required")
        if self.bisect:
            parts.append("bisect")
        if self.load != "config":
            parts.append(self.load)
        if self.alloc_conf:
            parts.append(self.alloc_conf.replace("_segments:True", "").replace(":", "-")
                         .replace(",", "+").replace("_", "-"))
        shape = f"b{self.batch}s{self.seq_len}" + (f"t{self.target_len}" if self.target_len else "") \
            + (f"c{self.completion_len}" if self.completion_len else "")
        return ".".join([*parts, shape])

    def settings(self) -> dict[str, Any]:
        """What ``--list`` shows: every setting, the family and what the case needs."""
        return {"family": self.family, "model": self.model, "task": self.task,
                "trainer": self.trainer, "precision": self.precision, "method": self.method,
                "optim": self.optim if self.stage == "train" else "none",
                "attn": self.attn or "default",
                "ckpt": ("offload" if self.offload else "on") if self.ckpt else "off",
                "accum": self.accum, "batch": self.batch, "seq": self.seq_len,
                "target": self.target_len or "-", "stage": self.stage, "steps": self.steps,
                "liger": "on" if self.liger else "off",
                "trl_offload": "on" if self.trl_offload else "off", "load": self.load,
                "packing": "-".join(map(str, self.row_lens)) if self.row_lens else "off",
                "completion_only": self.completion_only or "off",
                "bisect": "on" if self.bisect else "off", "alloc_conf": self.alloc_conf or "-",
                "attn_dropout": MODELS[self.model].attention_dropout(),
                "needs": ",".join(self.needs) or "-"}

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Case:
        rows = d.get("row_lens")
        return cls(**{**d, "row_lens": tuple(rows)} if rows is not None else d)

    def rows(self, n: int) -> list[int]:
        """The lengths of ``n`` rows: ``row_lens`` cycled, else ``seq_len`` each."""
        lens = self.row_lens or (self.seq_len,)
        return [lens[i % len(lens)] for i in range(n)]

    def lora(self) -> dict[str, Any] | None:
        """peft.LoraConfig kwargs of a LoRA / QLoRA case, else None."""
        if self.method == "full":
            return None
        return {"r": 16, "lora_alpha": 32, "lora_dropout": 0.05, "bias": "none",
                "task_type": "CAUSAL_LM", "target_modules": list(MODELS[self.model].lora_targets)}

    def quantization(self) -> dict[str, Any] | None:
        """BitsAndBytesConfig kwargs (dtype as a name) of a QLoRA case, else None."""
        return dict(NF4) if self.method == "qlora" else {"load_in_8bit": True} \
            if self.method == "lora_8bit" else None


def _c(model: str, precision: str, optim: str = "adamw_torch", **kw: Any) -> Case:
    return Case(model, precision, optim, **kw)


FB = {"stage": "forward_backward"}
T5_SHAPE = {"seq_len": 512, "target_len": 128, "attn": None}  # T5: the model's own attention

# The bisect cases come first, so that a cut run never loses them: each finds, on the GPU, the
# smallest allocator capacity at which 2 steps complete (5 probes of ~5-6 s each, one child
# process each, plus at most one probe of a bound: ~30-40 s a case, ~3.5 minutes for the six),
# recorded next to the estimate's `required`. Small models and 2 steps keep each probe short.
BISECT = {"bisect": True, "steps": 2}
BISECT_CASES: tuple[Case, ...] = (
    # plain fp32 (reserved 5% over allocated on the H200)
    _c("llama-160m", "fp32", **BISECT),
    # AMP bf16 with checkpointing; its at-required case completed at the estimate's required
    _c("llama-160m", "amp_bf16", "adamw_torch_fused", batch=8, ckpt=True, **BISECT),
    # LoRA: few trainable parameters, activations dominate
    _c("llama-160m", "amp_bf16", batch=8, method="lora", **BISECT),
    # GQA Qwen2 (14/2 heads), a 152k vocabulary: the logits and the loss dominate the peak
    _c("qwen2-0.5b", "amp_bf16", "adamw_torch_fused", **BISECT),
    # accumulation: 4 micro-batches a step, gradients held across them
    _c("llama-160m", "amp_bf16", accum=4, seq_len=512, **BISECT),
    # large fragmentation: reserved 28% over allocated, 11% over the estimate's peak_reserved on
    # the H200 (its at-required case asks whether the step completes at `required`)
    _c("qwen2-0.5b", "pure_bf16", "adafactor", **BISECT),
)

CASES: tuple[Case, ...] = (
    *BISECT_CASES,
    # llama-160m: every precision, both attentions, checkpointing, accumulation, 3 optimizers
    _c("llama-160m", "fp32"),
    _c("llama-160m", "fp32", attn="eager", seq_len=512),
    _c("llama-160m", "amp_bf16", "adamw_torch_fused", batch=8),
    _c("llama-160m", "amp_bf16", "adamw_torch_fused", batch=8, ckpt=True),
    _c("llama-160m", "amp_bf16", "adamw_torch_fused", batch=8, ckpt=True, offload=True),
    _c("llama-160m", "amp_fp16"),
    _c("llama-160m", "amp_bf16", accum=4, seq_len=512),
    _c("llama-160m", "pure_bf16", batch=8),
    _c("llama-160m", "fp32", "adafactor", attn="eager", ckpt=True),
    _c("llama-160m", "amp_bf16", batch=8, method="lora"),
    _c("llama-160m", "fp32", **FB),
    _c("llama-160m", "fp32", "adamw_bnb_8bit"),
    _c("llama-160m", "amp_bf16", batch=8, method="qlora"),
    _c("llama-160m", "amp_bf16", batch=8, ckpt=True, method="qlora"),
    # QLoRA on the GQA / 152k-vocabulary Qwen2; LoRA on an 8-bit (LLM.int8) base, both families
    _c("qwen2-0.5b", "amp_bf16", ckpt=True, method="qlora"),
    _c("llama-160m", "amp_bf16", batch=8, method="lora_8bit"),
    _c("qwen2-0.5b", "amp_bf16", ckpt=True, method="lora_8bit"),
    # Llama-3.2-1B (1.24 B)
    _c("llama-1.2b", "amp_bf16", "adamw_torch_fused", ckpt=True),
    _c("llama-1.2b", "pure_bf16", batch=2),
    _c("llama-1.2b", "pure_bf16", method="lora"),
    # Qwen2.5-0.5B (GQA 14/2, tied, 152k vocabulary)
    _c("qwen2-0.5b", "amp_bf16", "adamw_torch_fused"),
    _c("qwen2-0.5b", "fp32", attn="eager", batch=2, seq_len=512),
    _c("qwen2-0.5b", "amp_fp16", "adamw_torch_fused", ckpt=True, accum=2),
    _c("qwen2-0.5b", "pure_bf16", "adafactor"),
    _c("qwen2-0.5b", "amp_bf16", ckpt=True, method="lora"),
    _c("qwen2-0.5b", "pure_bf16", **FB),
    _c("qwen2-0.5b", "amp_bf16", "adamw_bnb_8bit", ckpt=True),
    # Qwen2.5-1.5B (1.54 B)
    _c("qwen2-1.5b", "amp_bf16", "adamw_torch_fused", ckpt=True),
    # gpt2 (Conv1D, tied, learned positions) and gpt2-medium
    _c("gpt2-124m", "fp32", batch=8),
    _c("gpt2-124m", "fp32", attn="eager", batch=8, seq_len=512),
    _c("gpt2-124m", "amp_fp16", batch=8),
    _c("gpt2-124m", "amp_bf16", "adafactor", batch=8, accum=2),
    _c("gpt2-124m", "amp_bf16", "adamw_torch_fused", attn="eager", batch=8, ckpt=True),
    _c("gpt2-355m", "pure_bf16", "adamw_torch_fused", batch=8),
    # bert sequence classification, attention dropout 0.1
    _c("bert-base-cls", "fp32", batch=32, seq_len=512),
    _c("bert-base-cls", "fp32", attn="eager", batch=32, seq_len=256),
    _c("bert-base-cls", "amp_fp16", "adamw_torch_fused", batch=32, seq_len=512),
    _c("bert-base-cls", "amp_bf16", "adafactor", batch=32, seq_len=512, ckpt=True),
    _c("bert-base-cls", "pure_bf16", attn="eager", batch=32, seq_len=512),
    _c("bert-large-cls", "amp_bf16", batch=16, seq_len=512, accum=2),
    # t5-base (encoder-decoder, 128-token labels)
    _c("t5-220m", "fp32", batch=8, **T5_SHAPE),
    _c("t5-220m", "amp_bf16", "adafactor", batch=16, ckpt=True, **T5_SHAPE),
    _c("t5-220m", "amp_bf16", "adamw_torch_fused", batch=8, accum=2, **T5_SHAPE),
    # TRL's SFTTrainer / DPOTrainer (their fused log-prob head), Liger kernels, TRL's activation
    # offloading (saved activations in pinned host memory)
    _c("llama-160m", "amp_bf16", trainer="sft"),
    _c("llama-160m", "amp_bf16", trainer="sft", trl_offload=True),
    # packing: rows of 700 / 300 / 520 / 180 tokens packed (BFD) into 1024-token sequences
    _c("llama-160m", "amp_bf16", trainer="sft", row_lens=(700, 300, 520, 180)),
    # completion-only loss: a 768-token prompt, a 256-token completion (TRL's head scores it)
    _c("qwen2-0.5b", "amp_bf16", trainer="sft", completion_only=256),
    _c("llama-160m", "amp_bf16", trainer="sft", liger=True),
    _c("llama-160m", "amp_bf16", "adamw_torch_fused", batch=8, liger=True),
    _c("llama-160m", "amp_bf16", trainer="dpo", method="lora", seq_len=512),
    _c("llama-160m", "amp_bf16", trainer="dpo", trl_offload=True),
    _c("qwen2-0.5b", "amp_bf16", trainer="sft", liger=True, ckpt=True),
    # issue 26: GRPO generating with the policy's own generate (16 rows: 4 x 4 accumulation;
    # the KV cache of prompt + completion), then scoring-free training (beta 0, aligned)
    _c("llama-160m", "amp_bf16", trainer="grpo", batch=4, accum=4, seq_len=256,
       completion_len=512),
    _c("qwen2-0.5b", "amp_bf16", trainer="grpo", method="lora", batch=4, accum=2, ckpt=True,
       seq_len=256, completion_len=1024),
    # issue #24: how reserved grows over the steps (reserved after each step is recorded for
    # every case; these run longer), and the allocator's fit test: the step capped at the
    # estimate's smallest capacity must complete
    _c("llama-160m", "amp_bf16", "adamw_torch_fused", batch=8, steps=8),
    _c("qwen2-0.5b", "amp_bf16", ckpt=True, method="lora", seq_len=4096, steps=6),
    _c("llama-160m", "amp_bf16", "adamw_torch_fused", batch=8, ckpt=True, at_required=True),
    _c("qwen2-0.5b", "amp_bf16", ckpt=True, method="lora", seq_len=4096, at_required=True),
    # the H200 run of 2026-11-26 (bench/results/gpu) measured reserved 11-12% above the estimate
    # in these two (allocated exact): does the step still complete at the estimate's `required`?
    _c("qwen2-0.5b", "pure_bf16", "adafactor", at_required=True),
    _c("bert-base-cls", "amp_bf16", "adafactor", batch=32, seq_len=512, ckpt=True,
       at_required=True),
    # issue #24's longest-context rows (Unsloth's HF + FA2 table ran transformers 4.46, whose
    # loss kept one more fp32 copy of the logits): at 16k tokens a 128k vocabulary's logits and
    # loss dominate the step; does the current stack's step peak where the estimate says, and
    # does it complete at the estimate's `required`?
    _c("llama-1.2b", "amp_bf16", ckpt=True, method="lora", batch=1, seq_len=16384),
    _c("llama-1.2b", "amp_bf16", ckpt=True, method="lora", batch=1, seq_len=16384,
       at_required=True),
    # expandable segments on, for steps measured above with them off: the allocator maps pages
    # into one growing segment per stream and pool instead of cudaMalloc'ing blocks, so reserved
    # should sit near allocated; the second is the 28%-fragmented Adafactor step
    _c("llama-160m", "amp_bf16", "adamw_torch_fused", batch=8, ckpt=True,
       alloc_conf="expandable_segments:True"),
    _c("qwen2-0.5b", "pure_bf16", "adafactor", alloc_conf="expandable_segments:True"),
    # issue #25: the model saved, then loaded as users load it, from_pretrained(dir,
    # device_map="cuda"): transformers' caching_allocator_warmup reserves a model-sized block
    # first; reserved vs allocated after the load, then the same training
    _c("llama-160m", "amp_bf16", "adamw_torch_fused", batch=8, load="pretrained"),
    _c("gpt2-124m", "pure_bf16", load="pretrained", **FB),
)


# What a lease should measure first: the answers we lack most (issue 43). A run cut by its
# deadline keeps the head of this order. Each entry: (name, test); a case takes the first
# group whose test it passes; the rest keep matrix order within their group.
PRIORITY: tuple[tuple[str, Any], ...] = (
    ("smallest capacity", lambda c: c.bisect or c.at_required),
    ("bitsandbytes", lambda c: "bitsandbytes" in c.needs),
    ("TRL", lambda c: c.trainer != "trainer"),
    ("Liger", lambda c: c.liger),
    ("expandable segments", lambda c: bool(c.alloc_conf)),
    ("long context / pretrained load", lambda c: c.seq_len >= 8192 or c.load != "config"),
    ("the rest", lambda c: True),
)


def priority(case: Case) -> tuple[int, str]:
    """(rank, name) of the first ``PRIORITY`` group ``case`` falls in."""
    return next((i, name) for i, (name, test) in enumerate(PRIORITY) if test(case))


def select(only: list[str] | None = None, *, order: str = "matrix") -> list[Case]:
    """Cases whose id contains any of ``only`` (all when empty), in ``order``: ``"matrix"``
    (as ``CASES`` lists them) or ``"priority"`` (``PRIORITY``'s groups, matrix order inside
    each)."""
    if order not in ("matrix", "priority"):
        raise ValueError(f"order `{order}` is not 'matrix' or 'priority'")
    cases = [c for c in CASES if not only or any(s in c.id for s in only)]
    return sorted(cases, key=lambda c: priority(c)[0]) if order == "priority" else cases
