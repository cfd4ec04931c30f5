"""GPU ground truth: real ``transformers.Trainer`` runs (and TRL's ``SFTTrainer`` /
``DPOTrainer``) on one CUDA GPU, measured, next to the estimate hf_memkit makes of the same run.

    python bench/gpu_truth.py [--out DIR] [--only SUBSTR ...] [--timeout S] [--gpu INDEX] [--list]
                              [--estimate-workers N] [--quick]

Each case of ``bench/_gpu_cases.py`` (models built from configs with random weights, synthetic
tokens, nothing downloaded) runs in its own child process (``--run-one``), so the CUDA context and
the peaks are clean. Every child sees one device only: ``CUDA_VISIBLE_DEVICES`` is the full UUID of
CUDA device ``--gpu`` (NVML's, else "GPU-"/"MIG-" + torch's), so the Trainer never wraps the model
in ``nn.DataParallel`` (``n_gpu`` = visible devices); a probe child must see exactly that one device
(and NVML that card) or nothing is measured. Each child has a fresh ``HF_MEMKIT_CACHE``: no
calibration or trace the user stored shapes the estimate. In the child:
  * NVML ``used`` of the device (its NVML handle found by the UUID torch reports, else its PCI
    address: NVML's and CUDA's indices differ, ``_gpu_nvml``) is read before CUDA is initialised
    and after ``torch.cuda.init()`` + a synchronise: their difference is the context before any
    tensor; the other processes on the device (pid, bytes) are listed;
  * ``hf_memkit.estimate_memory`` of the same setup (device = ``probe_device()``,
    ``cuda_version=torch.version.cuda``) comes first, so it is kept whatever the run does; a
    failing estimate is recorded as its error;
  * the run takes ``steps`` (3) optimizer steps (or, for ``stage="forward_backward"``, 3 passes of
    ``zero_grad(set_to_none=True); model(**batch).loss.backward()``, no optimizer). After step 1
    the allocator's peaks are reset (``torch.cuda.reset_peak_memory_stats``) and a thread samples
    NVML every 5 ms; after the last step the window closes: steady-state
    ``max_memory_allocated`` / ``max_memory_reserved``, the allocator's ``num_alloc_retries`` and
    ``num_ooms``, the NVML peak and value after the window, the other processes. Step 1's peaks
    (model build included) give the whole-run peak. Each optimizer step logs fp16's GradScaler
    scale and the optimizer state's size: a step whose scale fell was skipped (no optimizer
    state yet), and a window without a real step is flagged and left out of the error table;
  * a run out of device memory is recorded as ``oom``, with the estimate and what it had
    measured so far (peaks, step 1, the NVML peak of the open window);
  * a ``load="pretrained"`` case saves the model and loads it with ``from_pretrained(dir,
    device_map="cuda")`` (transformers' caching_allocator_warmup reserves a model-sized block
    first): allocated and reserved after the load are recorded.
The measured ``device_used`` is the NVML peak minus NVML used before CUDA init (what this process
added: reserved + context + workspaces); both raw values are recorded. NVML comes from
``pynvml`` (nvidia-ml-py), else ``libnvidia-ml.so.1`` through ctypes, else (no baseline)
``torch.cuda.mem_get_info``.

Output: one JSON file in ``bench/results/gpu/`` (or ``--out``), named after GPU, torch and date,
rewritten after every case so an interrupted run keeps what it measured; then a table of the
relative error (predicted / measured - 1) of allocated, reserved and device_used.
Without a CUDA GPU it says so and exits 0. bitsandbytes, deepspeed, TRL and Liger are never
imported at top level; a case runs only where what it needs imports (``Case.needs``: bitsandbytes
for 8-bit AdamW and QLoRA, ``trl`` for ``trainer="sft"`` / ``"dpo"``, ``liger_kernel`` for
``use_liger_kernel``), else it is recorded as skipped. TRL cases train through
``TrainerKind.build`` (what ``hf-memkit train`` builds): ``SFTConfig`` / ``DPOConfig`` with
``max_length = seq_len``, SFT rows of ``seq_len`` pre-tokenized tokens, DPO pairs whose prompt +
chosen is ``seq_len`` tokens (rejected one shorter), DPO's reference the LoRA policy's own
adapters, else a frozen copy.
Bisect cases (``Case(bisect=True)``, first in the matrix; ``--only .bisect.``) measure the
smallest allocator capacity at which the case's steps complete, next to the estimate's
``required`` (``bench/_gpu_bisect.py``): the parent bisects the capacity between bounds from the
estimate (peak_allocated less 5%; the larger of upper and device_used + 10%, less context), each
probe a child process (``--probe-one``, a clean context) that caps the allocator with
``torch.cuda.set_per_process_memory_fraction(capacity / total_memory)`` for the whole run; an
OOM (or the probe's ``--probe-timeout``) is "does not complete". The fraction limits the
allocator's reserved bytes, not the CUDA context: the capacity found is compared with
``required`` after adding the context the probes measured (NVML after CUDA init less before)
and, apart, what their process held beyond the allocator at its peak (device_used less
max_reserved); every raw value is recorded (the probes' capacities, fractions and outcomes,
the bracket, the estimate's required / device_used / upper / margin). ``--bisect-probes``
(default 5; plus at most one probe of a bound) and ``--bisect-confirm`` set the search.
``--cpu-smoke`` runs the selected cases shrunk, on the CPU, to check the plumbing (tests only:
its measurements are zeros); it records Liger and TRL activation-offloading cases as skipped
(Triton kernels; ``OffloadActivations`` needs an accelerator). A bisect case's probes run the
same search there, a capacity below the estimate's own failing with a fake OOM.
``--quick`` runs ``QUICK`` (a full fine-tune and a LoRA one, when no ``--only``) into ``--out``,
which it needs (never ``bench/results/``). Exit status 1 when no case ran, or a case ended in an
error or a timeout (out of memory and skipped are results).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import datetime
import gc
import importlib
import importlib.util
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
for _p in (str(ROOT), str(BENCH)):  # hf_memkit from this checkout, no install needed
    if _p not in sys.path:
        sys.path.insert(0, _p)

from _gpu_bisect import (  # noqa: E402
    COMPLETED,
    ERROR,
    GRANULARITY,
    OOM,
    PROBES,
    TIMEOUT,
    bisect_capacity,
    compare,
    outside_allocator,
    search_bounds,
)
from _gpu_cases import (  # noqa: E402
    MODELS,
    PRECISION_ARGS,
    QUANTIZED,
    Case,
    priority,
    select,
)
from _gpu_facts import (  # noqa: E402
    case_flags,
    is_oom,
    largest_segments,
    load_facts,
    oom_facts,
    optimizer_step_facts,
    step_record,
)
from _gpu_nvml import PeakSampler, open_nvml, pin_device, reader_processes  # noqa: E402,F401
from _gpu_report import (  # noqa: E402,F401  (the tests read them here)
    METRICS,
    _jsonable,
    bisect_summary,
    measured_values,
    predicted_values,
    print_bisect,
    print_summary,
    probe_line,
    progress_line,
    rel_errors,
    render_bisect,
    render_summary,
    result_filename,
    sanitize,
    summarise,
    unique_path,
    write_json,
)
from _quick import add_flag, guard  # noqa: E402

MARK = "@@GPU_TRUTH "
DEFAULT_OUT = BENCH / "results" / "gpu"
QUICK = ("llama-160m.fp32.adamw_torch.sdpa.b4s1024",
         "llama-160m.amp_bf16.lora.adamw_torch.sdpa.b8s1024")
SCHEMA = 2  # 2: pinned device, oom status, flags, estimate before the run
# imported by the probe child (cases and hf_memkit need them); the heavy ones only looked up
IMPORT_CHECK = ("peft", "bitsandbytes", "pynvml", "rich", "yaml", "psutil", "hf_memkit")
LOOKUP_ONLY = ("deepspeed", "trl", "liger_kernel")
AUTO_CLASS = {"causal-lm": "AutoModelForCausalLM",
              "sequence-classification": "AutoModelForSequenceClassification",
              "seq2seq-lm": "AutoModelForSeq2SeqLM"}
FB_LOOP = "per pass: model.zero_grad(set_to_none=True); model(**batch).loss.backward()"


# --------------------------------------------------------------------------------------------
# child: one measured run
# --------------------------------------------------------------------------------------------
class CudaStats:
    """The caching allocator's counters; zeros in a CPU smoke run."""

    def __init__(self, enabled: bool):
        import torch

        self.torch, self.enabled = torch, enabled

    def sync(self) -> None:
        if self.enabled:
            self.torch.cuda.synchronize()

    def snapshot(self) -> dict[str, int | None]:
        """Peaks since the last reset, current figures, and the allocator's cumulative
        ``num_alloc_retries`` (cache flushed and the cudaMalloc retried) and ``num_ooms``
        (None in a CPU smoke run)."""
        c = self.torch.cuda
        if not self.enabled:
            return {"max_allocated": 0, "max_reserved": 0, "allocated": 0, "reserved": 0,
                    "num_alloc_retries": None, "num_ooms": None}
        ms = c.memory_stats()
        return {"max_allocated": int(c.max_memory_allocated()),
                "max_reserved": int(c.max_memory_reserved()),
                "allocated": int(c.memory_allocated()), "reserved": int(c.memory_reserved()),
                "num_alloc_retries": int(ms.get("num_alloc_retries", 0)),
                "num_ooms": int(ms.get("num_ooms", 0))}

    def segments(self) -> list[dict[str, int]] | None:
        return largest_segments(self.torch.cuda.memory_snapshot()) if self.enabled else None

    def reset_peak(self) -> None:
        if self.enabled:
            self.torch.cuda.reset_peak_memory_stats()

    def reserved(self) -> int:
        return int(self.torch.cuda.memory_reserved()) if self.enabled else 0


