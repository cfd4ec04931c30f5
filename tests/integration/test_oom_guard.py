"""OOM recovery through the real Trainer on CPU: injected OOMs (forward, backward, optimizer step).

The reference is an uninterrupted run with the same effective batch. Padded variable-length
batches make the per-token loss normalisation across accumulation matter; float64 and no
dropout make the comparison tight.
"""

from __future__ import annotations

import copy
import gc
import sys

import pytest
import torch
from torch._utils import ExceptionWrapper
from transformers import (
    Trainer,
    TrainerCallback,
    TrainerControl,
    TrainerState,
    TrainingArguments,
)

from hf_memkit._oom import detect as _oom_detect
from hf_memkit._run.synthetic import SyntheticTextDataset
from hf_memkit.callbacks import MemoryCallback, OOMGuardTrainer, OOMRecoveryError, is_oom_error

MBS, GA, STEPS = 4, 2, 3
OOM_TEXT = "CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.15 GiB total capacity)"
# What torch 2.13 raises (torch.AcceleratorError, from C10_CUDA_CHECK) when cudaHostAlloc fails in
# its CachingHostAllocator: pinned host memory ran out (Tensor.pin_memory(), pin_memory=True). The
# words are those of any CUDA runtime call's cudaErrorMemoryAllocation.
PINNED_OOM = ("CUDA error: out of memory\nSearch for `cudaErrorMemoryAllocation' in "
              "https://docs.nvidia.com/cuda/cuda-runtime-api/group__CUDART__TYPES.html for more "
              "information.\nFor more detailed error information, run with CUDA_LOG_FILE=stderr\n"
              "Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.\n")


def pad_collate(items):
    n = max(len(x["input_ids"]) for x in items)

    def pad(key, value):
        return torch.stack([torch.nn.functional.pad(x[key], (0, n - len(x[key])), value=value)
                            for x in items])

    return {"input_ids": pad("input_ids", 0), "attention_mask": pad("attention_mask", 0),
            "labels": pad("labels", -100), "sample_id": torch.stack([x["sample_id"] for x in items])}


DATA = SyntheticTextDataset(vocab_size=64, seq_len=16, num_samples=MBS * GA * STEPS,
                            variable_length=True, with_ids=True, learnable=False)


class _Recorder:
    """compute_loss records the sample ids whose loss went into this optimizer step's gradients.

    The guard's documented contract: a recovery drops the step's gradients and replays the step,
    so ids recorded before a recovery in the same step are discarded.
    """

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        ids = inputs.pop("sample_id").tolist()
        out = super().compute_loss(model, inputs, return_outputs=return_outputs,
                                   num_items_in_batch=num_items_in_batch)
        step = self.state.global_step + 1
        n_rec = len(getattr(self, "oom_recoveries", []))
        if getattr(self, "_rec_count", 0) != n_rec:
            self._rec_count = n_rec
            self.seen[step] = []
        self.seen.setdefault(step, []).extend(ids)
        return out


class RefTrainer(_Recorder, Trainer):
    pass


class GuardTrainer(_Recorder, OOMGuardTrainer):
    pass


class MemoryAtStepEnd(TrainerCallback):
    """Tensor bytes alive after each step, relative to train begin (other runs' tensors cancel).

    The tensors alive at train begin are held until train end: what earlier tests left alive
    (an RNG state a checkpointed step saved, kept by an old traceback) may otherwise be freed in
    the middle of this run, and that would read as this run holding less."""

    def __init__(self):
        self.bytes = {}

    def on_train_begin(self, args, state, control, **kwargs):
        self.held = _alive_tensors()
        self.begin = _alive_bytes()

    def on_step_end(self, args, state, control, **kwargs):
        self.bytes[state.global_step] = _alive_bytes() - self.begin

    def on_train_end(self, args, state, control, **kwargs):
        self.held = []


def _alive_tensors() -> list:
    gc.collect()
    return [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]


