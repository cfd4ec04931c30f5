"""The OOM guard as a user meets it, one story per test, through the public names.

Every story trains a tiny float64 Llama through the real ``transformers.Trainer`` on CPU. What
this machine cannot have, a real CUDA (cuBLAS, cuDNN) allocation failure, is raised with the real
wording from inside the model, the optimizer or the evaluation, at chosen points. The reference
is an unguarded run of the same setup; no dropout, so "the same run" means the same weights (with
dropout a replayed step draws new masks and the weights match only statistically).
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

import hf_memkit as mk
from hf_memkit._run.synthetic import SyntheticTextDataset
from tests.integration.test_oom_guard import (
    DATA,
    OOM_TEXT,
    PINNED_OOM,
    MemoryAtStepEnd,
    inject_backward,
    oom,
    pad_collate,
)

EVAL_DATA = SyntheticTextDataset(vocab_size=64, seq_len=16, num_samples=8, variable_length=True,
                                 with_ids=True, learnable=False, seed=3)
CUBLAS = "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"


class _Audit:
    """Records, per optimizer step, the sample ids whose loss reached the gradients (a
    forward/backward recovery drops the step's gradients and replays it, so ids seen before it
    are discarded), the size of every training forward and of every evaluation batch."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        ids = inputs.pop("sample_id").tolist()
        if model.training:
            step = self.state.global_step + 1
            replays = sum(r.where == "forward/backward" for r in getattr(self, "oom_recoveries", []))
            if self.replays.get(step, replays) != replays:
                self.seen[step] = []
            self.replays[step] = replays
            self.seen.setdefault(step, []).extend(ids)
            self.forward_sizes.append(len(ids))
        else:
            self.eval_sizes.append(len(ids))
        return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                    num_items_in_batch=num_items_in_batch)


class Reference(_Audit, Trainer):
    pass


class Guarded(_Audit, mk.OOMGuardTrainer):
    pass


def train(cls, model, out, *, setup=None, callbacks=(), trainer_kw=None, evaluate=False, **args_kw):
    kw = dict(output_dir=str(out), max_steps=3, per_device_train_batch_size=4,
              gradient_accumulation_steps=2, learning_rate=1e-2, lr_scheduler_type="linear",
              warmup_steps=1, logging_steps=1, report_to=[], use_cpu=True, save_strategy="no",
              disable_tqdm=True, dataloader_num_workers=0, seed=7, remove_unused_columns=False)
    kw.update(args_kw)
    trainer = cls(model=model, args=TrainingArguments(**kw), train_dataset=DATA,
                  eval_dataset=EVAL_DATA, data_collator=pad_collate, callbacks=list(callbacks),
                  **(trainer_kw or {}))
    trainer.seen, trainer.replays, trainer.forward_sizes, trainer.eval_sizes = {}, {}, [], []
    if setup:
        setup(trainer)
    if evaluate:
        trainer.evaluate()
    else:
        trainer.train()
    return trainer


def assert_same_training(ref, g, *, rtol=1e-6, atol=1e-8):
    """Same samples in each optimizer step, same learning rates, losses and final weights."""
    effective = ref.args.per_device_train_batch_size * ref.args.gradient_accumulation_steps
    assert sorted(i for ids in g.seen.values() for i in ids) == list(range(len(DATA)))
    assert {k: sorted(v) for k, v in g.seen.items()} == {k: sorted(v) for k, v in ref.seen.items()}
    assert all(len(v) == effective for v in g.seen.values())
    assert g.state.global_step == ref.state.global_step

    def logged(t, key):
        return [h[key] for h in t.state.log_history if "loss" in h]

    assert logged(g, "learning_rate") == logged(ref, "learning_rate")
    assert logged(g, "loss") == pytest.approx(logged(ref, "loss"), rel=1e-6)
    for (n, p), (_, q) in zip(ref.model.named_parameters(), g.model.named_parameters(),
                              strict=True):
        torch.testing.assert_close(q, p, rtol=rtol, atol=atol, msg=lambda m, n=n: f"{n}: {m}")


