"""GPU ground truth: real ``transformers.Trainer`` runs (and TRL's ``SFTTrainer`` /
``DPOTrainer``) on one CUDA GPU, measured, next to the estimate hf_memkit makes of the same run.

    python bench/gpu_truth.py [--out DIR] [--only SUBSTR ...] [--timeout S] [--list]

Each case of ``bench/_gpu_cases.py`` (models built from configs with random weights, synthetic
tokens, nothing downloaded) runs in its own child process (``--run-one``), so the CUDA context and
the peaks are clean:
  * NVML ``used`` of this process's GPU (the first visible one) is read before CUDA is
    initialised and after ``torch.cuda.init()`` + a synchronise: their difference is the context
    before any tensor;
  * the run takes ``steps`` (3) optimizer steps (or, for ``stage="forward_backward"``, 3 passes of
    ``zero_grad(set_to_none=True); model(**batch).loss.backward()``, no optimizer). After step 1
    the allocator's peaks are reset (``torch.cuda.reset_peak_memory_stats``) and a thread samples
    NVML every 5 ms; after the last step the window closes: steady-state
    ``max_memory_allocated`` / ``max_memory_reserved``, the NVML peak and the NVML value after the
    window. Step 1's peaks (model build included) give the whole-run peak;
  * then, in the same child, ``hf_memkit.estimate_memory`` of the same setup (device =
    ``probe_device()``, ``cuda_version=torch.version.cuda``). A failing estimate is recorded as
    its error; the measurement is kept.
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
``--cpu-smoke`` runs the selected cases shrunk, on the CPU, to check the plumbing (tests only:
its measurements are zeros); it records Liger and TRL activation-offloading cases as skipped
(Triton kernels; ``OffloadActivations`` needs an accelerator).
"""

from __future__ import annotations

import argparse
import ctypes
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
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
for _p in (str(ROOT), str(BENCH)):  # hf_memkit from this checkout, no install needed
    if _p not in sys.path:
        sys.path.insert(0, _p)

from _gpu_cases import MODELS, PRECISION_ARGS, Case, select  # noqa: E402
from _gpu_report import (  # noqa: E402,F401  (the tests read them here)
    METRICS,
    _jsonable,
    measured_values,
    predicted_values,
    print_summary,
    progress_line,
    rel_errors,
    render_summary,
    result_filename,
    sanitize,
    summarise,
    unique_path,
    write_json,
)

MARK = "@@GPU_TRUTH "
DEFAULT_OUT = BENCH / "results" / "gpu"
SCHEMA = 1
SAMPLE_INTERVAL_S = 0.005
# imported by the probe child (cases and hf_memkit need them); the heavy ones only looked up
IMPORT_CHECK = ("peft", "bitsandbytes", "pynvml", "rich", "yaml", "psutil", "hf_memkit")
LOOKUP_ONLY = ("deepspeed", "trl", "liger_kernel")
AUTO_CLASS = {"causal-lm": "AutoModelForCausalLM",
              "sequence-classification": "AutoModelForSequenceClassification",
              "seq2seq-lm": "AutoModelForSeq2SeqLM"}
FB_LOOP = "per pass: model.zero_grad(set_to_none=True); model(**batch).loss.backward()"


# --------------------------------------------------------------------------------------------
# NVML: device-wide memory in use on this process's GPU
# --------------------------------------------------------------------------------------------
class _NvmlMemory(ctypes.Structure):  # nvmlMemory_t (v1)
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong),
                ("used", ctypes.c_ulonglong)]


def _nvml_handle(by_index: Callable[[int], Any], by_uuid: Callable[[str], Any], index: int) -> Any:
    """NVML enumerates in PCI order, CUDA in CUDA_VISIBLE_DEVICES order: map one to the other."""
    entries = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
               if v.strip()]
    if index < len(entries):
        entry = entries[index]
        try:
            return by_index(int(entry)) if entry.isdigit() else by_uuid(entry)
        except Exception:
            pass
    return by_index(index)


class _PyNvml:
    source = "pynvml"

    def __init__(self, index: int):
        import pynvml  # nvidia-ml-py

        pynvml.nvmlInit()
        self.m = pynvml
        self.h = _nvml_handle(pynvml.nvmlDeviceGetHandleByIndex,
                              pynvml.nvmlDeviceGetHandleByUUID, index)

    def used(self) -> int | None:
        return int(self.m.nvmlDeviceGetMemoryInfo(self.h).used)

    def name(self) -> str:
        n = self.m.nvmlDeviceGetName(self.h)
        return n.decode() if isinstance(n, bytes) else str(n)

    def driver(self) -> str:
        d = self.m.nvmlSystemGetDriverVersion()
        return d.decode() if isinstance(d, bytes) else str(d)

    def close(self) -> None:
        self.m.nvmlShutdown()