def state_bytes(optimizer: Any) -> int | None:
    """Bytes of the optimizer state tensors (an accelerate wrapper is looked through)."""
    opt = getattr(optimizer, "optimizer", optimizer)
    state = getattr(opt, "state", None)
    if state is None:
        return None
    total = 0
    for per_param in state.values():
        for v in (per_param.values() if isinstance(per_param, dict) else ()):
            if hasattr(v, "element_size") and hasattr(v, "numel"):
                total += v.numel() * v.element_size()
    return total


class Window:
    """Opens after step 1 (peaks reset, NVML sampling on), closes after the last step. Every step
    is logged: reserved, and for an optimizer step the GradScaler's scale (``scale``, set where
    fp16 has one), accelerate's ``step_was_skipped`` and the optimizer state's size."""

    def __init__(self, stats: CudaStats, nvml: Any, last_step: int):
        self.stats, self.nvml, self.last = stats, nvml, last_step
        self.sampler = PeakSampler(nvml.used)
        self.result: dict[str, Any] = {}
        self.t0 = 0.0
        self.scale: Any = None  # () -> the GradScaler's scale, where there is one
        self.scale_before: float | None = None
        self.steps: list[dict[str, Any]] = []

    def after_step(self, step: int, optimizer: Any = None) -> None:
        # how reserved grows over the steps (a host-side counter: no sync)
        self.result.setdefault("reserved_per_step", []).append(self.stats.reserved())
        if optimizer is not None:
            self.steps.append(step_record(step, optimizer,
                                          self.scale() if self.scale is not None else None))
        if step == 1:
            self.stats.sync()
            self.result["step1"] = self.stats.snapshot()
            self.stats.reset_peak()
            self.sampler.start()
            self.t0 = time.perf_counter()
        if step == self.last and "step1" in self.result:
            self.stats.sync()
            seconds = time.perf_counter() - self.t0
            steady = self.stats.snapshot()
            sampled = self.sampler.stop()
            steady.update(nvml_used_peak=sampled["peak"], nvml_used_after=self.nvml.used(),
                          nvml_samples=sampled["samples"], nvml_errors=sampled["errors"],
                          seconds=seconds, steps=self.last - 1)
            self.result["steady"] = steady
            self.result["other_processes"] = reader_processes(self.nvml)
            self.result["optimizer_state_bytes"] = state_bytes(optimizer)
        if self.steps:
            self.result["optimizer_steps"] = optimizer_step_facts(self.steps, self.scale_before)

    def so_far(self) -> tuple[dict[str, Any], int | None]:
        """(what the window holds, the NVML peak of a window still open) after a failure."""
        peak = self.sampler.stop()["peak"] if self.sampler.running else None
        return self.result, peak


def init_cuda(nvml: Any, smoke: bool) -> dict[str, Any]:
    """NVML used before CUDA init and after ``torch.cuda.init()`` + a synchronise; the other
    processes on the device before; what the device is; where calibrations are read."""
    before = nvml.used()
    processes_before = reader_processes(nvml)
    loading_before = os.environ.get("CUDA_MODULE_LOADING")
    import torch

    if not smoke:
        torch.cuda.init()
        torch.cuda.synchronize()  # creates the primary context
        time.sleep(0.1)
    after = nvml.used()
    return {"nvml_used_before_cuda": before, "nvml_used_after_cuda_init": after,
            "context_bytes": after - before if before is not None and after is not None else None,
            "cuda_module_loading_before_init": loading_before,
            "cuda_module_loading": os.environ.get("CUDA_MODULE_LOADING"),
            "nvml_source": nvml.source, "nvml_failures": getattr(nvml, "failures", []),
            **device_facts(nvml, smoke), "other_processes_before": processes_before,
            "calibration_cache": calibration_cache()}


def device_facts(nvml: Any, smoke: bool) -> dict[str, Any]:
    """The device this child sees: how many (one: pinned), what CUDA says device 0 is, and the
    NVML device read for it (found by UUID or PCI address, never by index)."""
    import torch

    try:
        nvml_uuid = nvml.uuid()
    except Exception as exc:
        nvml_uuid = f"unknown ({type(exc).__name__}: {exc})"
    return {"cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "visible_device_count": 0 if smoke else torch.cuda.device_count(),
            "cuda_device": getattr(nvml, "ids", None), "nvml_mapping": getattr(nvml, "mapping", None),
            "nvml_uuid": nvml_uuid}


def calibration_cache() -> dict[str, Any]:
    """Where hf_memkit reads stored calibrations in this child, and whether that folder is this
    child's own fresh one (``HF_MEMKIT_CACHE`` set and empty): a calibration stored by the
    user must not shape the estimate the measurement is compared with."""
    from hf_memkit._store import cache_root

    root = Path(cache_root())
    entries = sorted(p.name for p in root.iterdir()) if root.is_dir() else []
    isolated = bool(os.environ.get("HF_MEMKIT_CACHE")) and not entries
    return {"root": str(root), "HF_MEMKIT_CACHE": os.environ.get("HF_MEMKIT_CACHE"),
            "entries_at_start": entries[:20], "isolated": isolated}


def model_config(case: Case, smoke: bool) -> Any:
    import transformers

    d = MODELS[case.model].config_dict(smoke=smoke)
    return transformers.AutoConfig.for_model(d.pop("model_type"), **d)


def weights_dtype(case: Case) -> Any:
    import torch

    return torch.bfloat16 if case.precision == "pure_bf16" or case.method in QUANTIZED \
        else torch.float32


def _from_pretrained(auto: Any, workdir: str, stats: CudaStats, **kwargs: Any
                     ) -> tuple[Any, dict[str, Any]]:
    """``auto.from_pretrained(workdir, **kwargs)`` and the memory around it (``load_facts``):
    with a ``device_map``, transformers' caching_allocator_warmup reserves a model-sized block
    before the weights arrive."""
    gc.collect()
    stats.sync()
    stats.reset_peak()
    before = stats.snapshot()
    model = auto.from_pretrained(workdir, **kwargs)
    stats.sync()
    after = stats.snapshot()
    how = f"from_pretrained(dir, device_map={kwargs.get('device_map')!r})"
    return model, load_facts(how, model, before, after, stats.segments())