def eval_losses(trainer):
    return [h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h]


def in_layer0(condition, error):
    """Raise ``error()`` from the first decoder layer's forward whenever ``condition(trainer,
    module, hidden)`` holds: where a real allocation in the model would fail."""

    def setup(trainer):
        def hook(module, args):
            if condition(trainer, module, args[0]):
                raise error()

        trainer.model.model.layers[0].register_forward_pre_hook(hook)

    return setup


class OptimizerOOM(TrainerCallback):
    """The optimizer step runs out of memory before it changes anything (as when its state is
    allocated), at the given optimizer steps (1-based), ``times`` times each."""

    def __init__(self, holder, steps=(1,), times=1):
        self.holder, self.steps, self.times = holder, set(steps), times

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if state.global_step + 1 not in self.steps:
            return
        raw = self.holder[0].optimizer.optimizer
        real, left = raw.step, [self.times]

        def step(*a, **k):
            left[0] -= 1
            if left[0] <= 0:
                raw.step = real
            raise oom()

        raw.step = step


# ---- the previous guarantees and evaluation, in one run -------------------------------------


def test_a_run_that_meets_every_kind_of_oom_matches_an_uninterrupted_one(base_model, tmp_path):
    """Step 1's optimizer step, step 2's backward half-way through and the evaluation after step 2
    run out of memory: the run goes on and ends where an uninterrupted run ends."""
    holder = []
    ev = dict(eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=8)

    def setup(trainer):
        holder.append(trainer)
        inject_backward(trainer)
        in_layer0(lambda t, m, h: not m.training and h.shape[0] > 2, oom)(trainer)

    ref_mem, g_mem = MemoryAtStepEnd(), MemoryAtStepEnd()
    ref = train(Reference, copy.deepcopy(base_model), tmp_path / "ref", callbacks=[ref_mem],
                **{**ev, "per_device_eval_batch_size": 2})
    g = train(Guarded, copy.deepcopy(base_model), tmp_path / "g", setup=setup,
              callbacks=[OptimizerOOM(holder), g_mem], trainer_kw={"max_oom_recoveries": 4}, **ev)

    assert [(r.step, r.where, r.micro_batch_size, r.gradient_accumulation_steps,
             r.eval_batch_size) for r in g.oom_recoveries] == [
        (1, "optimizer step", 4, 2, 8),          # the micro-batch is kept: the forward fitted
        (2, "forward/backward", 2, 4, 8),        # the step is replayed in halves
        (2, "evaluation", 2, 4, 4),              # the eval batch halves, the train batch not
        (2, "evaluation", 2, 4, 2)]
    assert all(r.effective_batch_size == 8 for r in g.oom_recoveries)
    assert (g.args.per_device_train_batch_size, g.args.per_device_eval_batch_size) == (4, 2)
    assert_same_training(ref, g)
    assert eval_losses(g) == pytest.approx(eval_losses(ref), rel=1e-6)
    assert len(eval_losses(g)) == 2             # after steps 2 and 3; the second needs no retry
    assert g.eval_sizes[-8:] == ref.eval_sizes[-8:] == [2] * 4 * 2
    assert g_mem.bytes == ref_mem.bytes              # nothing from the failed attempts stays alive
    logged = [h for h in g.state.log_history if "oom/recoveries" in h]
    assert [h["oom/eval_batch_size"] for h in logged] == [8, 8, 4, 2]


def test_evaluate_at_eval_batch_one_says_what_to_do(base_model, tmp_path):
    always = in_layer0(lambda t, m, h: not m.training, oom)
    with pytest.raises(mk.OOMRecoveryError) as err:
        train(Guarded, copy.deepcopy(base_model), tmp_path, setup=always, evaluate=True,
              per_device_eval_batch_size=4, trainer_kw={"max_oom_recoveries": 5})
    msg = str(err.value)
    assert "1 sample(s) per evaluation batch, which cannot be split further" in msg
    assert "at the evaluation before any optimizer step (evaluation)" in msg
    assert "per_device_eval_batch_size 4 -> 2 -> 1" in msg
    assert "eval_accumulation_steps" in msg and "hf-memkit plan" in msg


