"""FSDP-QLoRA: QLoRA whose 4-bit base FSDP shards across the ranks (Answer.AI with
bitsandbytes, 2024: 70B on two 24 GB cards; PEFT's guide "Use PEFT QLoRA and FSDP for finetuning
large models on multiple GPUs"; bitsandbytes' ``fsdp_qlora.md``).

FSDP shards floating tensors only, so the packed NF4 weights are stored in the 16-bit compute
dtype (``bnb_4bit_quant_storage=torch.bfloat16``: 4 weights per element, the same bytes as uint8
storage) and the model is loaded in that dtype (``dtype=bnb_4bit_quant_storage``), as PEFT's
``examples/sft`` does, without ``prepare_model_for_kbit_training``'s fp32 upcast: the frozen
embeddings, head and norms stay 16-bit and shard with the rest. With a ``Params4bit`` in the model
accelerate's ``fsdp2_prepare_model`` upcasts nothing, so the adapters keep the fp32 peft gives
them; transformers' ``update_fsdp_plugin_peft`` sets FSDP's mixed precision to the storage dtype.
Offered only on rungs that shard a 4-bit base (``Rung.shards_4bit``: FSDP2's); on one GPU and on
replicas ``qlora`` is the same model with nothing to shard.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .base import Lora, half_dtype, register
from .qlora import QLora

if TYPE_CHECKING:
    import torch


class FsdpQLora(QLora):
    name = "fsdp-qlora"
    selected_by = ("auto", "qlora")
    float_storage = True
    note = ("FSDP-QLoRA: the 4-bit base is stored in bf16 (bnb_4bit_quant_storage) so that FSDP "
            "shards it, and loaded in bf16 without prepare_model_for_kbit_training's fp32 upcast")

    def allows_rung(self, rung: Any) -> bool:
        return rung.shards_4bit

    def allows_precision(self, precision: str) -> bool:
        # mixed precision in the storage dtype (PEFT's guide: bf16 storage for bf16 training)
        return precision == "bf16"

    def load_dtype(self, precision: str, dev: Any) -> torch.dtype | None:
        return half_dtype(dev)

    def model_load_dtype(self, precision: str, dev: Any) -> torch.dtype | None:
        return half_dtype(dev)

    def prepare(self, model: torch.nn.Module, peft_config: Any,
                checkpointing: bool) -> torch.nn.Module:
        return Lora.prepare(self, model, peft_config, checkpointing)  # no k-bit upcast


register(FsdpQLora())