def _alive_bytes() -> int:
    """Bytes of live CPU tensors (garbage collected first), 0-d tensors left out: a run's first
    step frees a few 0-d tensors (losses, norms) that the previous run left alive from C++, with
    no Python object referring to them (seen in a long session: three to nine 0-d float64
    tensors, 24-72 B), so the reference run and the guarded run would each free a different
    run's leftovers. What a leak after an OOM leaves (activations, gradients, batches) is never
    0-d."""
    gc.collect()
    seen: dict[int, int] = {}
    for o in gc.get_objects():
        if isinstance(o, torch.Tensor) and type(o) in (torch.Tensor, torch.nn.Parameter) \
                and o.device.type == "cpu" and o.dim() > 0:
            st = o.untyped_storage()
            if st.data_ptr():
                seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def run(cls, model, tmp_path, *, callbacks=(), accepts_loss_kwargs=True, setup=None, **kw):
    args = TrainingArguments(
        output_dir=str(tmp_path), max_steps=STEPS, per_device_train_batch_size=MBS,
        gradient_accumulation_steps=GA, learning_rate=1e-2, lr_scheduler_type="linear",
        warmup_steps=1, logging_steps=1, report_to=[], use_cpu=True, save_strategy="no",
        disable_tqdm=True, dataloader_num_workers=0, seed=7, remove_unused_columns=False)
    mem = MemoryAtStepEnd()
    trainer = cls(model=model, args=args, train_dataset=DATA, data_collator=pad_collate,
                  callbacks=[mem, *callbacks], **kw)
    trainer.seen = {}
    trainer.model_accepts_loss_kwargs = accepts_loss_kwargs
    if setup:
        setup(trainer)
    trainer.train()
    return trainer, mem


def oom():
    return torch.OutOfMemoryError(OOM_TEXT)


class _RaiseInBackward(torch.autograd.Function):
    armed = False

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if _RaiseInBackward.armed:
            _RaiseInBackward.armed = False
            raise oom()
        return grad


def inject_forward(trainer):
    """From step 2 on, a forward of more than 2 samples runs out of memory (a real limit)."""

    def hook(module, args):
        if trainer.state.global_step >= 1 and args[0].shape[0] > 2:
            raise oom()

    trainer.model.model.layers[0].register_forward_pre_hook(hook)


def inject_backward(trainer):
    """Once, the backward of the 2nd micro-batch of step 2 runs out of memory (half-way)."""
    calls = {"n": 0}

    def hook(module, args, output):
        if not module.training:
            return output
        if trainer.state.global_step == 1:
            calls["n"] += 1
            if calls["n"] == 2:
                _RaiseInBackward.armed = True
        hidden = output[0] if isinstance(output, tuple) else output
        hidden = _RaiseInBackward.apply(hidden)
        return (hidden, *output[1:]) if isinstance(output, tuple) else hidden

    trainer.model.model.layers[1].register_forward_hook(hook)


class OptimizerOOMOnce(TrainerCallback):
    """The first optimizer step runs out of memory once, before it changes anything."""

    def __init__(self, trainer_ref):
        self.trainer_ref = trainer_ref
        self.done = False

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self.done:
            return
        self.done = True
        opt = self.trainer_ref[0].optimizer
        raw = getattr(opt, "optimizer", opt)
        real = raw.step

        def step(*a, **k):
            raw.step = real
            raise oom()

        raw.step = step


def assert_same_run(ref, guarded, ref_mem, g_mem):
    # every sample exactly once, the same samples in each optimizer step (effective batch kept)
    all_ids = sorted(i for ids in guarded.seen.values() for i in ids)
    assert all_ids == list(range(len(DATA)))
    assert {k: sorted(v) for k, v in guarded.seen.items()} == \
        {k: sorted(v) for k, v in ref.seen.items()}
    assert all(len(v) == MBS * GA for v in guarded.seen.values())
    assert guarded.state.global_step == ref.state.global_step == STEPS
    # learning-rate schedule unchanged
    lr = [h["learning_rate"] for h in ref.state.log_history if "loss" in h]
    assert [h["learning_rate"] for h in guarded.state.log_history if "loss" in h] == lr
    # same weights (transformers' causal-LM loss computes in float32 even for a float64 model,
    # so a mean loss split into chunks differs in the 7th digit; the num_items path agrees to 1e-11)
    for (n, p), (_, q) in zip(ref.model.named_parameters(), guarded.model.named_parameters(),
                                  strict=True):
        torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-8, msg=lambda m, n=n: f"{n}: {m}")
    # memory back to the uninterrupted run's level after each step
    assert g_mem.bytes == ref_mem.bytes
    # the logged training loss is unchanged too
    losses = [h["loss"] for h in ref.state.log_history if "loss" in h]
    assert [h["loss"] for h in guarded.state.log_history if "loss" in h] == \
        pytest.approx(losses, rel=1e-6)   # the Trainer sums logged losses in float32