def _quantized(case: Case, config: Any, auto: Any, kw: dict[str, Any], device: str,
               workdir: str, stats: CudaStats) -> tuple[Any, dict[str, Any]]:
    """QLoRA / LoRA on an 8-bit base as users load it: from_config rejects
    quantization_config, so save then load."""
    import peft
    import torch
    import transformers

    auto.from_config(config, dtype=weights_dtype(case), **kw).save_pretrained(workdir)
    q = case.quantization()
    if "bnb_4bit_compute_dtype" in q:
        q["bnb_4bit_compute_dtype"] = getattr(torch, q["bnb_4bit_compute_dtype"])
    model, load = _from_pretrained(auto, workdir, stats, dtype=weights_dtype(case),
                                   quantization_config=transformers.BitsAndBytesConfig(**q),
                                   device_map={"": 0 if device == "cuda" else device}, **kw)
    return peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=case.ckpt), load


def build_model(case: Case, device: str, workdir: str, smoke: bool, stats: CudaStats
                ) -> tuple[Any, dict[str, Any] | None]:
    """(model, its load's memory or None): random weights placed straight on ``device``, or (load
    "pretrained", QLoRA) saved to ``workdir`` and loaded with ``device_map``; LoRA / QLoRA applied
    as users do."""
    import torch
    import transformers

    config = model_config(case, smoke)
    auto = getattr(transformers, AUTO_CLASS[case.task])
    kw = {"attn_implementation": case.attn} if case.attn else {}
    torch.manual_seed(0)
    load = None
    if case.method in QUANTIZED:
        model, load = _quantized(case, config, auto, kw, device, workdir, stats)
    elif case.load == "pretrained":  # the CPU copy is saved, then freed before the load
        auto.from_config(config, dtype=weights_dtype(case), **kw).save_pretrained(workdir)
        model, load = _from_pretrained(auto, workdir, stats, dtype=weights_dtype(case),
                                       device_map=device, **kw)
    else:
        with torch.device(device):
            model = auto.from_config(config, dtype=weights_dtype(case), **kw)
    if case.lora():
        import peft

        model = peft.get_peft_model(model, peft.LoraConfig(**case.lora()))
    return model, load


