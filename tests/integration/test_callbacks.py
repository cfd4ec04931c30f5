"""MemoryCallback and ThroughputCallback through the real Trainer on CPU.

The CPU values are checked against hf_memkit.testing.groundtruth (VmHWM windows in a child process
started with MALLOC_MMAP_THRESHOLD_=65536), the keys in log_history and in a real TensorBoard
event file; the CUDA path runs on tests.fakes (torch.cuda's allocator and NVML over a fake GPU
machine; more in test_memory_callback_cuda.py). What needs no
training run is in tests/unit/callbacks/test_memory_and_throughput.py.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import textwrap
import types

import pytest
import torch
from transformers import LlamaForCausalLM, Trainer, TrainingArguments

from hf_memkit._callbacks import memory as memory_mod
from hf_memkit._callbacks._readers import CudaReader
from hf_memkit._callbacks.plot import draw_timeline
from hf_memkit._run.synthetic import SyntheticTextDataset, tiny_llama_config
from hf_memkit._units import GiB, MiB
from hf_memkit.callbacks import MemoryCallback, ThroughputCallback
from hf_memkit.testing.groundtruth import measure_trainer_peak
from tests.fakes import Machine, a100, install_cuda, install_nvml
from tests.helpers import require

SPEC = {"config": tiny_llama_config(hidden_size=128, num_hidden_layers=2).to_dict(),
        "task": "causal-lm", "seq_len": 256, "steps": 4,
        "args": {"per_device_train_batch_size": 8, "optim": "adamw_torch"}}

CHILD = textwrap.dedent("""
    import json, os, sys, torch, transformers
    import hf_memkit as mk
    from hf_memkit.testing.groundtruth import spec_model, synthetic_examples
    from hf_memkit.callbacks import MemoryCallback, ThroughputCallback
    spec, out = json.loads(sys.argv[1]), sys.argv[2]
    model = spec_model(spec, out)
    a = dict(spec["args"])
    data = synthetic_examples(spec, model.config, a["per_device_train_batch_size"] * (spec["steps"] + 1))
    a.update(output_dir=out, max_steps=spec["steps"], use_cpu=True, report_to=["tensorboard"],
             save_strategy="no", logging_steps=1, disable_tqdm=True, dataloader_num_workers=0,
             dataloader_pin_memory=False, learning_rate=1e-4)
    args = transformers.TrainingArguments(**a)
    est = mk.estimate_memory(model, args, seq_len=spec["seq_len"], device="cpu")
    def collate(xs):
        return {k: torch.stack([x[k] for x in xs]) for k in xs[0]}
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data, data_collator=collate,
                                   callbacks=[MemoryCallback(est), ThroughputCallback()])
    trainer.train()
    json.dump({"log_history": trainer.state.log_history, "predicted": est.peak_allocated},
              open(os.path.join(out, "child.json"), "w"))