class _CtypesNvml:
    """The same four NVML calls straight from the driver's library (no nvidia-ml-py needed)."""

    source = "libnvidia-ml.so.1 (ctypes)"

    def __init__(self, index: int):
        self.lib = ctypes.CDLL("libnvidia-ml.so.1")
        self._ok(self.lib.nvmlInit_v2())
        self.h = _nvml_handle(self._by_index, self._by_uuid, index)

    @staticmethod
    def _ok(rc: int) -> None:
        if rc != 0:
            raise RuntimeError(f"NVML call failed with nvmlReturn_t {rc}")

    def _by_index(self, i: int) -> ctypes.c_void_p:
        h = ctypes.c_void_p()
        self._ok(self.lib.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(i), ctypes.byref(h)))
        return h

    def _by_uuid(self, uuid: str) -> ctypes.c_void_p:
        h = ctypes.c_void_p()
        self._ok(self.lib.nvmlDeviceGetHandleByUUID(ctypes.c_char_p(uuid.encode()),
                                                     ctypes.byref(h)))
        return h

    def used(self) -> int | None:
        mem = _NvmlMemory()
        self._ok(self.lib.nvmlDeviceGetMemoryInfo(self.h, ctypes.byref(mem)))
        return int(mem.used)

    def _text(self, fn: Any, *args: Any) -> str:
        buf = ctypes.create_string_buffer(96)
        self._ok(fn(*args, buf, ctypes.c_uint(96)))
        return buf.value.decode(errors="replace")

    def name(self) -> str:
        return self._text(self.lib.nvmlDeviceGetName, self.h)

    def driver(self) -> str:
        return self._text(self.lib.nvmlSystemGetDriverVersion)

    def close(self) -> None:
        self.lib.nvmlShutdown()


class _TorchMemInfo:
    """No NVML: device-wide ``total - free`` from CUDA, readable only once CUDA is initialised."""

    source = "torch.cuda.mem_get_info (no NVML: no reading before CUDA init)"

    def __init__(self, index: int):
        self.index = index

    def used(self) -> int | None:
        import torch

        if not torch.cuda.is_initialized():
            return None  # reading it would create the context it is meant to measure
        free, total = torch.cuda.mem_get_info(self.index)
        return int(total - free)

    def name(self) -> None:
        return None

    def driver(self) -> None:
        return None

    def close(self) -> None:
        pass


class _NoNvml(_TorchMemInfo):
    source = "none (cpu smoke)"

    def used(self) -> None:
        return None


def open_nvml(index: int = 0, *, smoke: bool = False) -> Any:
    """The best reader of device memory in use: pynvml, ctypes NVML, else torch's mem_get_info."""
    if smoke:
        return _NoNvml(index)
    failures = []
    for cls in (_PyNvml, _CtypesNvml):
        try:
            reader = cls(index)
            reader.failures = failures
            return reader
        except Exception as exc:
            failures.append(f"{cls.source}: {type(exc).__name__}: {exc}")
    reader = _TorchMemInfo(index)
    reader.failures = failures
    return reader


class PeakSampler:
    """Largest value of ``read()`` seen by a thread polling every ``interval`` seconds."""

    def __init__(self, read: Callable[[], int | None], interval: float = SAMPLE_INTERVAL_S):
        self.read, self.interval = read, interval
        self.peak: int | None = None
        self.samples = self.errors = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _take(self) -> None:
        try:
            v = self.read()
        except Exception:
            self.errors += 1
            return
        self.samples += 1
        if v is not None:
            self.peak = v if self.peak is None else max(self.peak, v)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self._take()

    def start(self) -> None:
        self._take()
        self._thread = threading.Thread(target=self._loop, name="nvml-sampler", daemon=True)
        self._thread.start()

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._take()
        return {"peak": self.peak, "samples": self.samples, "errors": self.errors,
                "interval_s": self.interval}


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

    def snapshot(self) -> dict[str, int]:
        c = self.torch.cuda
        if not self.enabled:
            return {"max_allocated": 0, "max_reserved": 0, "allocated": 0, "reserved": 0}
        return {"max_allocated": int(c.max_memory_allocated()),
                "max_reserved": int(c.max_memory_reserved()),
                "allocated": int(c.memory_allocated()), "reserved": int(c.memory_reserved())}

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
    """Opens after step 1 (peaks reset, NVML sampling on), closes after the last step."""

    def __init__(self, stats: CudaStats, nvml: Any, last_step: int):
        self.stats, self.nvml, self.last = stats, nvml, last_step
        self.sampler = PeakSampler(nvml.used)
        self.result: dict[str, Any] = {}
        self.t0 = 0.0

    def after_step(self, step: int, optimizer: Any = None) -> None:
        # how reserved grows over the steps (a host-side counter: no sync)
        self.result.setdefault("reserved_per_step", []).append(self.stats.reserved())
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
            self.result["optimizer_state_bytes"] = state_bytes(optimizer)


