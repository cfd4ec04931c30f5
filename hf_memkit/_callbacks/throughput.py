"""``ThroughputCallback``: samples/s, tokens/s, TFLOP/s, MFU and HFU at each logging step.

FLOPs per token, after the PaLM paper's appendix B (Chowdhery et al. 2022, "PaLM: Scaling
Language Modeling with Pathways", arXiv:2204.02311), as nanoGPT's ``estimate_mfu`` also does:

    model FLOPs / token = 6·N + 12·L·h·s
        6·N      = 2·N forward + 4·N backward (2·N activation grads + 2·N weight grads),
                   N = parameters that do matmuls (the input embedding lookup does none, so it
                   is left out unless tied to the output head)
        12·L·h·s = attention scores and weighted sum, forward (4·L·h·s) + backward (8·L·h·s);
                   L layers, h hidden size (heads × head dim), s the (padded) sequence length
    frozen base (LoRA/QLoRA): 2·N + 2·N + 2·N_trainable (no weight grads for frozen params)
    hardware FLOPs (HFU) with activation checkpointing: + 2·N + 4·L·h·s per token, the recomputed
        forward (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
        Transformer Models", arXiv:2205.05198)

MFU = model FLOP/s ÷ peak; HFU = hardware FLOP/s ÷ peak, with the device's dense catalog peak
for the precision in use (``DeviceInfo.peak_tflops``: bf16, fp16, tf32 or fp32). With no catalog
peak (CPU, or a GPU missing from the catalog) MFU and HFU are skipped with one warning.

Cost: a forward pre-hook on the model reads the batch's shape (host) and adds the attention
mask's sum into a device scalar (no sync); the clock and the one ``.item()`` happen at log steps,
right after the Trainer's own loss ``.item()``. FLOPs count padding (the hardware computes it);
tokens/s counts real tokens (attention mask).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
from transformers import TrainerCallback

from ._order import add_to_logs, move_ahead_of_reporters

logger = logging.getLogger(__name__)

PREFIX = "throughput/"


def _text_config(config):
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def flops_per_token_terms(model) -> dict[str, float]:
    """N (matmul params), N_trainable, L and h of a (peft-wrapped) model."""
    params = {id(p): p for p in model.parameters()}
    n_total = sum(p.numel() for p in params.values())
    n_train = sum(p.numel() for p in params.values() if p.requires_grad)
    emb_in = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    emb_out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    lookup = 0
    if emb_in is not None and getattr(emb_in, "weight", None) is not None:
        tied = emb_out is not None and getattr(emb_out, "weight", None) is emb_in.weight
        if not tied:
            lookup = emb_in.weight.numel()
            if emb_in.weight.requires_grad:
                n_train -= lookup
    cfg = _text_config(getattr(model, "config", None)) if getattr(model, "config", None) else None
    layers = getattr(cfg, "num_hidden_layers", None) or getattr(cfg, "n_layer", 0) or 0
    hidden = getattr(cfg, "hidden_size", None) or getattr(cfg, "n_embd", 0) or 0
    return {"N": float(n_total - lookup), "N_trainable": float(max(n_train, 0)),
            "L": float(layers), "h": float(hidden)}


def flops_per_token(terms: dict[str, float], seq_len: int, *, checkpointing: bool = False
                    ) -> tuple[float, float]:
    """(model FLOPs, hardware FLOPs) per token of a training step at sequence length ``seq_len``."""
    n, nt, lh = terms["N"], terms["N_trainable"], terms["L"] * terms["h"]
    model = 4 * n + 2 * nt + 12 * lh * seq_len         # = 6N + 12Lhs when everything trains
    hardware = model + (2 * n + 4 * lh * seq_len if checkpointing else 0.0)
    return model, hardware


def precision_of(args, model) -> str:
    if getattr(args, "bf16", False):
        return "bf16"
    if getattr(args, "fp16", False):
        return "fp16"
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    if dtype in (torch.bfloat16, torch.float16):
        return "bf16" if dtype == torch.bfloat16 else "fp16"
    if getattr(args, "tf32", False) or torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return "fp32"


def _checkpointing(args, model) -> bool:
    """Whether activation checkpointing is on: the model's own flag (the Trainer has applied the
    arguments by ``on_train_begin``), else the arguments."""
    flag = getattr(model, "is_activation_checkpointing", None)
    if flag is None:
        flag = getattr(model, "is_gradient_checkpointing", None)
    if flag is not None:
        return bool(flag)
    return bool(getattr(args, "activation_checkpointing", False)
                or getattr(args, "gradient_checkpointing", False))


class ThroughputCallback(TrainerCallback):
    """Log `throughput/*` at each logging step: samples/s, tokens/s, TFLOP/s, MFU and HFU.

    The FLOP counts and the cost are in this module's docstring. Only the main process logs.

    Args:
        device (`DeviceInfo` or `str`, *optional*):
            A `DeviceInfo`, a catalog name (`"H100-80GB"`) or `None` for `probe_device()`:
            where the catalog peak for MFU comes from.
    """

    def __init__(self, device: Any = None):
        if device is not None:
            from .._device.probe import resolve_device

            resolve_device(device)   # an unknown GPU name: refused here, not at train begin
        self.device = device
        self._handle = None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self._active = bool(state.is_world_process_zero) and model is not None
        if not self._active:
            return
        move_ahead_of_reporters(self)
        from .._device.probe import resolve_device

        info = resolve_device(self.device)
        self.precision = precision_of(args, model)
        peak = (info.peak_tflops or {}).get(self.precision) or 0.0
        self.peak_flops = peak * 1e12 * (args.n_gpu if args.n_gpu > 1 else 1)
        if not self.peak_flops:
            logger.warning("no catalog peak %s TFLOP/s for %s; throughput/mfu and throughput/hfu "
                           "are not logged", self.precision, info.name)
        self.terms = flops_per_token_terms(model)
        self.checkpointing = _checkpointing(args, model)
        self._reset_counters(args.device)
        self._t0 = time.perf_counter()
        if self._handle is not None:
            self._handle.remove()
        self._handle = model.register_forward_pre_hook(self._count, with_kwargs=True)

    def _reset_counters(self, device) -> None:
        self.samples = 0
        self.padded_tokens = 0
        self.model_flops = 0.0
        self.hw_flops = 0.0
        self.tokens_unpadded = torch.zeros((), dtype=torch.long, device=device)
        self.has_mask = True

    def _count(self, module, args, kwargs):
        if not module.training:
            return None
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            ids = kwargs.get("inputs_embeds")
        if not torch.is_tensor(ids) or ids.dim() < 2:
            return None
        b, s = int(ids.shape[0]), int(ids.shape[1])
        self.samples += b
        self.padded_tokens += b * s
        mf, hf = flops_per_token(self.terms, s, checkpointing=self.checkpointing)
        self.model_flops += mf * b * s
        self.hw_flops += hf * b * s
        mask = kwargs.get("attention_mask")
        if torch.is_tensor(mask) and mask.dim() == 2:
            self.tokens_unpadded += mask.sum()
        else:
            self.has_mask = False
        return None

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not self._active or logs is None or "loss" not in logs:
            return
        now = time.perf_counter()
        dt = max(now - self._t0, 1e-9)
        tokens = int(self.tokens_unpadded.item()) if self.has_mask else self.padded_tokens
        m = {f"{PREFIX}samples_per_second": self.samples / dt,
             f"{PREFIX}tokens_per_second": tokens / dt,
             f"{PREFIX}tflops": self.model_flops / dt / 1e12}
        if self.peak_flops:
            m[f"{PREFIX}mfu"] = self.model_flops / dt / self.peak_flops
            m[f"{PREFIX}hfu"] = self.hw_flops / dt / self.peak_flops
        add_to_logs(state, logs, m)
        self._reset_counters(self.tokens_unpadded.device)
        self._t0 = time.perf_counter()

    def on_train_end(self, args, state, control, **kwargs):
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
