"""``trl.SFTTrainer``: the fused log-prob head and SFTConfig's batch shaping.

Read from ``SFTTrainer.__init__`` / ``compute_loss`` and ``DataCollatorForLanguageModeling``
(TRL 1.16, ``trl/trainer/sft_trainer.py``):
  * the model's head and loss are replaced by ``add_fused_lm_head`` (``fused_head``), with
    ``outputs=("log_probs", "entropy", "is_top1")``; the loss is ``-log_probs`` summed over the
    label positions and divided by their count; ``loss_type="dft"`` multiplies each token's loss
    by its detached probability;
  * ``max_length`` truncates every row: the default ``seq_len``;
  * ``padding_free`` (or ``packing`` with the "bfd"/"bfd_split" strategy, which turns it on)
    flattens the micro-batch into one row with ``position_ids`` and no attention mask: its
    tokens are what the rows hold, not rows x the longest; packing fills each sequence up to
    ``max_length``. ``pad_to_multiple_of`` rounds a padded batch's length up;
  * ``activation_offloading`` moves saved activations to pinned host memory on CUDA
    (``trl/models/activation_offloading.py``; ``offload``), refused on a CPU.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from .base import BatchShape, TraceStep, TrlTrainerKind, padded_length, register
from .data import token_rows, word_tokenizer
from .fused_head import SFT_OUTPUTS, add_head, fold_context, head_notes


class SFTStep(TraceStep):
    title = "SFTTrainer"

    def __init__(self, options: Mapping[str, Any]) -> None:
        super().__init__(options)
        self.dft = options.get("loss_type") == "dft"

    def prepare(self, model: Any, *, adapters: bool) -> None:
        super().prepare(model, adapters=adapters)
        add_head(model, SFT_OUTPUTS)

    def kernels(self, target: Any) -> Any:
        return fold_context(target, self.options)

    def loss(self, model: Any, batch: dict[str, Any], reference: Any = None) -> Any:
        out = model(**batch, fused_lm_head=True)             # SFTTrainer.compute_loss
        per_token = -out.log_probs
        if self.dft:
            per_token = per_token * out.log_probs.exp().detach()
        return per_token.sum() / out.label_mask.sum().clamp(min=1)


class SFT(TrlTrainerKind):
    name = "sft"
    title = "SFTTrainer"
    config_class = "trl.SFTConfig"
    fields = ("max_length", "packing", "packing_strategy", "padding_free", "loss_type",
              "pad_to_multiple_of", "activation_offloading", "completion_only_loss",
              "assistant_only_loss")
    lengths_plan = True
    # measured with max_seq_len: Llama-3.2-1B on an RTX 4090, bf16, micro-batch 1
    memory_difference = (
        "its step holds far less per token than Trainer's on the same arguments: SFTConfig "
        "turns gradient checkpointing on unless the arguments set it (TrainingArguments leaves "
        "it off), and TRL's fused head computes the loss in tiles of at most 4096 tokens, never "
        "the full [tokens x vocab] logits Trainer's loss keeps (e.g. Llama-3.2-1B on an RTX "
        "4090, bf16, micro-batch 1: 10432 tokens with SFTTrainer, 2816 with its checkpointing "
        "off, 1536 with Trainer, 3072 with Trainer and checkpointing)")

    def read(self, get: Callable[[str], Any]) -> dict[str, Any]:
        packing = bool(get("packing"))
        strategy = str(get("packing_strategy") or "bfd")
        return {"max_length": get("max_length"), "packing": packing,
                "padding_free": bool(get("padding_free")) or (
                    packing and strategy in ("bfd", "bfd_split")),
                "loss_type": "nll" if get("loss_type") in ("nll", "chunked_nll") else
                str(get("loss_type")),
                "pad_to_multiple_of": get("pad_to_multiple_of"),
                "packing_strategy": strategy if packing else None,
                "activation_offloading": bool(get("activation_offloading")),
                # None: on for prompt-completion datasets (SFTTrainer._prepare_dataset)
                "completion_only_loss": get("completion_only_loss"),
                "assistant_only_loss": bool(get("assistant_only_loss"))}

    def config_problems(self, options: Mapping[str, Any]) -> list[str]:
        # SFTTrainer.__init__ (TRL 1.16): padding-free without packing does not truncate the
        # rows, so it raises unless max_length is None (text datasets; vision is not modelled)
        ml = options.get("max_length")
        if options.get("padding_free") and not options.get("packing") and ml is not None:
            return [f"padding_free=True without packing needs max_length=None, got max_length="
                    f"{ml}: SFTTrainer refuses it (without packing it does not truncate the rows, "
                    "so max_length is not enforced). Set max_length=None and truncate the rows "
                    "beforehand, or pack them (packing=True)"]
        return []

    def _masked(self, options: Mapping[str, Any]) -> str | None:
        if options.get("assistant_only_loss"):
            return "what is outside the assistant turns (assistant_only_loss)"
        if options.get("completion_only_loss") is not False:
            return "the prompt (completion_only_loss, on for prompt-completion data)"
        return None

    def completion_problem(self, options: Mapping[str, Any]) -> str | None:
        if self._masked(options) is None:
            return ("completion_len: SFTConfig(completion_only_loss=False) labels every token, "
                    "so TRL's head scores every position; drop completion_len, or set "
                    "completion_only_loss=True / assistant_only_loss=True")
        return None

    def shape(self, options: Mapping[str, Any], batch: int, seq: int) -> BatchShape:
        if options.get("tokens"):  # the largest micro-batch of estimate_memory(lengths=...)
            return BatchShape(1, padded_length(options, options["tokens"]), packed=True)
        if options.get("padding_free"):
            return BatchShape(1, batch * seq, packed=True)
        return BatchShape(batch, padded_length(options, seq))

    def step(self, options: Mapping[str, Any]) -> TraceStep:
        return SFTStep(options)

    def notes(self, options: Mapping[str, Any]) -> list[str]:
        notes = ["SFTTrainer: TRL's fused log-prob head (tiles of <= 4096 tokens x 32768 "
                 "vocab), not the model's logits and loss"]
        explicit = options.get("completion_only_loss") or options.get("assistant_only_loss")
        if explicit or options.get("completion_len"):
            notes += head_notes(options, self._masked(options))
        if options.get("tokens"):
            notes.append(f"padding-free: the largest micro-batch of the given lengths, "
                         f"{options['tokens']} tokens in one row"
                         + (" (the fullest BFD bins)" if options.get("packing")
                            else " (the longest rows)"))
        elif options.get("padding_free"):
            notes.append("padding-free: the micro-batch is one row of micro_batch x seq_len "
                         "tokens (seq_len: the mean row length; packing: full bins of "
                         "max_length, an upper bound when the bins are not full; "
                         "lengths=[...] gives the real bins)")
        return notes

    def build(self, *, model: Any, args: Any, rows: Any, data_collator: Any,
              processing_class: Any, callbacks: list[Any], oom_guard: bool) -> Any:
        """``trl.SFTTrainer`` over ``rows`` pre-tokenized (``data.token_rows``); ``processing_class``
        None: ``word_tokenizer`` over the model's vocabulary."""
        import datasets
        import trl

        if processing_class is None:
            processing_class = word_tokenizer(model.config.get_text_config().vocab_size)
        return trl.SFTTrainer(model=model, args=args,
                              train_dataset=datasets.Dataset.from_list(token_rows(rows)),
                              processing_class=processing_class, callbacks=callbacks)


register(SFT())
