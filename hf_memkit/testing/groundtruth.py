"""An independent CPU measurement of a real Trainer run's peak tensor memory
(docs/stack-facts.md#cpu-ground-truth).

Never used by the estimator; used to check it (tests, ``bench/estimator_cpu.py``) and by the
planner benchmark. Method:
  * the run happens in a child process started with ``MALLOC_MMAP_THRESHOLD_=65536``, so every
    tensor of 64 KiB or more is its own mapping and RSS tracks live tensor bytes;
  * and with ``MALLOC_PERTURB_`` set, so glibc writes every allocation when it is made: RSS
    counts only pages that were written, and a tensor allocated but only partly written would
    otherwise read short. TRL's CPU fused head is one: ``ChunkedLogProbFunction`` allocates a
    ``[tokens, 32768]`` tile buffer and writes only ``[tokens, vocab]`` of it, so with Qwen2's
    16000-entry vocabulary half its pages were never resident (-32 MiB, 5% of that step, where
    torch's MemTracker on the same run counts the whole buffer, as CUDA's allocator does).
    Each allocation is written once more (a memset); ``spec["touch_pages"] = False`` turns it
    off for throughput-only runs;
  * a callback opens a window at each ``on_step_begin``: it adds up the distinct CPU tensor
    storages alive (weights, optimizer state from step 2, prefetched batches), reads ``VmRSS`` and
    resets ``VmHWM`` through ``/proc/self/clear_refs``; at ``on_step_end`` (after the optimizer
    step) the step's peak is ``VmHWM - VmRSS_open + alive_open``;
  * the result is the largest peak of steps 2.. (steady state: the optimizer state exists and
    every phase of the step runs inside the window). Step 1 is reported but not used: its RSS
    also holds one-time non-tensor allocations (thread pools, kernel caches; ~10 MiB measured,
    which torch's MemTracker on the same run does not see).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

from .._device.rss import alive_cpu_tensor_bytes
from .models import spec_model, synthetic_examples

_MARK = "@@HF_MEMKIT_RESULT "


def measure_trainer_peak(spec: dict[str, Any], *, timeout: float = 900.0) -> dict[str, Any]:
    """Run a real ``transformers.Trainer`` in a child process; return its measured peak.

    ``spec``: ``config`` (``PretrainedConfig.to_dict()``), ``task``, ``args`` (TrainingArguments
    fields), ``seq_len``, optional ``steps`` (3), ``dtype`` ("float32"), ``attn_implementation``,
    ``lora`` (LoraConfig kwargs), ``quantization`` (BitsAndBytesConfig kwargs), ``target_len``,
    ``trainer`` ("sft" / "dpo": a TRL trainer, its data as ``groundtruth_trl`` describes),
    ``touch_pages`` (True: see the module docstring).
    Returns ``{"peak": bytes, "steps": [...], "param_bytes": ...}``.
    """
    env = dict(os.environ)
    env.update(MALLOC_MMAP_THRESHOLD_="65536", HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error",
               TOKENIZERS_PARALLELISM="false", PYTHONWARNINGS="ignore")
    env.setdefault("OMP_NUM_THREADS", "2")
    if spec.get("touch_pages", True):  # count allocated-but-unwritten tensor pages (docstring)
        env["MALLOC_PERTURB_"] = "85"
    proc = subprocess.run([sys.executable, "-m", "hf_memkit.testing.groundtruth",
                           json.dumps(spec)],
                          env=env, capture_output=True, text=True, timeout=timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(_MARK)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"measurement child failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len(_MARK):])


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def open_window(alive: int) -> dict[str, Any]:
    """Open a measurement window: note ``VmRSS`` and the ``alive`` tensor bytes, reset ``VmHWM``.

    ``alive`` is what :func:`alive_cpu_tensor_bytes` (plus any tensors only C++ holds) counts
    just before; the window's peak is then ``VmHWM - VmRSS_open + alive`` (:func:`close_window`).
    """
    opened = {"alive": alive, "rss": _status_bytes("VmRSS")}
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    opened["t0"] = time.perf_counter()
    return opened


def close_window(opened: dict[str, Any]) -> dict[str, Any]:
    """The window's ``peak`` tensor bytes, ``alive_open`` and wall ``seconds`` since it opened."""
    seconds = time.perf_counter() - opened["t0"]
    hwm = _status_bytes("VmHWM")
    return {"alive_open": opened["alive"], "peak": hwm - opened["rss"] + opened["alive"],
            "seconds": seconds}


def _child(spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    import transformers

    if os.environ.get("MALLOC_MMAP_THRESHOLD_") != "65536":
        raise RuntimeError("MALLOC_MMAP_THRESHOLD_=65536 must be set when the process starts")
    with tempfile.TemporaryDirectory() as workdir:
        model = spec_model(spec, workdir)
        steps = max(2, int(spec.get("steps", 3)))
        a = dict(spec["args"])
        n = a.get("per_device_train_batch_size", 8) * a.get("gradient_accumulation_steps", 1) * (
            steps + 1)
        a.update(output_dir=os.path.join(workdir, "out"), max_steps=steps, use_cpu=True,
                 report_to=[], save_strategy="no", logging_strategy="no", eval_strategy="no",
                 dataloader_num_workers=0, dataloader_pin_memory=False, disable_tqdm=True,
                 learning_rate=a.get("learning_rate", 1e-4))
        records: list[dict[str, int]] = []

        with_mt = bool(spec.get("memtracker"))  # cross-check: torch's MemTracker on real tensors

        class Window(transformers.TrainerCallback):
            def on_step_begin(self, args, state, control, **kw):
                alive = alive_cpu_tensor_bytes()
                if with_mt:
                    from .._trace.step import new_tracker

                    self.mt = new_tracker(kw["model"], [])
                    self.mt.track_external(kw["optimizer"])
                    self.mt.__enter__()
                self.open = open_window(alive)

            def on_step_end(self, args, state, control, **kw):
                rec = {"step": state.global_step, **close_window(self.open)}
                if with_mt:
                    self.mt.__exit__(None, None, None)
                    snap = self.mt.get_tracker_snapshot("peak")[torch.device("cpu")]
                    rec["memtracker"] = {str(getattr(k, "value", k)): int(v) for k, v in snap.items()}
                records.append(rec)

            def on_substep_end(self, args, state, control, **kw):
                if with_mt:  # MemTracker refuses a second forward of the same modules without it
                    self.mt.reset_mod_stats()

        if spec.get("trainer", "trainer") != "trainer":  # TRL: its own config, data and trainer
            from .groundtruth_trl import make_trl_trainer

            trainer = make_trl_trainer(spec, model, a, n, workdir, [Window()])
        else:
            def collate(xs):
                return {k: torch.stack([x[k] for x in xs]) for k in xs[0]}

            trainer = transformers.Trainer(model=model, args=transformers.TrainingArguments(**a),
                                           train_dataset=synthetic_examples(spec, model.config, n),
                                           data_collator=collate, callbacks=[Window()])
        trainer.train()
        steady = [r for r in records if r["step"] >= 2] or records
        secs = sorted(r["seconds"] for r in steady)
        samples = a.get("per_device_train_batch_size", 8) * a.get("gradient_accumulation_steps", 1)
        return {"peak": max(r["peak"] for r in steady), "steps": records,
                "samples_per_second": samples / secs[len(secs) // 2],
                "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
                "optimizer": type(getattr(trainer.optimizer, "optimizer", trainer.optimizer)).__name__}


if __name__ == "__main__":
    result = _child(json.loads(sys.argv[1]))
    print(_MARK + json.dumps(result), flush=True)