def on_cuda_pinning_fails(trainer, monkeypatch):
    """What a CUDA machine whose pinned host memory ran out does: the DataLoader pins every batch
    (dataloader_pin_memory=True, the default there; use_cpu=True turns it off), and each
    Tensor.pin_memory() fails as cudaHostAlloc does."""

    def pin_memory(self, *args, **kwargs):
        raise torch.AcceleratorError(PINNED_OOM)

    trainer.args.dataloader_pin_memory = True
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "current_accelerator",
                        lambda *a, **k: torch.device("cuda"))
    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)


def test_pinned_host_memory_running_out_stops_instead_of_halving_the_eval_batch(
        base_model, tmp_path, monkeypatch):
    """Pinning an eval batch fails with CUDA's "out of memory": host memory, which a smaller eval
    batch does not free. The guard stops at once and says what to change, rather than halving
    the eval batch down to one sample and then blaming the GPU."""
    holder = []

    def setup(trainer):
        holder.append(trainer)
        on_cuda_pinning_fails(trainer, monkeypatch)

    with pytest.raises(mk.OOMRecoveryError) as err:
        train(Guarded, copy.deepcopy(base_model), tmp_path, setup=setup, evaluate=True,
              per_device_eval_batch_size=8, trainer_kw={"max_oom_recoveries": 5})
    msg = str(err.value)
    assert msg.startswith("pinned (page-locked) host memory ran out at the evaluation before any "
                          "optimizer step (evaluation): AcceleratorError: CUDA error: out of memory")
    assert "not the device's memory" in msg and "dataloader_pin_memory=False" in msg
    assert isinstance(err.value.__cause__, torch.AcceleratorError)
    g = holder[0]
    assert g.oom_recoveries == [] and g.args.per_device_eval_batch_size == 8
    assert g.eval_sizes == []                          # no batch reached the model


# ---- which errors are OOMs --------------------------------------------------------------------


@pytest.mark.parametrize("error", [
    torch.OutOfMemoryError(OOM_TEXT),
    RuntimeError(OOM_TEXT),
    torch.AcceleratorError("CUDA error: out of memory\nCUDA kernel errors might be asynchronously "
                           "reported at some other API call"),
    RuntimeError(CUBLAS),
    RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasLtMatmul( ... )`"),
    RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED"),
    RuntimeError("cuDNN error: CUDNN_STATUS_INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED"),
    RuntimeError("cusolver error: CUSOLVER_STATUS_ALLOC_FAILED, when calling `cusolverDnCreate`"),
    RuntimeError("HIP out of memory. Tried to allocate 2.00 GiB"),
    RuntimeError("XPU out of memory. Tried to allocate 2.00 GiB"),
    RuntimeError("MPS backend out of memory (MPS allocated: 17.00 GiB)"),
    RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate "
                 "memory: you tried to allocate 402653184 bytes."),
], ids=lambda e: f"{type(e).__name__}:{str(e)[:40]}")
def test_allocation_failures_are_ooms(error):
    assert mk.is_oom_error(error)


@pytest.mark.parametrize("error", [
    RuntimeError("cuDNN error: CUDNN_STATUS_INTERNAL_ERROR"),
    RuntimeError("cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if you passed "
                 "in a non-contiguous input."),
    RuntimeError("CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasSgemm( ... )`"),
    RuntimeError("CUDA error: CUBLAS_STATUS_NOT_INITIALIZED when calling `cublasCreate(handle)`"),
    RuntimeError("CUDA error: an illegal memory access was encountered"),
    RuntimeError("CUDA error: device-side assert triggered"),
    RuntimeError("expected scalar type Float but found Double"),
    ValueError(OOM_TEXT),                           # only RuntimeErrors come from the allocator
], ids=lambda e: f"{type(e).__name__}:{str(e)[:40]}")
def test_other_errors_are_not_ooms(error):
    assert not mk.is_oom_error(error)