def init_cuda(nvml: Any, smoke: bool) -> dict[str, Any]:
    """NVML used before CUDA init and after ``torch.cuda.init()`` + a synchronise."""
    before = nvml.used()
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
            "nvml_source": nvml.source, "nvml_failures": getattr(nvml, "failures", [])}


def model_config(case: Case, smoke: bool) -> Any:
    import transformers

    d = MODELS[case.model].config_dict(smoke=smoke)
    return transformers.AutoConfig.for_model(d.pop("model_type"), **d)


def weights_dtype(case: Case) -> Any:
    import torch

    return torch.bfloat16 if case.precision == "pure_bf16" or case.method == "qlora" \
        else torch.float32


def _quantized(case: Case, config: Any, auto: Any, kw: dict[str, Any], device: str,
               workdir: str) -> Any:
    """QLoRA as users load it: from_config rejects quantization_config, so save then load."""
    import peft
    import torch
    import transformers

    auto.from_config(config, dtype=weights_dtype(case), **kw).save_pretrained(workdir)
    q = case.quantization()
    q["bnb_4bit_compute_dtype"] = getattr(torch, q["bnb_4bit_compute_dtype"])
    model = auto.from_pretrained(workdir, dtype=weights_dtype(case),
                                 quantization_config=transformers.BitsAndBytesConfig(**q),
                                 device_map={"": 0 if device == "cuda" else device}, **kw)
    return peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=case.ckpt)


def build_model(case: Case, device: str, workdir: str, smoke: bool) -> Any:
    """Random weights placed straight on ``device``; LoRA / QLoRA applied as users do."""
    import torch
    import transformers

    config = model_config(case, smoke)
    auto = getattr(transformers, AUTO_CLASS[case.task])
    kw = {"attn_implementation": case.attn} if case.attn else {}
    torch.manual_seed(0)
    if case.method == "qlora":
        model = _quantized(case, config, auto, kw, device, workdir)
    else:
        with torch.device(device):
            model = auto.from_config(config, dtype=weights_dtype(case), **kw)
    if case.lora():
        import peft

        model = peft.get_peft_model(model, peft.LoraConfig(**case.lora()))
    return model


def examples(case: Case, vocab: int, n: int) -> list[dict[str, Any]]:
    """``n`` random-token examples of the case's length with the labels its task needs."""
    import torch

    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (case.seq_len,), generator=g)
        ex = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
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
    if case.trainer != "trainer":  # DPO: the longest chosen / rejected row (prompt included)
        a = {"bf16": False, ckpt: False, **a, "max_length": case.seq_len}
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
    trainer.train()
    opt = trainer.optimizer
    scaler = getattr(trainer.accelerator, "scaler", None)
    return {"optimizer_class": type(getattr(opt, "optimizer", opt)).__name__,
            "trainer_class": type(trainer).__name__, "args_class": type(args).__name__,
            "grad_scaler_scale": float(scaler.get_scale()) if scaler is not None else None,
            "global_step": trainer.state.global_step}


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