""")


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("memcb"))
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", HF_HUB_OFFLINE="1",
               TRANSFORMERS_VERBOSITY="error", PYTHONWARNINGS="ignore", OMP_NUM_THREADS="2")
    proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(SPEC), out], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(os.path.join(out, "child.json")) as f:
        child = json.load(f)
    truth = measure_trainer_peak(SPEC)
    return out, child, truth


KEYS = ["memory/allocated_gib", "memory/reserved_gib", "memory/peak_allocated_gib",
        "memory/fragmentation_gib", "memory/peak_fwd_bwd_gib", "memory/peak_optimizer_gib",
        "memory/rss_gib", "memory/predicted_peak_gib", "memory/actual_over_predicted",
        "throughput/samples_per_second", "throughput/tokens_per_second", "throughput/tflops"]


def _train_logs(history):
    return [h for h in history if "loss" in h]


def test_cpu_values_match_independent_measurement(cpu_run):
    _, child, truth = cpu_run
    logs = _train_logs(child["log_history"])
    assert [h["step"] for h in logs] == [1, 2, 3, 4]
    for h in logs:
        assert set(KEYS) <= set(h), set(KEYS) - set(h)
    by_step = {r["step"]: r["peak"] for r in truth["steps"]}
    for h in logs[1:]:   # steady state; step 1 also holds one-time non-tensor allocations
        ours = h["memory/peak_allocated_gib"] * GiB
        theirs = by_step[h["step"]]
        assert abs(ours - theirs) <= 0.03 * theirs + 2 * MiB, (h["step"], ours, theirs)
        assert h["memory/peak_fwd_bwd_gib"] <= h["memory/peak_allocated_gib"] + 1e-9
        assert h["memory/peak_optimizer_gib"] <= h["memory/peak_allocated_gib"] + 1e-9
        assert h["memory/allocated_gib"] < h["memory/peak_allocated_gib"]
        assert h["memory/rss_gib"] > h["memory/allocated_gib"]
        assert h["memory/predicted_peak_gib"] == pytest.approx(child["predicted"] / GiB)
        assert h["memory/actual_over_predicted"] == pytest.approx(
            h["memory/peak_allocated_gib"] * GiB / child["predicted"])
    # a wider band than the estimator's CPU bar (docs/quality-bars.md): within 8% of the
    # measured steady peak
    worst = max(h["memory/actual_over_predicted"] for h in logs[1:])
    assert 0.92 <= worst <= 1.08


def test_keys_reach_tensorboard(cpu_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, child, _ = cpu_run
    files = glob.glob(os.path.join(out, "**", "events.out.tfevents.*"), recursive=True)
    assert files
    scalars: dict[str, dict[int, float]] = {}
    for path in files:
        ea = EventAccumulator(path, size_guidance={"scalars": 0})
        ea.Reload()
        for tag in ea.Tags()["scalars"]:
            scalars.setdefault(tag, {}).update({e.step: e.value for e in ea.Scalars(tag)})
    for h in _train_logs(child["log_history"]):
        for key in KEYS:
            assert scalars[f"train/{key}"][h["step"]] == pytest.approx(h[key], rel=1e-6)


def test_report_and_png(cpu_run):
    out, child, _ = cpu_run
    with open(os.path.join(out, "memory_report.json")) as f:
        report = json.load(f)
    assert report["device"] == "cpu" and report["units"] == "bytes"
    assert report["predicted_peak_allocated"] == child["predicted"]
    assert [r["step"] for r in report["steps"]] == [1, 2, 3, 4]
    logs = _train_logs(child["log_history"])
    for r, h in zip(report["steps"], logs, strict=True):
        assert r["peak_allocated"] / GiB == pytest.approx(h["memory/peak_allocated_gib"])
    assert report["summary"]["max_peak_allocated"] == max(r["peak_allocated"]
                                                          for r in report["steps"])
    png = os.path.join(out, "memory_timeline.png")
    assert os.path.getsize(png) > 1000
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


# ----------------------------------------------------------------------------------------------
# CUDA path on fakes
# ----------------------------------------------------------------------------------------------


def tiny_trainer(tmp_path, callbacks, *, steps=4, logging_steps=2, **kw):
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config(hidden_size=64, intermediate_size=128,
                                               num_hidden_layers=2, vocab_size=128))
    data = SyntheticTextDataset(vocab_size=128, seq_len=16, num_samples=4 * steps)
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=steps,
                             per_device_train_batch_size=4, logging_steps=logging_steps,
                             report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True,
                             dataloader_num_workers=0, **kw)
    return Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks)


def test_cuda_path_on_fakes(tmp_path, monkeypatch):
    """The CUDA reader on tests.fakes (one A100: torch.cuda's allocator counters, NVML under
    nvidia-ml-py's real module): what each step logs, and no reading on steps that do not log."""
    machine = Machine([a100(0x10, 0)])
    install_nvml(machine, monkeypatch)
    fake = install_cuda(machine, monkeypatch)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    step = {"now": None}          # the step running now (set by Marker), None between steps
    read_in = []

    def recording(real):
        def recorded(*a, **k):
            read_in.append(step["now"])
            return real(*a, **k)
        return recorded

    for name in ("memory_allocated", "memory_reserved", "max_memory_allocated", "memory_stats",
                 "reset_peak_memory_stats"):
        monkeypatch.setattr(torch.cuda, name, recording(getattr(torch.cuda, name)))
    history = []
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history",
                        lambda *a, **k: history.append((a, k)))
    # the Trainer itself runs on the CPU; the callback reads the (fake) CUDA allocator
    monkeypatch.setattr(memory_mod, "make_reader", lambda device: CudaReader(0))
    uuid = fake.target(0).uuid

    def transient(mib):
        fake.allocate(mib * MiB, 0)
        machine.release(uuid, mib * MiB)

    class Marker(memory_mod.TrainerCallback):    # runs first in every event
        def on_train_begin(self, args, state, control, **kw):
            fake.allocate(100 * MiB, 0)          # the weights

        def on_step_begin(self, args, state, control, **kw):
            step["now"] = state.global_step + 1

        def on_step_end(self, args, state, control, **kw):
            step["now"] = None

    class Script(memory_mod.TrainerCallback):    # the allocator's peaks in each phase
        def on_step_begin(self, args, state, control, **kw):
            transient(300)                        # forward + backward

        def on_pre_optimizer_step(self, args, state, control, **kw):
            transient(50)                         # the optimizer step

    cb = MemoryCallback(types.SimpleNamespace(peak_allocated=400 * MiB), record_history=True,
                        max_entries=1234)
    trainer = tiny_trainer(tmp_path, [Script(), cb])
    trainer.callback_handler.callbacks.insert(0, Marker())
    trainer.train()
    logs = _train_logs(trainer.state.log_history)
    assert [h["step"] for h in logs] == [2, 4]
    gpu = machine.gpus[0]
    for h in logs:
        assert h["memory/allocated_gib"] == pytest.approx(100 * MiB / GiB)
        # the caching allocator keeps the 400 MiB segment it reserved for the peak
        assert h["memory/reserved_gib"] == pytest.approx(400 * MiB / GiB)
        assert h["memory/fragmentation_gib"] == pytest.approx(300 * MiB / GiB)
        assert h["memory/peak_allocated_gib"] == pytest.approx(400 * MiB / GiB)
        assert h["memory/peak_active_gib"] == pytest.approx(400 * MiB / GiB)
        assert h["memory/peak_reserved_gib"] == pytest.approx(400 * MiB / GiB)
        assert h["memory/peak_fwd_bwd_gib"] == pytest.approx(400 * MiB / GiB)
        assert h["memory/peak_optimizer_gib"] == pytest.approx(150 * MiB / GiB)
        # NVML v1: the driver's reservation, this process's context and its reserved memory
        assert h["memory/nvml_used_gib"] * GiB == gpu.total - machine.free(gpu)
        assert h["memory/nvml_used_gib"] * GiB == gpu.reserved + machine.context_bytes + 400 * MiB
        assert h["memory/gpu_util"] == 97
        assert h["memory/other_processes_gib"] == 0
        assert h["memory/actual_over_predicted"] == pytest.approx(1.0)
        assert "memory/rss_gib" not in h
    # allocator history recorded from train begin, switched off at train end
    assert history == [((), {"enabled": "all", "context": "all", "stacks": "python",
                             "max_entries": 1234}), ((), {"enabled": None})]
    assert "nvmlInitWithFlags" in machine.calls and machine.calls[-1] == "nvmlShutdown"
    # no reading at all during the steps that do not log (1 and 3)
    assert {s for s in read_in if s is not None} == {2, 4}
    with open(os.path.join(tmp_path, "memory_report.json")) as f:
        report = json.load(f)
    assert report["device"] == "cuda"
    plt = require("matplotlib.pyplot")
    # the timeline: reserved (400 MiB) is its own dashed line, allocated (100 MiB) its own line
    fig = draw_timeline(report)
    try:
        lines = {ln.get_label(): ln for ln in fig.axes[0].get_lines()}
        assert lines["reserved (caching allocator)"].get_linestyle() == "--"
        assert list(lines["reserved (caching allocator)"].get_ydata()) == [400, 400]
        assert list(lines["allocated after step"].get_ydata()) == [100, 100]
    finally:
        plt.close(fig)