def test_cublas_allocation_failure_recovers_like_a_cuda_oom(base_model, tmp_path):
    """cuBLAS could not get its workspace in step 2's forward: the step is replayed in halves."""
    ref = train(Reference, copy.deepcopy(base_model), tmp_path / "ref")
    g = train(Guarded, copy.deepcopy(base_model), tmp_path / "g",
              setup=in_layer0(lambda t, m, h: t.state.global_step >= 1 and h.shape[0] > 2,
                              lambda: RuntimeError(CUBLAS)))
    assert [(r.step, r.where, r.micro_batch_size) for r in g.oom_recoveries] == \
        [(2, "forward/backward", 2)]
    assert "CUBLAS_STATUS_ALLOC_FAILED" in g.oom_recoveries[0].cause
    assert_same_training(ref, g)


def test_cudnn_internal_error_is_not_retried(base_model, tmp_path):
    error = "cuDNN error: CUDNN_STATUS_INTERNAL_ERROR"
    trainers = []

    def setup(trainer):
        trainers.append(trainer)
        in_layer0(lambda t, m, h: True, lambda: RuntimeError(error))(trainer)

    with pytest.raises(RuntimeError) as err:
        train(Guarded, copy.deepcopy(base_model), tmp_path, setup=setup)
    assert type(err.value) is RuntimeError and str(err.value) == error
    assert trainers[0].oom_recoveries == []


# ---- micro-batch 1 ------------------------------------------------------------------------------


def test_forward_oom_at_micro_batch_one_is_fatal_and_says_what_to_do(base_model, tmp_path):
    always = in_layer0(lambda t, m, h: m.training, oom)
    with pytest.raises(mk.OOMRecoveryError) as err:
        train(Guarded, copy.deepcopy(base_model), tmp_path, setup=always,
              per_device_train_batch_size=1, gradient_accumulation_steps=8)
    msg = str(err.value)
    assert "1 sample(s) per forward/backward, which cannot be split further" in msg
    assert "at optimizer step 1 (forward/backward)" in msg
    assert "micro-batch 1 x accumulation 8" in msg
    for fix in ("activation_checkpointing=True", "max length", "LoRA", "hf-memkit plan"):
        assert fix in msg
    assert "lower per_device_train_batch_size" not in msg      # it is 1 already


def test_optimizer_oom_at_micro_batch_one_is_retried(base_model, tmp_path):
    """At micro-batch 1 an optimizer OOM was fatal: the micro-batch has nothing to do with it."""
    holder = []
    one = dict(per_device_train_batch_size=1, gradient_accumulation_steps=8)
    ref = train(Reference, copy.deepcopy(base_model), tmp_path / "ref", **one)
    g = train(Guarded, copy.deepcopy(base_model), tmp_path / "g", setup=holder.append,
              callbacks=[OptimizerOOM(holder)], **one)
    assert [(r.step, r.where, r.micro_batch_size, r.gradient_accumulation_steps)
            for r in g.oom_recoveries] == [(1, "optimizer step", 1, 8)]
    assert_same_training(ref, g)


def test_optimizer_oom_twice_in_one_step_is_fatal_and_says_what_to_do(base_model, tmp_path):
    holder = []
    with pytest.raises(mk.OOMRecoveryError) as err:
        train(Guarded, copy.deepcopy(base_model), tmp_path, setup=holder.append,
              callbacks=[OptimizerOOM(holder, times=2)], per_device_train_batch_size=1,
              gradient_accumulation_steps=8, trainer_kw={"max_oom_recoveries": 10})
    msg = str(err.value)
    assert "out of memory again in the same optimizer step" in msg
    assert "at optimizer step 1 (optimizer step)" in msg
    assert "the micro-batch does not change the optimizer step's memory" in msg
    for fix in ("adamw_bnb_8bit", "adafactor", "LoRA", "hf-memkit plan"):
        assert fix in msg
    assert len(holder[0].oom_recoveries) == 1