@pytest.mark.parametrize("accepts_loss_kwargs", [True, False], ids=["num_items", "mean_loss"])
def test_forward_oom_recovers_and_matches(base_model, tmp_path, accepts_loss_kwargs):
    ref, ref_mem = run(RefTrainer, copy.deepcopy(base_model), tmp_path / "ref",
                       accepts_loss_kwargs=accepts_loss_kwargs)
    g, g_mem = run(GuardTrainer, copy.deepcopy(base_model), tmp_path / "g",
                   accepts_loss_kwargs=accepts_loss_kwargs, setup=inject_forward)
    assert len(g.oom_recoveries) == 1               # later steps keep the smaller chunk
    rec = g.oom_recoveries[0]
    assert (rec.step, rec.where, rec.micro_batch_size, rec.gradient_accumulation_steps,
            rec.effective_batch_size) == (2, "forward/backward", 2, 4, MBS * GA)
    assert "CUDA out of memory" in rec.cause
    assert g.args.per_device_train_batch_size == MBS and g.args.gradient_accumulation_steps == GA
    logged = [h for h in g.state.log_history if "oom/recoveries" in h]
    assert logged and logged[0]["oom/micro_batch_size"] == 2
    assert_same_run(ref, g, ref_mem, g_mem)


def test_backward_oom_midway_replays_the_step(base_model, tmp_path):
    ref, ref_mem = run(RefTrainer, copy.deepcopy(base_model), tmp_path / "ref")
    g, g_mem = run(GuardTrainer, copy.deepcopy(base_model), tmp_path / "g", setup=inject_backward)
    assert [(r.step, r.where) for r in g.oom_recoveries] == [(2, "forward/backward")]
    assert_same_run(ref, g, ref_mem, g_mem)


def test_optimizer_step_oom_retries(base_model, tmp_path):
    holder = []
    ref, ref_mem = run(RefTrainer, copy.deepcopy(base_model), tmp_path / "ref")
    g, g_mem = run(GuardTrainer, copy.deepcopy(base_model), tmp_path / "g",
                   callbacks=[OptimizerOOMOnce(holder)], setup=holder.append)
    assert [(r.step, r.where) for r in g.oom_recoveries] == [(1, "optimizer step")]
    assert_same_run(ref, g, ref_mem, g_mem)


def test_bounded_retries_name_setups_and_snapshot(base_model, tmp_path, monkeypatch):
    # a fake CUDA allocator history: the guard dumps a snapshot while the OOM's memory is held
    dumped = []

    def fake_dump(path):
        dumped.append(path)
        with open(path, "wb") as f:
            f.write(b"snapshot")

    monkeypatch.setattr(_oom_detect, "_recording", True)
    monkeypatch.setattr(_oom_detect, "_snapshots", [])
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", fake_dump)

    def always(trainer):
        def hook(module, args):
            if args[0].shape[0] > 1:
                raise RuntimeError(OOM_TEXT)   # CUDA's wording on a plain RuntimeError counts

        trainer.model.model.layers[0].register_forward_pre_hook(hook)

    with pytest.raises(OOMRecoveryError) as err:
        run(GuardTrainer, copy.deepcopy(base_model), tmp_path, setup=always,
            max_oom_recoveries=1)
    msg = str(err.value)
    assert "max_oom_recoveries=1" in msg
    assert "micro-batch 4 x accumulation 2 -> micro-batch 2 x accumulation 4" in msg
    assert dumped and dumped[-1] in msg and "memory_viz" in msg
    assert all(p.startswith(str(tmp_path)) for p in dumped)