def n_rows(case: Case) -> int:
    """Rows the run trains on: a micro-batch per forward for ``steps + 1`` steps; with SFT
    packing, enough rows of the shortest length to fill as many packed sequences."""
    n = case.batch * case.accum * (case.steps + 1)
    return -(-n * case.seq_len // min(case.row_lens)) if case.row_lens else n


def examples(case: Case, vocab: int, n: int) -> list[dict[str, Any]]:
    """``n`` random-token examples of the case's lengths (``Case.rows``) with the labels its
    task needs."""
    import torch

    g = torch.Generator().manual_seed(1)
    out = []
    for length in case.rows(n):
        ids = torch.randint(0, vocab, (length,), generator=g)
        ex = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        if case.completion_only:  # SFT: the row's last tokens are the completion
            ex["completion_mask"] = (torch.arange(length) >= length - case.completion_only).long()
        if case.task == "causal-lm":
            ex["labels"] = ids.clone()
        elif case.task == "seq2seq-lm":
            ex["labels"] = torch.randint(0, vocab, (case.target_len or case.seq_len,), generator=g)
        else:
            ex["labels"] = torch.tensor(0)
        out.append(ex)
    return out


def collate(xs: list[dict[str, Any]]) -> dict[str, Any]:
    import torch

    return {k: torch.stack([x[k] for x in xs]) for k in xs[0]}


def memory_args(case: Case, fields: set[str] | dict[str, Any]) -> dict[str, Any]:
    """The TrainingArguments (SFTConfig / DPOConfig) fields that set the run's memory (also given
    to the estimate). Checkpointing goes under the installed version's field name (transformers 5
    renamed it). TRL's configs default to bf16 and checkpointing on: a TRL case states both."""
    ckpt = ("activation_checkpointing" if "activation_checkpointing" in fields
            else "gradient_checkpointing")
    a: dict[str, Any] = {"per_device_train_batch_size": case.batch,
                         "gradient_accumulation_steps": case.accum,
                         **PRECISION_ARGS[case.precision]}
    if case.stage == "train":
        a["optim"] = case.optim
    if case.ckpt:
        a[ckpt] = True
        a[ckpt + "_kwargs"] = {"use_reentrant": False}
        if case.offload:  # checkpointed layer inputs in pinned host memory
            a[ckpt + "_kwargs"]["offload"] = True
    if case.liger:
        a["use_liger_kernel"] = True
    if case.trainer == "grpo":  # seq_len is the prompt; completions to max_completion_length
        a = {"bf16": False, ckpt: False, **a, "max_completion_length": case.completion_len,
             "num_generations": 4, "beta": 0.0}
    elif case.trainer != "trainer":  # DPO: the longest chosen / rejected row (prompt included)
        a = {"bf16": False, ckpt: False, **a, "max_length": case.seq_len}
        if case.row_lens:  # SFT rows packed (BFD, TRL's default strategy) into max_length
            a["packing"] = True
        if case.completion_only:  # the loss on the completion_mask's tokens alone
            a["completion_only_loss"] = True
        if case.trl_offload:  # TRL's saved-activation offloading to pinned host memory
            a["activation_offloading"] = True
    return a


def _window_callback(window: Window) -> Any:
    import transformers

    class _WindowCallback(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, optimizer=None, **kw):
            window.after_step(state.global_step, optimizer)

    return _WindowCallback()


def args_class(case: Case) -> type:
    """``TrainingArguments``, or TRL's ``SFTConfig`` / ``DPOConfig`` for a TRL case."""
    from hf_memkit._trainers import TRAINERS

    return TRAINERS.get(case.trainer).config_type()


def trl_trainer(case: Case, model: Any, args: Any, data: list[dict[str, Any]],
                callbacks: list[Any]) -> Any:
    """TRL's trainer as ``hf-memkit train`` builds it (``TrainerKind.build``): SFT over the
    rows' ``input_ids`` (``seq_len`` tokens, pre-tokenized), DPO over preference pairs made
    from them; both with the in-memory word-level tokenizer (``hf_memkit._trainers.data``)."""
    from hf_memkit._trainers import TRAINERS

    return TRAINERS.get(case.trainer).build(model=model, args=args, rows=data,
                                            data_collator=None, processing_class=None,
                                            callbacks=callbacks, oom_guard=False)


def train(case: Case, model: Any, data: list[dict[str, Any]], window: Window, workdir: str,
          smoke: bool) -> dict[str, Any]:
    """``case.steps`` optimizer steps of the real Trainer (or TRL's), nothing logged, saved or
    evaluated."""
    import transformers

    cls = args_class(case)
    fields = {f.name for f in dataclasses.fields(cls)}
    run = {"output_dir": os.path.join(workdir, "out"), "max_steps": case.steps,
           "report_to": "none", "save_strategy": "no", "logging_strategy": "no",
           "eval_strategy": "no", "disable_tqdm": True, "dataloader_num_workers": 0,
           "learning_rate": 1e-4, "seed": 0, "use_cpu": smoke}
    args = cls(**memory_args(case, fields), **{k: v for k, v in run.items() if k in fields})
    callbacks = [_window_callback(window)]
    if case.trainer == "trainer":
        trainer = transformers.Trainer(model=model, args=args, train_dataset=data,
                                       data_collator=collate, callbacks=callbacks)
    else:
        trainer = trl_trainer(case, model, args, data, callbacks)
    scaler = getattr(trainer.accelerator, "scaler", None)  # fp16's GradScaler
    if scaler is not None:
        window.scale = lambda: float(scaler.get_scale())
        window.scale_before = window.scale()
    trainer.train()
    opt = trainer.optimizer
    return {"optimizer_class": type(getattr(opt, "optimizer", opt)).__name__,
            "trainer_class": type(trainer).__name__, "args_class": type(args).__name__,
            "grad_scaler_scale": float(scaler.get_scale()) if scaler is not None else None,
            "global_step": trainer.state.global_step,
            # one device: no nn.DataParallel (n_gpu is the visible device count)
            "n_gpu": args.n_gpu, "is_model_parallel": getattr(trainer, "is_model_parallel", None),
            "model_wrapped_class": type(trainer.model_wrapped).__name__}


def forward_backward(case: Case, model: Any, data: list[dict[str, Any]], window: Window,
                     device: str) -> dict[str, Any]:
    """A custom loop: the model's own loss, backward, no optimizer (``stage="forward_backward"``)."""
    model.train()
    b = case.batch
    for step in range(1, case.steps + 1):
        batch = {k: v.to(device) for k, v in collate(data[(step - 1) * b: step * b]).items()}
        model.zero_grad(set_to_none=True)
        loss = model(**batch).loss
        loss.backward()
        window.after_step(step)
    return {"loop": FB_LOOP}


def _model_facts(model: Any) -> dict[str, Any]:
    params = list(model.parameters())
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    cfg = getattr(base, "config", None)
    return {"total_params": sum(p.numel() for p in params),
            "trainable_params": sum(p.numel() for p in params if p.requires_grad),
            "param_bytes": sum(p.numel() * p.element_size() for p in params),
            "attn_implementation_used": getattr(cfg, "_attn_implementation", None),
            "model_class": type(base).__name__}


class CaseOOM(Exception):
    """The run ran out of device memory; ``record`` is what it had measured by then."""

    def __init__(self, record: dict[str, Any]):
        super().__init__(record["oom"]["error"])
        self.record = record


def _oom_record(exc: BaseException, stats: CudaStats, nvml: Any, window: Window | None,
                context: dict[str, Any]) -> dict[str, Any]:
    """What ``measure`` had read when ``exc`` (an out-of-memory error) ended the run."""
    w, nvml_peak = window.so_far() if window is not None else ({}, None)
    steps_done = len(w.get("reserved_per_step", []))
    try:
        stats.sync()
        snap: dict[str, Any] | None = stats.snapshot()
    except Exception as read_exc:  # the device may refuse even that
        snap = {"error": f"{type(read_exc).__name__}: {read_exc}"[:300]}
    during = ("building the model" if window is None else
              f"step {steps_done + 1} of {window.last}")
    rec = oom_facts(exc, snapshot=snap, window=w, nvml_peak=nvml_peak,
                    baseline=context.get("nvml_used_before_cuda"), during=during)
    rec["other_processes"] = reader_processes(nvml)
    rec["traceback"] = traceback.format_exc()[-2000:]
    return rec


def measure(case: Case, nvml: Any, context: dict[str, Any], smoke: bool) -> dict[str, Any]:
    """Build, run, and read the window; ``device_used`` is the NVML peak minus NVML before CUDA.
    Out of device memory: ``CaseOOM`` with what was measured so far."""
    stats = CudaStats(enabled=not smoke)
    device = "cpu" if smoke else "cuda"
    t0 = time.perf_counter()
    stats.reset_peak()  # the estimate ran before: its peaks (none expected) are not the run's
    before_build = stats.snapshot()
    window = None
    try:
        with tempfile.TemporaryDirectory() as workdir:
            model, load = build_model(case, device, workdir, smoke, stats)
            after_build = stats.snapshot()
            vocab = model_config(case, smoke).get_text_config().vocab_size
            data = examples(case, vocab, n_rows(case))
            window = Window(stats, nvml, case.steps)
            extra = (train(case, model, data, window, workdir, smoke) if case.stage == "train"
                     else forward_backward(case, model, data, window, device))
            facts = _model_facts(model)
    except Exception as exc:
        if not is_oom(exc):
            raise
        raise CaseOOM(_oom_record(exc, stats, nvml, window, context)) from None
    w = window.result
    if "steady" not in w:
        raise RuntimeError(f"the measurement window never closed (steps seen: {w})")
    base, steady = context["nvml_used_before_cuda"], w["steady"]
    known = base is not None and steady["nvml_used_peak"] is not None
    return {
        **w, **extra, **facts, "before_build": before_build, "after_build": after_build,
        "load": load, "run_seconds": time.perf_counter() - t0,
        "whole_run": {k: max(w["step1"][k], steady[k]) for k in ("max_allocated", "max_reserved")},
        "device_used": steady["nvml_used_peak"] - base if known else steady["nvml_used_peak"],
        "device_used_after": (steady["nvml_used_after"] - base
                              if base is not None and steady["nvml_used_after"] is not None
                              else steady["nvml_used_after"]),
        "device_used_basis": "nvml_used - nvml_used_before_cuda" if known else "raw (no baseline)",
    }


def estimate_kwargs(case: Case, smoke: bool) -> dict[str, Any]:
    """Every keyword of ``estimate_memory`` but model, args and device, for the measured setup."""
    import torch

    peft_config = quant = None
    if case.lora():
        import peft

        peft_config = peft.LoraConfig(**case.lora())
    if case.quantization():
        import transformers

        q = case.quantization()
        if "bnb_4bit_compute_dtype" in q:
            q["bnb_4bit_compute_dtype"] = getattr(torch, q["bnb_4bit_compute_dtype"])
        quant = transformers.BitsAndBytesConfig(**q)
    trainer = {"trainer": case.trainer} if case.trainer != "trainer" else {}
    if case.row_lens:  # the rows describe the batch: lengths, not seq_len (estimate_memory)
        trainer["lengths"] = case.rows(n_rows(case))
    if case.completion_only:
        trainer["completion_len"] = case.completion_only
    return {"seq_len": None if case.row_lens else case.seq_len, "stage": case.stage,
            "cuda_version": torch.version.cuda,
            "task": case.task, "target_len": case.target_len,
            "attn_implementation": case.attn,
            "dtype": None if case.method in QUANTIZED else weights_dtype(case),
            "peft_config": peft_config, "quantization_config": quant, **trainer}


@contextlib.contextmanager
def alloc_env(alloc_conf: str | None) -> Iterator[None]:
    """``PYTORCH_CUDA_ALLOC_CONF`` as the case sets it while the block runs (the estimate reads
    it from the environment): the measured run's child has it already; bench/gpu_reestimate.py,
    re-estimating in one process, does not."""
    keys = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
    saved = {k: os.environ.pop(k) for k in keys if k in os.environ}
    if alloc_conf:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = alloc_conf
    try:
        yield
    finally:
        for k in keys:
            os.environ.pop(k, None)
        os.environ.update(saved)


def estimate(case: Case, smoke: bool, device: dict[str, Any] | None = None,
             cuda_version: str | None = None) -> dict[str, Any]:
    """hf_memkit's estimate of the same run; its error string if it raises. ``device``: the
    measured device as ``DeviceInfo.to_dict`` (``--estimate-workers``: the estimate is made in a
    process that sees no GPU; bench/gpu_reestimate.py: a recorded run's), else this process's
    device, probed. ``cuda_version``: the measured run's (default: this torch's)."""
    t0 = time.perf_counter()
    try:
        import transformers

        import hf_memkit as mk

        fields = {f.name for f in dataclasses.fields(transformers.TrainingArguments)}
        dev = mk.DeviceInfo.from_dict(device) if device is not None else mk.probe_device()
        with warnings.catch_warnings(record=True) as caught, alloc_env(case.alloc_conf):
            warnings.simplefilter("always")
            kw = estimate_kwargs(case, smoke)
            if cuda_version is not None:
                kw["cuda_version"] = cuda_version
            e = mk.estimate_memory(model_config(case, smoke), memory_args(case, fields),
                                   device=dev, **kw)
        return {"peak_allocated": e.peak_allocated, "peak_reserved": e.peak_reserved,
                "device_used": e.device_used, "peak_phase": e.peak_phase,
                "band": list(e.band), "uncertainty": e.uncertainty, "to_dict": e.to_dict(),
                "warnings": sorted({str(w.message) for w in caught})[:20],
                "seconds": time.perf_counter() - t0}
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:],
                "seconds": time.perf_counter() - t0}