def test_optimizer_oom_keeps_the_micro_batch(base_model, tmp_path):
    """The forward fitted; after an optimizer OOM every later forward still takes 4 samples."""
    holder = []
    ref = train(Reference, copy.deepcopy(base_model), tmp_path / "ref")
    g = train(Guarded, copy.deepcopy(base_model), tmp_path / "g", setup=holder.append,
              callbacks=[OptimizerOOM(holder, steps=(2,))])
    assert [(r.step, r.where, r.micro_batch_size) for r in g.oom_recoveries] == \
        [(2, "optimizer step", 4)]
    assert g.forward_sizes == ref.forward_sizes == [4] * 6 and g.oom_chunk_size is None
    assert_same_training(ref, g)


def test_first_step_state_allocation_oom_is_retried_exactly(base_model, tmp_path, monkeypatch):
    """The usual optimizer OOM: AdamW's first step runs out of memory while it allocates its
    moments (the 7th ``zeros_like``), before any update. The half-made state is dropped and the
    step retried: no copy needed, the run is exact."""
    holder, calls = [], {"n": 0}
    real = torch.zeros_like

    def zeros_like(*a, **k):
        if holder[0].state.global_step == 0:
            calls["n"] += 1
            if calls["n"] == 7:
                raise oom()
        return real(*a, **k)

    class AllocateInStep(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            monkeypatch.setattr(torch, "zeros_like", zeros_like)

        def on_optimizer_step(self, args, state, control, **kwargs):
            monkeypatch.setattr(torch, "zeros_like", real)

    ref = train(Reference, copy.deepcopy(base_model), tmp_path / "ref", optim="adamw_torch")
    g = train(Guarded, copy.deepcopy(base_model), tmp_path / "g", setup=holder.append,
              callbacks=[AllocateInStep()], optim="adamw_torch")
    assert calls["n"] > 7                             # the retry allocated the state again
    [rec] = g.oom_recoveries
    assert (rec.step, rec.where, rec.micro_batch_size) == (1, "optimizer step", 4)
    assert "restored" not in rec.action and "foreach" not in rec.action
    assert_same_training(ref, g)


# ---- an optimizer OOM after a partial update ------------------------------------------------------


_FOREACH_SQRT = torch._foreach_sqrt


@pytest.fixture(autouse=True)
def _restore_foreach_sqrt():
    yield
    torch._foreach_sqrt = _FOREACH_SQRT


class PartialUpdateOOM(TrainerCallback):
    """Step 2's optimizer runs out of memory half-way through its update.

    single-tensor AdamW (``foreach=False``; torch's default on CPU): at the ``denom`` temporary of
    the 4th parameter, after parameters 1-3 were stepped and the 4th's step count and moments were
    updated. foreach AdamW: at ``_foreach_sqrt``, after every step count and moment, and the
    weight decay on every parameter, were applied.
    """

    def __init__(self, holder, kernels):
        self.holder, self.kernels = holder, kernels

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if state.global_step != 1:
            return
        opt = self.holder[0].optimizer.optimizer
        if self.kernels == "foreach":
            real = torch._foreach_sqrt

            def failing(*a, **k):
                torch._foreach_sqrt = real
                raise oom()

            torch._foreach_sqrt = failing
            return
        p = [p for g in opt.param_groups for p in g["params"]][3]
        exp_avg_sq = opt.state[p]["exp_avg_sq"]

        def failing_sqrt():
            del exp_avg_sq.sqrt
            raise oom()

        exp_avg_sq.sqrt = failing_sqrt


def partial_run(cls, model, out, kernels, holder=None, **trainer_kw):
    callbacks = [PartialUpdateOOM(holder, kernels)] if holder is not None else []
    if kernels == "foreach":
        trainer_kw["optimizers"] = (torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True),
                                    None)
    setup = holder.append if holder is not None else None
    return train(cls, model, out, setup=setup, callbacks=callbacks, trainer_kw=trainer_kw,
                 optim="adamw_torch")