def measure(case: Case, nvml: Any, context: dict[str, Any], smoke: bool) -> dict[str, Any]:
    """Build, run, and read the window; ``device_used`` is the NVML peak minus NVML before CUDA."""
    stats = CudaStats(enabled=not smoke)
    device = "cpu" if smoke else "cuda"
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as workdir:
        model = build_model(case, device, workdir, smoke)
        after_build = stats.snapshot()
        vocab = model_config(case, smoke).get_text_config().vocab_size
        data = examples(case, vocab, case.batch * case.accum * (case.steps + 1))
        window = Window(stats, nvml, case.steps)
        extra = (train(case, model, data, window, workdir, smoke) if case.stage == "train"
                 else forward_backward(case, model, data, window, device))
        facts = _model_facts(model)
    w = window.result
    if "steady" not in w:
        raise RuntimeError(f"the measurement window never closed (steps seen: {w})")
    base, steady = context["nvml_used_before_cuda"], w["steady"]
    known = base is not None and steady["nvml_used_peak"] is not None
    return {
        **w, **extra, **facts, "after_build": after_build, "run_seconds": time.perf_counter() - t0,
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
        q["bnb_4bit_compute_dtype"] = getattr(torch, q["bnb_4bit_compute_dtype"])
        quant = transformers.BitsAndBytesConfig(**q)
    trainer = {"trainer": case.trainer} if case.trainer != "trainer" else {}
    return {"seq_len": case.seq_len, "stage": case.stage, "cuda_version": torch.version.cuda,
            "task": case.task, "target_len": case.target_len,
            "attn_implementation": case.attn,
            "dtype": None if case.method == "qlora" else weights_dtype(case),
            "peft_config": peft_config, "quantization_config": quant, **trainer}


def estimate(case: Case, smoke: bool) -> dict[str, Any]:
    """hf_memkit's estimate of the same run; its error string if it raises."""
    t0 = time.perf_counter()
    try:
        import transformers

        import hf_memkit as mk

        fields = {f.name for f in dataclasses.fields(transformers.TrainingArguments)}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            e = mk.estimate_memory(model_config(case, smoke), memory_args(case, fields),
                                   device=mk.probe_device(), **estimate_kwargs(case, smoke))
        return {"peak_allocated": e.peak_allocated, "peak_reserved": e.peak_reserved,
                "device_used": e.device_used, "peak_phase": e.peak_phase,
                "band": list(e.band), "uncertainty": e.uncertainty, "to_dict": e.to_dict(),
                "warnings": sorted({str(w.message) for w in caught})[:20],
                "seconds": time.perf_counter() - t0}
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:],
                "seconds": time.perf_counter() - t0}


def at_required(case: Case, nvml: Any, context: dict[str, Any]) -> dict[str, Any]:
    """The run with the caching allocator capped at the estimate's ``required`` less the
    context: the fit test of issue #24 says it completes (the allocator frees cached blocks and
    retries before an OOM). An OOM is the result, not a failure of the harness."""
    import torch

    est = estimate(case, False)
    if "error" in est:
        return {"at_required": None, "estimate_error": est["error"]}
    d = est["to_dict"]
    total = torch.cuda.get_device_properties(0).total_memory
    cap = d["required"] - d["breakdown"].get("context", 0)
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), 0)
    try:
        out = measure(case, nvml, context, False)
        out["at_required"] = {"completed": True, "capacity": cap}
    except torch.OutOfMemoryError as exc:
        out = {"at_required": {"completed": False, "capacity": cap,
                               "oom": str(exc).splitlines()[0][:300]}}
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, 0)
    return out


def emit(kind: str, payload: dict[str, Any]) -> None:
    print(MARK + json.dumps({"kind": kind, "data": payload}, default=_jsonable), flush=True)


def run_one(case: Case, smoke: bool) -> None:
    """Child entry: context, measurement, estimate; each printed as soon as it is known."""
    if smoke:
        case = dataclasses.replace(case, batch=min(case.batch, 2), seq_len=32,
                                   target_len=16 if case.target_len else None)
    nvml = open_nvml(0, smoke=smoke)
    context = init_cuda(nvml, smoke)
    emit("context", context)
    if case.at_required and not smoke:
        emit("measured", at_required(case, nvml, context))
    else:
        emit("measured", measure(case, nvml, context, smoke))
    gc.collect()
    if not smoke:
        import torch

        torch.cuda.empty_cache()
    emit("estimate", estimate(case, smoke))
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
    nvml.close()


# --------------------------------------------------------------------------------------------
# parent: the matrix, the result file, the error table
# --------------------------------------------------------------------------------------------
def child_env(smoke: bool) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]]
                                                       if env.get("PYTHONPATH") else []))
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TRANSFORMERS_VERBOSITY="error", TOKENIZERS_PARALLELISM="false",
               PYTHONWARNINGS="ignore", WANDB_DISABLED="true")
    if smoke:
        env["CUDA_VISIBLE_DEVICES"] = ""
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