def capped(case: Case, nvml: Any, context: dict[str, Any], capacity: int, smoke: bool,
           fake_threshold: int | None = None) -> dict[str, Any]:
    """``measure`` with the caching allocator capped at ``capacity`` bytes of reserved memory:
    ``torch.cuda.set_per_process_memory_fraction(capacity / total_memory)`` for the whole run
    (model build included), reset after it. The fraction bounds what the allocator reserves
    (its segments), not the CUDA context. Out of memory: ``CaseOOM``.

    ``--cpu-smoke`` (no allocator to cap): the shrunk run is measured on the CPU, then a capacity
    below ``fake_threshold`` raises a fake ``torch.OutOfMemoryError`` through the same
    ``CaseOOM`` record, so the bisection's plumbing runs end to end."""
    import torch

    if smoke:
        out = measure(case, nvml, context, True)
        if fake_threshold is not None and capacity < fake_threshold:
            exc = torch.OutOfMemoryError(
                f"CUDA out of memory (--cpu-smoke's fake OOM: a capacity of {capacity} B is "
                f"below the fake threshold of {fake_threshold} B)")
            raise CaseOOM(oom_facts(exc, snapshot=out["steady"], window=None, nvml_peak=None,
                                    baseline=None, during=f"step {case.steps} of {case.steps}"))
        return out
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, capacity / total), 0)
    try:
        return measure(case, nvml, context, False)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, 0)


def at_required(case: Case, nvml: Any, context: dict[str, Any], est: dict[str, Any]
                ) -> dict[str, Any]:
    """The run with the caching allocator capped at the estimate ``est``'s ``required`` less the
    context: the fit test of issue #24 says it completes (the allocator frees cached blocks and
    retries before an OOM). An OOM is the result, not a failure of the harness."""
    if "error" in est:
        return {"at_required": None, "estimate_error": est["error"]}
    d = est["to_dict"]
    cap = d["required"] - d["breakdown"].get("context", 0)
    try:
        out = capped(case, nvml, context, cap, False)
        out["at_required"] = {"completed": True, "capacity": cap}
    except CaseOOM as oom:
        out = {**oom.record, "at_required": {"completed": False, "capacity": cap,
                                             "oom": oom.record["oom"]["error"]}}
    return out


def emit(kind: str, payload: dict[str, Any]) -> None:
    print(MARK + json.dumps({"kind": kind, "data": payload}, default=_jsonable), flush=True)