def _bar_spans(ax) -> list[tuple[str, float, float, float]]:
    return [(c.get_label(), p.get_x(), p.get_x() + p.get_width(), p.get_height())
            for c in ax.containers for p in c.patches]


def test_timeline_reads_at_a_glance(tmp_path):
    """The PNG of a real CPU run: y from 0 in MiB, the two phase bars of each logged step side by
    side and never overlapping, allocated visible (one line on CPU, where reserved equals it), the
    prediction a labelled line."""
    cb = MemoryCallback(types.SimpleNamespace(peak_allocated=20 * MiB))
    trainer = tiny_trainer(tmp_path, [cb], steps=6, logging_steps=2)
    trainer.train()
    report = cb.to_report()
    plt = require("matplotlib.pyplot")
    assert os.path.getsize(tmp_path / "memory_timeline.png") > 1000   # what on_train_end drew
    fig = draw_timeline(report)
    try:
        [ax] = fig.axes
        assert ax.get_ylim()[0] == 0
        assert ax.get_ylim()[1] > max(r["peak_allocated"] for r in report["steps"]) / MiB
        assert ax.get_ylabel() == "memory (MiB)"
        spans = _bar_spans(ax)
        assert sorted({s[0] for s in spans}) == ["forward + backward peak", "optimizer-step peak"]
        assert len(spans) == 2 * len(report["steps"]) == 6
        spans.sort(key=lambda s: s[1])
        for (_, _, right, _), (_, left, _, _) in zip(spans, spans[1:], strict=False):
            assert right < left                                   # no two bars overlap
        for (label, _, right, height), r in zip(spans[::2], report["steps"], strict=True):
            assert label == "forward + backward peak" and right < r["step"]   # left of its step
            assert height == pytest.approx(r["peak_fwd_bwd"] / MiB)
        lines = {ln.get_label(): ln for ln in ax.get_lines()}
        alloc = lines["allocated after step (CPU: reserved = allocated)"]
        assert not any("reserved" == k.split(" ")[0] for k in lines)   # no line hidden under it
        assert alloc.get_zorder() > max(p.get_zorder() for c in ax.containers for p in c.patches)
        assert list(alloc.get_ydata()) == pytest.approx([r["allocated"] / MiB
                                                         for r in report["steps"]])
        pred = lines["predicted peak (20.00 MiB)"]
        assert list(pred.get_ydata()) == [20, 20] and pred.get_linestyle() == "--"
        assert "predicted\n20.00 MiB" in [t.get_text() for t in ax.texts]   # at the line's end
        assert ax.get_title().startswith("memory timeline on cpu\npeak ")
    finally:
        plt.close(fig)