@pytest.mark.parametrize("kernels", ["single-tensor", "foreach"])
def test_partial_update_is_undone_from_the_step_backup(base_model, tmp_path, kernels):
    holder = []
    ref = partial_run(Reference, copy.deepcopy(base_model), tmp_path / "ref", kernels)
    g = partial_run(Guarded, copy.deepcopy(base_model), tmp_path / "g", kernels, holder,
                    oom_step_backup=True)
    [rec] = g.oom_recoveries
    assert (rec.step, rec.where, rec.micro_batch_size) == (2, "optimizer step", 4)
    assert "restored from the host copy" in rec.action
    assert ("foreach kernels off" in rec.action) == (kernels == "foreach")
    assert all(grp["foreach"] is False for grp in g.optimizer.param_groups)
    assert g.forward_sizes == [4] * 6
    # the retried step and the last one run single-tensor kernels where the reference ran
    # foreach ones: the same arithmetic, in another order for the last bits
    assert_same_training(ref, g, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("kernels", ["single-tensor", "foreach"])
def test_partial_update_without_backup_stops_instead_of_drifting(base_model, tmp_path, kernels):
    holder = []
    with pytest.raises(mk.OOMRecoveryError) as err:
        partial_run(Guarded, copy.deepcopy(base_model), tmp_path, kernels, holder)
    msg = str(err.value)
    n = len(list(base_model.parameters()))
    changed = 4 if kernels == "single-tensor" else n
    assert f"changed {changed} of {n} parameter tensors" in msg
    assert "at optimizer step 2 (optimizer step)" in msg
    assert "oom_step_backup=True" in msg and "adamw_bnb_8bit" in msg
    assert holder[0].state.global_step == 1 and holder[0].oom_recoveries == []


class OnCuda(torch.nn.Parameter):
    """A parameter that says it lives on CUDA (what this machine cannot have): the step backup
    asks pinned host memory for its copy."""

    is_cuda = property(lambda self: True)


def test_step_backup_without_pinned_memory_warns_and_still_undoes_the_step(
        base_model, tmp_path, monkeypatch, caplog):
    """oom_step_backup=True on CUDA, and pinned host memory has run out: the backup says so and
    keeps its copy in pageable memory, so step 2's optimizer OOM after a partial update is still
    undone exactly and the run matches an uninterrupted one."""
    real_empty, pinned_asks = torch.empty, []

    def empty(*args, pin_memory=False, **kwargs):   # cudaHostAlloc fails, as torch raises it
        if pin_memory:
            pinned_asks.append(args)
            raise torch.AcceleratorError(PINNED_OOM)
        return real_empty(*args, **kwargs)

    holder = []

    def setup(trainer):
        holder.append(trainer)
        for p in trainer.model.parameters():
            p.__class__ = OnCuda
        monkeypatch.setattr(torch, "empty", empty)

    ref = partial_run(Reference, copy.deepcopy(base_model), tmp_path / "ref", "single-tensor")
    with caplog.at_level("WARNING", logger="hf_memkit._oom.guard"):
        g = train(Guarded, copy.deepcopy(base_model), tmp_path / "g", setup=setup,
                  callbacks=[PartialUpdateOOM(holder, "single-tensor")],
                  trainer_kw={"oom_step_backup": True}, optim="adamw_torch")
    [rec] = g.oom_recoveries
    assert (rec.step, rec.where) == (2, "optimizer step")
    assert "changed tensors restored from the host copy" in rec.action
    assert_same_training(ref, g, rtol=1e-9, atol=1e-12)
    assert len(pinned_asks) == 1                      # asked once; pageable from then on
    [warning] = [r.getMessage() for r in caplog.records if "pinned" in r.getMessage()]
    assert "could not get pinned (page-locked) host memory" in warning
    assert "CUDA error: out of memory" in warning and "pageable host memory" in warning
