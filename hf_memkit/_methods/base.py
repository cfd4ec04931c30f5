"""The fine-tuning-method registry: full fine-tuning, LoRA, LoRA on an 8-bit base, QLoRA.

Registration order is the planner's ladder: with ``method="auto"`` the first method with a setup
that fits wins (LoRA changes what is trained, so it is a fallback, never a speed trick). Each
method says which ``method=`` values put it on the ladder, what it needs installed, how the model
is loaded (dtype, quantization, adapters) and prepared, which data-parallel rungs and precisions
it may use, and its compute per token for the cost model.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

from .._compat import is_bitsandbytes_available, is_peft_available, quiet_peft
from .._registry import Registry

if TYPE_CHECKING:
    import torch

# LoRA defaults of the plan (peft.LoraConfig): the QLoRA paper's recipe, adapters on every linear.
LORA_DEFAULTS = dict(r=16, lora_alpha=32, lora_dropout=0.05, target_modules="all-linear")
_EXTRAS = {"peft": ("peft", is_peft_available), "bitsandbytes": ("bnb", is_bitsandbytes_available)}


def half_dtype(dev: Any) -> torch.dtype:
    import torch  # imported on use: the CLI's parsers read this registry without torch

    return torch.bfloat16 if dev.supports_bf16 else torch.float16


class Method:
    """Full fine-tuning; the adapter methods override what differs."""

    name = "full"
    selected_by: tuple[str, ...] = ("auto", "full")  # plan_training(method=...) values
    needs: tuple[str, ...] = ()
    adapters = False
    quant_bits: int | None = None  # bits of the frozen base's quantized weights (None: 16/32-bit)
    slowdown = 1.0           # the step's compute relative to 16-bit matmuls of the same shapes
    note: str | None = None  # said in the plan when chosen

    def available(self) -> bool:
        return all(_EXTRAS[n][1]() for n in self.needs)

    def missing(self) -> str | None:
        """An install hint when a needed package is missing."""
        for n in self.needs:
            extra, ok = _EXTRAS[n]
            if not ok():
                return f"needs {n}: pip install 'hf-memkit[{extra}]'"
        return None

    def allows_precision(self, precision: str) -> bool:
        return True

    def describes(self, has_adapters: bool, quant_bits: int | None) -> bool:
        """Whether a loaded model with (or without) adapters on a base of ``quant_bits`` is
        ready to train with this method as it is."""
        return self.adapters == has_adapters and self.quant_bits == quant_bits

    def allows_rung(self, rung: Any) -> bool:
        return True

    def train_flops(self, n_params: int, n_trainable: int) -> float:
        """FLOPs per token of forward + backward (Kaplan et al. 2020): 2N + 4N."""
        return 6 * n_params

    def load_dtype(self, precision: str, dev: Any) -> torch.dtype | None:
        """The dtype the weights are trained in (None: fp32, from_config's default)."""
        import torch

        return torch.bfloat16 if precision == "pure-bf16" else None

    def model_load_dtype(self, precision: str, dev: Any) -> torch.dtype | None:
        """``Plan.model_kwargs['dtype']``: what ``from_pretrained`` loads."""
        return self.load_dtype(precision, dev)

    def peft_config(self, task: str) -> Any:
        return None

    def quantization_config(self, dev: Any) -> Any:
        return None

    def prepare(self, model: torch.nn.Module, peft_config: Any,
                checkpointing: bool) -> torch.nn.Module:
        return model


class Lora(Method):
    """LoRA adapters on a frozen 16-bit base. A frozen base skips the weight-gradient half of
    its backward: 4N + 6 x trainable per token."""

    name = "lora"
    selected_by = ("auto", "lora")
    needs: tuple[str, ...] = ("peft",)
    adapters = True

    def allows_precision(self, precision: str) -> bool:
        return precision != "pure-bf16"  # adapters train in fp32 under AMP

    def allows_rung(self, rung: Any) -> bool:
        # a frozen 16-bit base shards like any other weights (not offloaded: nothing to gain)
        return rung.replica or (rung.shards_params and not rung.offload)

    def train_flops(self, n_params: int, n_trainable: int) -> float:
        return 4 * n_params + 6 * n_trainable

    def load_dtype(self, precision: str, dev: Any) -> torch.dtype | None:
        # on a GPU the frozen base loads in half precision (peft keeps the adapters in fp32)
        return half_dtype(dev) if dev.kind == "cuda" else None

    def peft_config(self, task: str) -> Any:
        import peft

        from .._model.tasks import TASKS

        return peft.LoraConfig(**LORA_DEFAULTS, task_type=TASKS.get(task).peft_task_type)

    def prepare(self, model: torch.nn.Module, peft_config: Any,
                checkpointing: bool) -> torch.nn.Module:
        import peft

        with quiet_peft():
            model = peft.get_peft_model(model, copy.deepcopy(peft_config))
        if checkpointing:
            model.enable_input_require_grads()
        return model


class KbitLora(Lora):
    """LoRA on a quantized, frozen base (bitsandbytes). Loaded in half precision;
    ``prepare_model_for_kbit_training`` upcasts every non-quantized parameter to fp32, which the
    estimate follows (its trained dtype is fp32). Sharding a k-bit base is not planned."""

    needs = ("peft", "bitsandbytes")

    def allows_rung(self, rung: Any) -> bool:
        return rung.replica

    def load_dtype(self, precision: str, dev: Any) -> torch.dtype | None:
        return None

    def model_load_dtype(self, precision: str, dev: Any) -> torch.dtype | None:
        return half_dtype(dev)

    def prepare(self, model: torch.nn.Module, peft_config: Any,
                checkpointing: bool) -> torch.nn.Module:
        import peft

        with quiet_peft():
            model = peft.prepare_model_for_kbit_training(
                model, use_gradient_checkpointing=checkpointing,
                gradient_checkpointing_kwargs={"use_reentrant": False})
        return super().prepare(model, peft_config, checkpointing)


METHODS: Registry[Method] = Registry("method", " (or 'auto')")


def register(method: Method) -> Method:
    return METHODS.register(method)


def method_choices() -> list[str]:
    """The values of ``plan_training(method=...)``, the CLI's ``--method`` and recipes."""
    out = ["auto"]
    for m in METHODS:
        out += [v for v in m.selected_by if v not in out]
    return out


def ladder(method: str) -> list[Method]:
    """The methods ``method`` tries, in order, that are installed."""
    return [m for m in METHODS if method in m.selected_by and m.available()]