def test_missing_stat_warns_once_and_goes_on(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(memory_mod.CpuReader, "peak", lambda self: None)
    trainer = tiny_trainer(tmp_path, [MemoryCallback(plot=False)], logging_steps=1)
    with caplog.at_level("WARNING"):
        trainer.train()
    logs = _train_logs(trainer.state.log_history)
    assert all("memory/peak_allocated_gib" in h for h in logs)
    assert sum("no peak memory statistic" in r.message for r in caplog.records) == 1


# ----------------------------------------------------------------------------------------------
# throughput
# ----------------------------------------------------------------------------------------------


def test_throughput_counts_real_tokens_and_mfu(tmp_path):
    def pad_collate(items):
        n = max(len(x["input_ids"]) for x in items)

        def pad(k, v):
            return torch.stack([torch.nn.functional.pad(x[k], (0, n - len(x[k])), value=v)
                                for x in items])

        return {"input_ids": pad("input_ids", 0), "attention_mask": pad("attention_mask", 0),
                "labels": pad("labels", -100)}

    data = SyntheticTextDataset(vocab_size=128, seq_len=16, num_samples=16, variable_length=True)
    real = sum(len(data[i]["input_ids"]) for i in range(len(data)))
    cb = ThroughputCallback(device="A100-80GB")
    trainer = tiny_trainer(tmp_path, [cb], steps=4, logging_steps=4)
    trainer.train_dataset, trainer.data_collator = data, pad_collate
    trainer.train()
    (h,) = _train_logs(trainer.state.log_history)
    assert h["throughput/tokens_per_second"] / h["throughput/samples_per_second"] == \
        pytest.approx(real / 16)
    assert h["throughput/mfu"] == pytest.approx(h["throughput/tflops"] / 19.5)  # A100 fp32
    assert h["throughput/hfu"] == pytest.approx(h["throughput/mfu"])            # no checkpointing