def run_child(flag: list[str], *, timeout: float, smoke: bool) -> tuple[dict[str, Any], int | None,
                                                                          str, float]:
    """(markers, returncode or None on timeout, stderr, seconds) of one child process."""
    cmd = [sys.executable, str(Path(__file__).resolve()), *flag] + (["--cpu-smoke"] if smoke
                                                                     else [])
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, env=child_env(smoke), capture_output=True, text=True,
                           timeout=timeout, cwd=str(ROOT))
        stdout, stderr, rc = p.stdout, p.stderr, p.returncode
    except subprocess.TimeoutExpired as exc:  # its output is bytes whatever text= says
        stdout, stderr, rc = _as_text(exc.stdout), _as_text(exc.stderr), None
    return parse_markers(stdout), rc, stderr, time.perf_counter() - t0


def run_case(case: Case, *, timeout: float, smoke: bool = False) -> dict[str, Any]:
    """One case in its own process; what it measured is kept even when the estimate fails."""
    parts, rc, stderr, secs = run_child(["--run-one", json.dumps(case.to_dict())],
                                        timeout=timeout, smoke=smoke)
    rec: dict[str, Any] = {"id": case.id, "family": case.family, "case": case.to_dict(),
                           "status": "ok" if "measured" in parts else "error", "error": None,
                           "returncode": rc, "seconds": round(secs, 2),
                           "context": parts.get("context"), "measured": parts.get("measured"),
                           "estimate": parts.get("estimate")}
    if rc is None and "measured" not in parts:
        rec["status"], rec["error"] = "timeout", f"timed out after {timeout:.0f} s"
    elif "measured" not in parts:
        rec["error"] = f"child exited with {rc}: " + _error_line(stderr)
    if rec["estimate"] is None and rec["status"] == "ok":
        rec["estimate"] = {"error": f"child ended during the estimate (returncode {rc}): "
                                    + _error_line(stderr)}
    if rec["status"] != "ok" or rc != 0:
        rec["stderr_tail"] = stderr[-4000:]
    rec["rel_error"] = rel_errors(rec)
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
        print(c.id + "  " + " ".join(f"{k}={v}" for k, v in c.settings().items()))
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


def run_matrix(cases: list[Case], a: argparse.Namespace) -> int:
    parts, rc, stderr, _ = run_child(["--probe"], timeout=a.timeout, smoke=a.cpu_smoke)
    env = parts.get("env")
    if env is None:
        print(f"the environment probe failed ({rc}): {_error_line(stderr)}\n{stderr[-2000:]}")
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
    print(f"{env['gpu_name']} (cc {env['compute_capability']}), torch {env['torch']}, CUDA "
          f"{env['cuda']}, transformers {env['transformers']}; NVML: {env['nvml_source']}; "
          f"{len(cases)} cases -> {path}", flush=True)
    t0 = time.perf_counter()
    for i, case in enumerate(cases, 1):
        missing = [m for m in case.needs if not env["importable"].get(m)]
        why = cpu_smoke_skip(case) if a.cpu_smoke else None
        rec = (skipped_record(case, missing, reason=why) if missing or why
               else run_case(case, timeout=a.timeout, smoke=a.cpu_smoke))
        doc["runs"].append(rec)
        doc["summary"], doc["elapsed_s"] = summarise(doc["runs"]), round(time.perf_counter() - t0)
        write_json(path, doc)
        print(progress_line(i, len(cases), rec), flush=True)
    doc["finished"] = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    write_json(path, doc)
    print_summary(doc["summary"])
    counts = {s: sum(r["status"] == s for r in doc["runs"]) for s in ("ok", "error", "timeout",
                                                                      "skipped")}
    print(f"{counts} in {time.perf_counter() - t0:.0f} s; wrote {path}")
    return 0 if counts["ok"] else 1


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="gpu_truth.py", description="Measure real Trainer runs on this CUDA GPU and compare "
        "them with hf_memkit's estimates; one JSON file of results.")
    ap.add_argument("--out", default=str(DEFAULT_OUT),
                    help="directory of the result file (default: bench/results/gpu)")
    ap.add_argument("--only", action="append", metavar="SUBSTR",
                    help="run only cases whose id contains SUBSTR (repeatable: any of them)")
    ap.add_argument("--timeout", type=float, default=120.0,
                    help="seconds per case before its process is killed (default 120)")
    ap.add_argument("--list", action="store_true",
                    help="print the case matrix (id and settings) and exit; needs no GPU")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="run the cases shrunk on the CPU: checks the plumbing, measures nothing")
    ap.add_argument("--run-one", metavar="JSON", help=argparse.SUPPRESS)
    ap.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    return ap


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    if a.run_one:
        run_one(Case.from_dict(json.loads(a.run_one)), a.cpu_smoke)
        return 0
    if a.probe:
        probe(a.cpu_smoke)
        return 0
    cases = select(a.only)
    if a.list:
        list_cases(cases)
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