def shrunk(case: Case, smoke: bool) -> Case:
    """The case as it runs: shrunk on the CPU under ``--cpu-smoke``."""
    if not smoke:
        return case
    rows = tuple(max(2, r * 32 // case.seq_len) for r in case.row_lens) if case.row_lens \
        else None
    return dataclasses.replace(case, batch=min(case.batch, 2), seq_len=32,
                               target_len=16 if case.target_len else None,
                               completion_len=16 if case.completion_len else None,
                               completion_only=8 if case.completion_only else None,
                               row_lens=rows)


def run_one(case: Case, smoke: bool, ready: dict[str, Any] | None = None) -> None:
    """Child entry: context, estimate, measurement; each printed as soon as it is known. The
    estimate comes before the run, so a run that runs out of memory (recorded as ``oom`` with
    what it measured so far) keeps it. ``ready``: the estimate, made ahead by a process that saw
    no GPU (``--estimate-workers``)."""
    case = shrunk(case, smoke)
    nvml = open_nvml(0, smoke=smoke)
    context = init_cuda(nvml, smoke)
    emit("context", context)
    est = ready if ready is not None else estimate(case, smoke)
    emit("estimate", est)
    gc.collect()
    try:
        emit("measured", at_required(case, nvml, context, est) if case.at_required and not smoke
             else measure(case, nvml, context, smoke))
    except CaseOOM as oom:
        emit("oom", oom.record)
    nvml.close()


def probe_one(case: Case, capacity: int, smoke: bool, fake_threshold: int | None = None
              ) -> None:
    """Child entry of a bisect case's probe: the context, then the case's steps with the
    allocator capped at ``capacity`` (``capped``); ``measured`` if they complete, ``oom`` if
    not. No estimate: the parent made it once for the case."""
    case = shrunk(case, smoke)
    nvml = open_nvml(0, smoke=smoke)
    context = init_cuda(nvml, smoke)
    emit("context", context)
    gc.collect()
    try:
        emit("measured", capped(case, nvml, context, capacity, smoke, fake_threshold))
    except CaseOOM as oom:
        emit("oom", oom.record)
    nvml.close()


def _version(module: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(module)
    except Exception:
        return None


def _importable(names: tuple[str, ...]) -> tuple[dict[str, bool], dict[str, str]]:
    ok, errors = {}, {}
    for name in names:
        try:
            importlib.import_module(name)
            ok[name] = True
        except Exception as exc:  # bitsandbytes can fail on import (no CUDA library), not only miss
            ok[name], errors[name] = False, f"{type(exc).__name__}: {exc}"[:300]
    return ok, errors


def probe(smoke: bool) -> None:
    """Child entry: the environment, recorded once per result file."""
    nvml = open_nvml(0, smoke=smoke)
    context = init_cuda(nvml, smoke)
    import torch
    import transformers

    ok, errors = _importable(IMPORT_CHECK)
    ok.update({m: importlib.util.find_spec(m) is not None for m in LOOKUP_ONLY})
    env: dict[str, Any] = {
        "gpu_name": "cpu-smoke" if smoke else torch.cuda.get_device_name(0),
        "nvml_name": nvml.name(), "driver": nvml.driver(), "nvml_source": nvml.source,
        "compute_capability": None if smoke else ".".join(
            map(str, torch.cuda.get_device_capability(0))),
        "total_memory": None if smoke else int(torch.cuda.get_device_properties(0).total_memory),
        "torch": torch.__version__, "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "transformers": transformers.__version__, "accelerate": _version("accelerate"),
        "peft": _version("peft"), "bitsandbytes": _version("bitsandbytes"),
        "trl": _version("trl"), "liger_kernel": _version("liger_kernel"),
        "nvidia-ml-py": _version("nvidia-ml-py"), "python": platform.python_version(),
        "platform": platform.platform(), "cpu_count": os.cpu_count(),
        "matmul_allow_tf32": bool(torch.backends.cuda.matmul.allow_tf32),
        "importable": ok, "import_errors": errors, "context": context,
        **{k: os.environ.get(k) for k in ("CUDA_MODULE_LOADING", "CUDA_VISIBLE_DEVICES",
                                          "PYTORCH_CUDA_ALLOC_CONF", "CUBLAS_WORKSPACE_CONFIG")},
    }
    emit("env", env)
    import hf_memkit as mk

    emit("device", mk.probe_device().to_dict())
    nvml.close()


# --------------------------------------------------------------------------------------------
# parent: the matrix, the result file, the error table
# --------------------------------------------------------------------------------------------
def child_env(smoke: bool, *, pin: str | None = None, cache: str | None = None,
              alloc_conf: str | None = None) -> dict[str, str]:
    """The child's environment: offline, quiet; ``CUDA_VISIBLE_DEVICES`` the one device ``pin``
    (a full UUID: one device, so the Trainer wraps nothing in nn.DataParallel), none in a CPU
    smoke run; ``HF_MEMKIT_CACHE`` the fresh folder ``cache`` (no stored calibration or trace of
    the user's reaches the estimate); ``PYTORCH_CUDA_ALLOC_CONF`` the case's ``alloc_conf``
    (unset when None: the allocator's defaults, whatever this process was started with)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]]
                                                       if env.get("PYTHONPATH") else []))
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TRANSFORMERS_VERBOSITY="error", TOKENIZERS_PARALLELISM="false",
               PYTHONWARNINGS="ignore", WANDB_DISABLED="true")
    if smoke:
        env["CUDA_VISIBLE_DEVICES"] = ""
    elif pin is not None:
        env["CUDA_VISIBLE_DEVICES"] = pin
    if cache is not None:
        env["HF_MEMKIT_CACHE"] = cache
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    env.pop("PYTORCH_ALLOC_CONF", None)
    if alloc_conf:
        env["PYTORCH_CUDA_ALLOC_CONF"] = alloc_conf
    return env


def parse_markers(stdout: str) -> dict[str, Any]:
    out = {}
    for line in stdout.splitlines():
        if line.startswith(MARK):
            try:
                msg = json.loads(line[len(MARK):])
                out[msg["kind"]] = msg["data"]
            except (ValueError, KeyError):
                continue
    return out


def _as_text(b: bytes | str | None) -> str:
    return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")


def run_child(flag: list[str], *, timeout: float, smoke: bool, pin: str | None = None,
              alloc_conf: str | None = None) -> tuple[dict[str, Any], int | None, str, float]:
    """(markers, returncode or None on timeout, stderr, seconds) of one child process, pinned to
    the device ``pin``, with a calibration cache of its own (removed after it) and the
    allocator options ``alloc_conf`` (``child_env``)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), *flag] + (["--cpu-smoke"] if smoke
                                                                     else [])
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpu-truth-cache-") as cache:
        try:
            p = subprocess.run(cmd, env=child_env(smoke, pin=pin, cache=cache,
                                                  alloc_conf=alloc_conf),
                               capture_output=True, text=True, timeout=timeout, cwd=str(ROOT))
            stdout, stderr, rc = p.stdout, p.stderr, p.returncode
        except subprocess.TimeoutExpired as exc:  # its output is bytes whatever text= says
            stdout, stderr, rc = _as_text(exc.stdout), _as_text(exc.stderr), None
    return parse_markers(stdout), rc, stderr, time.perf_counter() - t0


def estimate_ahead(case: Case, device: dict[str, Any], *, timeout: float, smoke: bool
                   ) -> dict[str, Any]:
    """The estimate of ``case`` for ``device``, made in a process that sees no GPU (so it makes
    no CUDA context beside the measured run's), while other cases run."""
    parts, rc, stderr, _ = run_child(["--estimate-one", json.dumps(case.to_dict()),
                                      "--device-json", json.dumps(device)],
                                     timeout=timeout, smoke=smoke, pin="",
                                     alloc_conf=case.alloc_conf)
    return parts.get("estimate") or {"error": f"the estimating process recorded no estimate "
                                              f"(returncode {rc}): {_error_line(stderr)}"}


def run_case(case: Case, *, timeout: float, smoke: bool = False,
             pin: dict[str, Any] | None = None, ready: dict[str, Any] | None = None
             ) -> dict[str, Any]:
    """One case in its own process on the device ``pin`` (``pin_device``); its estimate is
    kept whatever happens to the run after it (an OOM: status ``oom``, with what it measured).
    ``ready``: its estimate, made ahead (``estimate_ahead``), which the child then reports."""
    flag = ["--run-one", json.dumps(case.to_dict())]
    with tempfile.TemporaryDirectory(prefix="gpu-truth-estimate-") as tmp:
        if ready is not None:
            path = Path(tmp) / "estimate.json"
            path.write_text(json.dumps(ready, default=_jsonable))
            flag += ["--estimate-file", str(path)]
        parts, rc, stderr, secs = run_child(flag, timeout=timeout, smoke=smoke,
                                            pin=(pin or {}).get("cuda_visible_devices"),
                                            alloc_conf=case.alloc_conf)
    oom = parts.get("oom")
    status = "ok" if "measured" in parts else "oom" if oom else "error"
    rec: dict[str, Any] = {"id": case.id, "family": case.family, "case": case.to_dict(),
                           "status": status, "error": oom["oom"]["error"] if oom else None,
                           "returncode": rc, "seconds": round(secs, 2),
                           "gpu": {k: (pin or {}).get(k) for k in ("uuid", "name")},
                           "context": parts.get("context"),
                           "measured": parts.get("measured") or oom,
                           "estimate": parts.get("estimate")}
    if rc is None and status == "error":
        rec["status"], rec["error"] = "timeout", f"timed out after {timeout:.0f} s"
    elif status == "error":
        rec["error"] = f"child exited with {rc}: " + _error_line(stderr)
    if rec["estimate"] is None:
        rec["estimate"] = {"error": f"the child recorded no estimate (returncode {rc}): "
                                    + _error_line(stderr)}
    if rec["status"] != "ok" or rc != 0:
        rec["stderr_tail"] = stderr[-4000:]
    rec["flags"] = case_flags(rec["measured"])
    rec["rel_error"] = rel_errors(rec)
    return rec


OOM_TEXT = ("out of memory", "outofmemoryerror", "cublas_status_alloc_failed")


def probe_capacity(case: Case, capacity: int, *, total: int, timeout: float, smoke: bool,
                   pin: str | None = None, fake_threshold: int | None = None
                   ) -> dict[str, Any]:
    """One probe of a bisect case: a child process (``--probe-one``) runs the case's steps with
    the allocator capped at ``capacity``. ``outcome``: ``completed``, ``oom`` (also a child that
    died of an out-of-memory error it did not record, e.g. cuBLAS's ALLOC_FAILED), ``timeout``
    (after ``timeout`` s) or ``error``; with what the child measured."""
    flag = ["--probe-one", json.dumps(case.to_dict()), "--capacity", str(capacity)]
    if fake_threshold is not None:
        flag += ["--fake-threshold", str(fake_threshold)]
    parts, rc, stderr, secs = run_child(flag, timeout=timeout, smoke=smoke, pin=pin,
                                        alloc_conf=case.alloc_conf)
    m, oom = parts.get("measured"), parts.get("oom")
    outcome = (COMPLETED if m else OOM if oom else TIMEOUT if rc is None
               else OOM if any(t in stderr.lower() for t in OOM_TEXT) else ERROR)
    steady = (m or {}).get("steady") or (oom or {}).get("peak_so_far") or {}
    error = (oom["oom"]["error"] if oom else f"timed out after {timeout:.0f} s"
             if outcome == TIMEOUT else None if m else _error_line(stderr))
    rec: dict[str, Any] = {
        "capacity": capacity, "fraction": capacity / total, "outcome": outcome,
        "seconds": round(secs, 2), "returncode": rc,
        "context_bytes": (parts.get("context") or {}).get("context_bytes"),
        **{k: steady.get(k) for k in ("max_allocated", "max_reserved", "num_alloc_retries",
                                      "num_ooms")},
        "whole_run": (m or {}).get("whole_run") or (oom or {}).get("whole_run_so_far"),
        "device_used": (m or {}).get("device_used") if m else (oom or {}).get("device_used_so_far"),
        "oom_during": (oom or {}).get("oom", {}).get("during"), "error": error}
    rec["outside_allocator"] = outside_allocator(rec)  # context + what came after it
    if outcome == ERROR or (outcome == OOM and not oom):
        rec["stderr_tail"] = stderr[-2000:]
    if "context" in parts:
        rec["_context"] = parts["context"]  # the first probe's goes into the record
    print(probe_line(case.id, rec), flush=True)
    return rec


def run_bisect_case(case: Case, env: dict[str, Any], a: argparse.Namespace, *,
                    pin: dict[str, Any] | None = None, ready: dict[str, Any] | None = None
                    ) -> dict[str, Any]:
    """A bisect case: the smallest allocator capacity at which its steps complete, found by
    ``bisect_capacity`` over one child process a probe (``probe_capacity``), between bounds
    from the estimate (``search_bounds``), and set beside the estimate's ``required``
    (``compare``: the capacity plus the measured context). The estimate is ``ready`` (made
    ahead) or made now in a process that sees no GPU. Under ``--cpu-smoke`` a capacity below
    the estimate's own (``required`` less its context) fails with a fake OOM, so the search
    should find that, to its resolution."""
    t0 = time.perf_counter()
    rec: dict[str, Any] = {"id": case.id, "family": case.family, "case": case.to_dict(),
                           "kind": "bisect", "status": "error", "error": None,
                           "gpu": {k: (pin or {}).get(k) for k in ("uuid", "name")},
                           "context": None, "measured": None, "estimate": ready,
                           "flags": {}, "rel_error": {}, "bisect": None}
    if ready is None:
        rec["estimate"] = (estimate_ahead(case, env["device"], timeout=a.timeout,
                                          smoke=a.cpu_smoke) if env.get("device") else
                           {"error": "the probe recorded no device to estimate for"})
    est = rec["estimate"]
    if "error" in est:
        rec["error"] = f"no estimate, no bounds to bisect between: {est['error'][:300]}"
        rec["seconds"] = round(time.perf_counter() - t0, 2)
        return rec
    total = env.get("total_memory") or est["to_dict"]["device"]["total_memory"]
    bounds = search_bounds(est, total, granularity=1 if a.cpu_smoke else GRANULARITY)
    fake = None
    if a.cpu_smoke:  # the fake OOM's threshold: the estimate's own capacity, inside the bracket
        fake = min(bounds["upper"], max(bounds["lower"] + 1, est["to_dict"]["required"]
                                        - bounds["estimate_context"]))
    search = bisect_capacity(
        lambda cap: probe_capacity(case, cap, total=total, timeout=a.probe_timeout,
                                   smoke=a.cpu_smoke, fake_threshold=fake,
                                   pin=(pin or {}).get("cuda_visible_devices")),
        bounds["lower"], bounds["upper"], probes=a.bisect_probes,
        resolution=bounds["target_resolution"], granularity=bounds["granularity"],
        confirm=a.bisect_confirm)
    contexts = [p.pop("_context", None) for p in search["probes"]]
    rec["context"] = next((c for c in contexts if c is not None), None)
    found = search["smallest_completing"]
    rec["bisect"] = {**search, "bounds": bounds, "probe_timeout": a.probe_timeout,
                     "fake_threshold": fake,
                     "smallest_completing_fraction": found / total if found else None,
                     **compare(search, est, [(c or {}).get("context_bytes") for c in contexts])}
    rec["status"] = "error" if search["result"] == ERROR else "ok"
    if rec["status"] == "error":
        last = search["probes"][-1]
        rec["error"] = f"a probe failed (not an OOM): {last.get('error')}"
    rec["seconds"] = round(time.perf_counter() - t0, 2)
    return rec


def _error_line(stderr: str) -> str:
    lines = [ln for ln in stderr.strip().splitlines() if ln.strip()]
    errs = [ln for ln in lines if re.match(r"^[\w.]*(Error|Exception)\b", ln.strip())]
    return (errs or lines or ["(no output)"])[-1].strip()[:500]


def skipped_record(case: Case, missing: list[str], *, reason: str | None = None
                   ) -> dict[str, Any]:
    """A case not run: ``reason``, else the modules it needs that do not import here."""
    return {"id": case.id, "family": case.family, "case": case.to_dict(), "status": "skipped",
            "error": reason or f"needs {', '.join(missing)}, not importable here",
            "measured": None, "estimate": None, "rel_error": {}}


def cpu_smoke_skip(case: Case) -> str | None:
    """Why ``--cpu-smoke`` cannot run ``case`` on a CPU (GPU-only settings), or None."""
    why = [w for on, w in ((case.liger, "Liger's kernels are Triton, GPU only"),
                           (case.trl_offload, "TRL's activation_offloading (OffloadActivations) "
                                              "needs an accelerator")) if on]
    return "--cpu-smoke cannot run it on a CPU: " + "; ".join(why) if why else None


def cuda_present() -> bool:
    """torch.cuda.is_available() (no CUDA context is created in this process)."""
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False


def list_cases(cases: list[Case]) -> None:
    """The matrix, one case a line: id, then key=value settings."""
    for c in cases:
        print(c.id + "  " + " ".join(f"{k}={v}" for k, v in c.settings().items())
              + " priority=" + priority(c)[1].replace(" / ", "/").replace(" ", "-"))
    bnb = sum("bitsandbytes" in c.needs for c in cases)
    here = importlib.util.find_spec("bitsandbytes") is not None
    print(f"{len(cases)} cases; {bnb} need bitsandbytes and run only where it imports "
          f"(installed here: {'yes' if here else 'no'}); {len(cases) - bnb} run without it")
    counts = ", ".join(f"{sum(m in c.needs for c in cases)} need {m} (installed here: "
                       f"{'yes' if importlib.util.find_spec(m) is not None else 'no'})"
                       for m in ("trl", "liger_kernel"))
    gpu_only = sum(cpu_smoke_skip(c) is not None for c in cases)
    print(f"{counts}; {gpu_only} (Liger, TRL activation offloading) run only on a GPU, never "
          "under --cpu-smoke")
    print(f"{sum(c.bisect for c in cases)} bisect cases (the smallest capacity at which the "
          "step completes, by bisection; one child process a probe)")


def check_pin(pin: dict[str, Any], context: dict[str, Any]) -> str | None:
    """What is wrong with the pinned child's view of the device (``context`` of the probe), or
    None: it must see exactly one CUDA device, and NVML must read that one (same UUID)."""
    n, nvml_uuid = context.get("visible_device_count"), context.get("nvml_uuid")
    pin["child_visible_device_count"], pin["child_nvml_uuid"] = n, nvml_uuid
    pin["child_nvml_mapping"] = context.get("nvml_mapping")
    same = (nvml_uuid == pin["uuid"] if pin.get("uuid") and isinstance(nvml_uuid, str)
            and nvml_uuid.startswith(("GPU-", "MIG-")) else None)
    pin["child_reads_pinned_device"] = same
    if n != 1:
        return (f"a child with CUDA_VISIBLE_DEVICES={pin['cuda_visible_devices']} sees {n} "
                "CUDA devices, not one: the Trainer would wrap the model in nn.DataParallel")
    if same is False:
        return (f"the child's NVML reads {nvml_uuid}, not the pinned {pin['uuid']}: its "
                "device_used would be another card's")
    return None


def probe_env(a: argparse.Namespace) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """(the environment a pinned probe child reports, the pin), or (None, pin) after printing
    why not."""
    try:
        pin = None if a.cpu_smoke else pin_device(a.gpu)
    except Exception as exc:  # no such device, or it has no properties
        print(f"cannot pin CUDA device {a.gpu}: {type(exc).__name__}: {exc}")
        return None, None
    parts, rc, stderr, _ = run_child(["--probe"], timeout=a.timeout, smoke=a.cpu_smoke,
                                     pin=pin["cuda_visible_devices"] if pin else None)
    env = parts.get("env")
    if env is not None:
        env["device"] = parts.get("device")  # DeviceInfo.to_dict of the probed device
    if env is None:
        print(f"the environment probe failed ({rc}): {_error_line(stderr)}\n{stderr[-2000:]}")
        return None, pin
    wrong = check_pin(pin, env["context"]) if pin is not None else None
    if wrong:
        print(f"not measuring: {wrong} (pin: {pin})")
        return None, pin
    env["pinned_gpu"] = pin
    return env, pin


class Deadline:
    """``--deadline-s``: start a case only while the time it is expected to take still fits.

    A case is expected to take as long as the longest of its kind so far (bisect cases apart:
    one holds several probes), or ``FIRST_GUESS_S`` before any of its kind has run (an H200 ran
    a case in 13-22 s, a bisect case in ~35 s). A case's own ``--timeout`` is cut to the time
    left, so the last case cannot run past the deadline either."""

    FIRST_GUESS_S = {"case": 20.0, "bisect": 40.0}

    def __init__(self, seconds: float | None, t0: float) -> None:
        self.seconds, self.t0 = seconds, t0
        self.longest: dict[str, float] = {}

    @staticmethod
    def kind(case: Case) -> str:
        return "bisect" if case.bisect else "case"

    def left(self) -> float:
        return float("inf") if self.seconds is None else \
            self.seconds - (time.perf_counter() - self.t0)

    def expected(self, case: Case) -> float:
        k = self.kind(case)
        return self.longest.get(k, self.FIRST_GUESS_S[k])

    def allows(self, case: Case) -> bool:
        return self.expected(case) <= self.left()

    def took(self, case: Case, seconds: float) -> None:
        k = self.kind(case)
        self.longest[k] = max(self.longest.get(k, 0.0), seconds)

    def timeout(self, per_case: float) -> float:
        return max(1.0, min(per_case, self.left()))


def run_matrix(cases: list[Case], a: argparse.Namespace) -> int:
    env, pin = probe_env(a)
    if env is None:
        return 1
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    started = datetime.datetime.now().astimezone()
    path = unique_path(out_dir, result_filename(env["gpu_name"], env["torch"],
                                                started.date().isoformat()))
    doc: dict[str, Any] = {"schema": SCHEMA, "tool": "bench/gpu_truth.py", "argv": sys.argv[1:],
                           "started": started.isoformat(timespec="seconds"), "finished": None,
                           "environment": env, "cases_selected": [c.id for c in cases],
                           "runs": [], "summary": {}}
    where = f" {pin['cuda_visible_devices']} ({pin['pinned_by']})" if pin else ""
    print(f"{env['gpu_name']}{where} (cc {env['compute_capability']}), torch {env['torch']}, "
          f"CUDA {env['cuda']}, transformers {env['transformers']}; NVML: {env['nvml_source']}; "
          f"{len(cases)} cases -> {path}", flush=True)
    t0 = time.perf_counter()

    def skip(case: Case) -> tuple[list[str], str | None]:
        return ([m for m in case.needs if not env["importable"].get(m)],
                cpu_smoke_skip(case) if a.cpu_smoke else None)

    ahead: dict[str, Any] = {}
    pool = None
    if a.estimate_workers > 0 and env.get("device"):
        pool = concurrent.futures.ThreadPoolExecutor(a.estimate_workers)
        ahead = {c.id: pool.submit(estimate_ahead, c, env["device"], timeout=a.timeout,
                                   smoke=a.cpu_smoke)
                 for c in cases if not any(skip(c))}
    clock = Deadline(a.deadline_s, t0)
    doc["deadline_s"], doc["not_reached"] = a.deadline_s, []
    for i, case in enumerate(cases, 1):
        missing, why = skip(case)
        if not (missing or why) and not clock.allows(case):
            doc["not_reached"] = [c.id for c in cases[i - 1:]]
            print(f"deadline: {clock.left():.0f} s left, too few to start {case.id} (about "
                  f"{clock.expected(case):.0f} s); {len(doc['not_reached'])} cases not reached",
                  flush=True)
            break
        ready = ahead[case.id].result() if case.id in ahead else None
        started_case = time.perf_counter()
        rec = (skipped_record(case, missing, reason=why) if missing or why
               else run_bisect_case(case, env, a, pin=pin, ready=ready) if case.bisect
               else run_case(case, timeout=clock.timeout(a.timeout), smoke=a.cpu_smoke, pin=pin,
                             ready=ready))
        if not (missing or why):
            clock.took(case, time.perf_counter() - started_case)
        doc["runs"].append(rec)
        doc["summary"], doc["elapsed_s"] = summarise(doc["runs"]), round(time.perf_counter() - t0)
        doc["bisect_summary"] = bisect_summary(doc["runs"])
        write_json(path, doc)
        print(progress_line(i, len(cases), rec), flush=True)
    if pool is not None:
        pool.shutdown(wait=False, cancel_futures=True)
    doc["finished"] = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    write_json(path, doc)
    print_summary(doc["summary"])
    print_bisect(doc["runs"])
    counts = {s: sum(r["status"] == s for r in doc["runs"])
              for s in ("ok", "oom", "error", "timeout", "skipped")}
    print(f"{counts} in {time.perf_counter() - t0:.0f} s; wrote {path}")
    return 0 if counts["ok"] and not counts["error"] and not counts["timeout"] else 1


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="gpu_truth.py", description="Measure real Trainer runs on this CUDA GPU and compare "
        "them with hf_memkit's estimates; one JSON file of results.")
    ap.add_argument("--out", default=None,
                    help="directory of the result file (default: bench/results/gpu)")
    add_flag(ap)
    ap.add_argument("--only", action="append", metavar="SUBSTR",
                    help="run only cases whose id contains SUBSTR (repeatable: any of them)")
    ap.add_argument("--timeout", type=float, default=120.0,
                    help="seconds per case before its process is killed (default 120)")
    ap.add_argument("--gpu", type=int, default=0, metavar="INDEX",
                    help="CUDA device (this process's numbering) every case runs on, alone: each "
                    "child sees only it, by its UUID (default 0)")
    ap.add_argument("--list", action="store_true",
                    help="print the case matrix (id and settings) and exit; needs no GPU")
    ap.add_argument("--deadline-s", type=float, default=None, metavar="N",
                    help="start no case that would end past N seconds from the start (each "
                    "case is expected to take as long as the longest of its kind so far); the "
                    "file lists the cases not reached (default: no deadline)")
    ap.add_argument("--resume", metavar="FILE",
                    help="leave out the cases FILE (an earlier result file of this harness) "
                    "holds a record of, whatever its status: the second command of a lease "
                    "runs what the first did not reach, into a new file")
    ap.add_argument("--order", choices=("priority", "matrix"), default="priority",
                    help="priority (default): the answers we lack most first (smallest "
                    "capacity, bitsandbytes, TRL, Liger, expandable segments, long context, "
                    "the rest), so a deadline cuts the least informative; matrix: as listed")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="run the cases shrunk on the CPU: checks the plumbing, measures nothing")
    ap.add_argument("--estimate-workers", type=int, default=0, metavar="N",
                    help="make the estimates ahead, N at a time, in processes that see no GPU, "
                    "while the cases run one by one (default 0: each case's process makes its "
                    "own estimate first); the estimate was 57%% of a case's time on an H200, so "
                    "on a machine with many cores the matrix takes about half as long")
    ap.add_argument("--probe-timeout", type=float, default=60.0, metavar="S",
                    help="seconds per probe of a bisect case before its process is killed (a "
                    "timed-out probe counts as not completing; default 60)")
    ap.add_argument("--bisect-probes", type=int, default=PROBES, metavar="N",
                    help="bisection probes per bisect case (each a child process, ~5-6 s on a "
                    f"GPU), plus at most one probe of a bound (default {PROBES})")
    ap.add_argument("--bisect-confirm", type=int, default=0, metavar="N",
                    help="re-probe a bisect case's found capacity up to N times (default 0)")
    ap.add_argument("--run-one", metavar="JSON", help=argparse.SUPPRESS)
    ap.add_argument("--probe-one", metavar="JSON", help=argparse.SUPPRESS)
    ap.add_argument("--capacity", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--fake-threshold", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--estimate-one", metavar="JSON", help=argparse.SUPPRESS)
    ap.add_argument("--device-json", metavar="JSON", help=argparse.SUPPRESS)
    ap.add_argument("--estimate-file", metavar="PATH", help=argparse.SUPPRESS)
    ap.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    return ap


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    if a.run_one:
        ready = json.loads(Path(a.estimate_file).read_text()) if a.estimate_file else None
        run_one(Case.from_dict(json.loads(a.run_one)), a.cpu_smoke, ready)
        return 0
    if a.probe_one:
        probe_one(Case.from_dict(json.loads(a.probe_one)), a.capacity, a.cpu_smoke,
                  a.fake_threshold)
        return 0
    if a.estimate_one:
        case = shrunk(Case.from_dict(json.loads(a.estimate_one)), a.cpu_smoke)
        emit("estimate", estimate(case, a.cpu_smoke, device=json.loads(a.device_json)))
        return 0
    if a.estimate_workers < 0:
        print(f"--estimate-workers must be 0 or more, got {a.estimate_workers}")
        return 2
    if a.bisect_probes < 0 or a.bisect_confirm < 0:
        print("--bisect-probes and --bisect-confirm must be 0 or more")
        return 2
    if a.probe:
        probe(a.cpu_smoke)
        return 0
    if a.deadline_s is not None and a.deadline_s <= 0:
        print(f"--deadline-s must be more than 0 seconds, got {a.deadline_s:g}; give the "
              "seconds the whole run may take, e.g. --deadline-s 540")
        return 2
    cases = select(a.only or (list(QUICK) if a.quick else None), order=a.order)
    if a.resume:
        try:
            done = {r["id"] for r in json.loads(Path(a.resume).read_text())["runs"]}
        except (OSError, ValueError, KeyError, TypeError) as exc:
            print(f"--resume {a.resume}: not a result file of this harness ({exc}); give the "
                  "JSON file an earlier run wrote")
            return 2
        cases = [c for c in cases if c.id not in done]
    guard(a.quick and not a.list, a.out, "--out")
    a.out = a.out or str(DEFAULT_OUT)
    if a.list:
        list_cases(cases)
        return 0
    if not cases and a.resume:
        print(f"every selected case has a record in {a.resume}: nothing left to run")
        return 0
    if not cases:
        print(f"no case id contains any of {a.only}; see --list")
        return 2
    if not a.cpu_smoke and not cuda_present():
        print("No CUDA GPU present (torch.cuda.is_available() is False): nothing to measure.")
        return 0
    return run_matrix(cases, a)


if __name__ == "__main__":
    sys.exit(main())