def test_unsplittable_micro_batch_raises(base_model, tmp_path):
    def always(trainer):
        def hook(module, args):
            raise oom()

        trainer.model.model.layers[0].register_forward_pre_hook(hook)

    with pytest.raises(OOMRecoveryError, match="cannot be split further"):
        run(GuardTrainer, copy.deepcopy(base_model), tmp_path, setup=always,
            max_oom_recoveries=10)


def test_other_errors_pass_through(base_model, tmp_path):
    def broken(trainer):
        def hook(module, args):
            raise RuntimeError("shape mismatch")

        trainer.model.model.layers[0].register_forward_pre_hook(hook)

    with pytest.raises(RuntimeError, match="shape mismatch"):
        run(GuardTrainer, copy.deepcopy(base_model), tmp_path, setup=broken)


def test_is_oom_error():
    assert is_oom_error(torch.OutOfMemoryError("x"))
    assert is_oom_error(RuntimeError(OOM_TEXT))
    assert not is_oom_error(RuntimeError("expected scalar type Float"))
    assert not is_oom_error(ValueError(OOM_TEXT))


def test_pinned_host_memory_is_not_a_device_oom():
    """The same words as a device OOM outside the caching allocator, told apart by where they
    came from: pinning a tensor (the call that raised asks for pinned memory) or the
    DataLoader's pin-memory thread (its re-raised message names the thread)."""
    try:                       # the real call; on this CPU machine it fails for another reason
        torch.empty(4, pin_memory=True)
    except RuntimeError as exc:
        at_pinning = torch.AcceleratorError(PINNED_OOM).with_traceback(exc.__traceback__)
    try:
        raise torch.AcceleratorError(PINNED_OOM)
    except RuntimeError:
        wrapped = ExceptionWrapper(where="in pin memory thread for device 0")
    with pytest.raises(torch.AcceleratorError) as from_thread:
        wrapped.reraise()
    for exc in (at_pinning, from_thread.value):
        assert not is_oom_error(exc)
        assert _oom_detect.host_memory_error(exc, "cuda") == _oom_detect.PINNED
    device_side = torch.AcceleratorError(PINNED_OOM)   # raised elsewhere: the device's memory
    assert is_oom_error(device_side) and _oom_detect.host_memory_error(device_side) is None
    cpu = RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't "
                       "allocate memory: you tried to allocate 402653184 bytes.")
    assert _oom_detect.host_memory_error(cpu, "cuda") == _oom_detect.HOST   # host RAM on a GPU run
    assert _oom_detect.host_memory_error(cpu, "cpu") is None                # the CPU run's device


def _record_memory_history(enabled="all", context="all", stacks="all", max_entries=sys.maxsize,
                           device=None, clear_history=False, compile_context=False,
                           global_record_annotations=False, skip_actions=None):
    """torch 2.13's signature (torch.cuda.memory._record_memory_history_impl); the calls it got."""
    _record_memory_history.calls.append(dict(
        enabled=enabled, context=context, stacks=stacks, max_entries=max_entries))


def test_memory_history_keeps_python_stacks_only(monkeypatch, tmp_path):
    """MemoryCallback(record_history=True) on CUDA records Python stacks only: torch's default
    (stacks="all") also unwinds the C++ stack of every allocation and free."""
    from hf_memkit._callbacks import memory as memory_mod
    from hf_memkit._callbacks._readers import CudaReader

    _record_memory_history.calls = []
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", _record_memory_history)
    monkeypatch.setattr(_oom_detect, "_recording", False)
    monkeypatch.setattr(CudaReader, "open_nvml", lambda self: None)
    monkeypatch.setattr(memory_mod, "make_reader", lambda device: CudaReader(0))
    for name in ("memory_allocated", "memory_reserved", "max_memory_allocated"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, **k: 0)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a, **k: None)
    cb = MemoryCallback(record_history=True, max_entries=5000, plot=False, report=False)
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    state = TrainerState()
    cb.on_train_begin(args, state, TrainerControl())
    assert _oom_detect.recording_memory_history()
    cb.on_train_end(args, state, TrainerControl())
    start, stop = _record_memory_history.calls
    assert start == dict(enabled="all", context="all", stacks="python", max_entries=5000)
    assert stop["enabled"] is None and not _oom_detect.recording_memory_history()
