"""The allocation stream a deep model's replay uses is the step's own (issue #24, item 1).

A deep model is traced at 2 and 3 blocks; ``allocation.extend`` builds its full-depth event
stream from the 3-block trace's events, tagged with the block each happened in. The independent
measurement is a trace of the same model at full depth: its stream must be the same events
(sizes, in order, up to the order of storages freed together) and so replay to the same peaks.
"""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig
from transformers import LlamaConfig

import hf_memkit as mk
from hf_memkit._cuda.events import ALLOC, FREE
from hf_memkit._cuda.runtime import CALIBRATION, cublas_workspace
from hf_memkit._cuda.target import CudaTarget
from hf_memkit._estimate.activations import technique_hooks
from hf_memkit._estimate.allocation import canonical, extend, replay_step
from hf_memkit._model.adapters import LoraSpec
from hf_memkit._model.spec import resolve_model
from hf_memkit._setup.setup import normalize_args
from hf_memkit._trace.step import trace_step

A100 = CudaTarget((8, 0))
WS = cublas_workspace((8, 0)) // 2


def _config(n: int) -> LlamaConfig:
    return LlamaConfig(hidden_size=128, intermediate_size=512, num_hidden_layers=n,
                       num_attention_heads=4, num_key_value_heads=2, vocab_size=4000)


VARIANTS = {
    "bf16 AMP": dict(args={"bf16": True}, accum=1, lora=None),
    "checkpointing, accumulation 2": dict(
        args={"bf16": True, "gradient_checkpointing": True, "gradient_accumulation_steps": 2},
        accum=2, lora=None),
    "LoRA": dict(args={"bf16": True}, accum=1,
                 lora=LoraConfig(r=8, target_modules=["q_proj", "v_proj"],
                                 task_type="CAUSAL_LM")),
}


def _trace(n: int, variant: dict):
    cfg = _config(n)
    setup = normalize_args({"per_device_train_batch_size": 2, **variant["args"]})
    spec = resolve_model(cfg, task="causal-lm")
    lora = LoraSpec(variant["lora"]) if variant["lora"] is not None else None
    return trace_step(spec.model_cls, cfg, task="causal-lm", micro_batch=2, seq_len=256,
                      grad_accum=variant["accum"], amp="bf16", target=A100, lora=lora,
                      hooks=technique_hooks(setup))


def _sizes(events) -> list[tuple]:
    """What the allocator sees: each allocation's size and each free's, runs of frees (storages
    that die together) as a multiset."""
    sizes, out, run = {}, [], []
    for op, h, nbytes in events:
        if op == FREE:
            run.append(sizes[h])
            continue
        out.extend((FREE, s) for s in sorted(run))
        run = []
        if op == ALLOC:
            sizes[h] = nbytes
            out.append((ALLOC, nbytes))
    return out + [(FREE, s) for s in sorted(run)]


@pytest.fixture(scope="module")
def traces():
    return {}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("depth", [4, 8, 16, 32])
def test_extended_stream_is_the_full_depth_trace(traces, variant, depth):
    v = VARIANTS[variant]
    if (variant, 3) not in traces:
        traces[(variant, 3)] = _trace(3, v)
    three, full = traces[(variant, 3)], _trace(depth, v)
    built = canonical(extend(three.events, depth))
    real = canonical(full.events.events)
    assert _sizes(built) == _sizes(real)
    kw = dict(state_ratio=2.0, transient_ratio=1.0, micro_steps=v["accum"])
    a = replay_step(built, full.trainable, **kw)
    b = replay_step(real, full.trainable, **kw)
    assert (a.peak_allocated, a.peak_reserved) == (b.peak_allocated, b.peak_reserved)


def test_every_allocation_of_the_extended_stream_is_freed_as_in_the_trace():
    """The old construction (difflib on two shallow traces) left a copy's allocation alive when
    the alignment split it from its free: memory live forever, growing with depth. After the
    step, what is still allocated must be what the full-depth trace still holds."""
    v = VARIANTS["checkpointing, accumulation 2"]
    built = extend(_trace(3, v).events, 16)
    live = {h: n for op, h, n in built if op == ALLOC}
    for op, h, _ in built:
        if op == FREE:
            del live[h]
    full = _trace(16, v).events.events
    real = {h: n for op, h, n in full if op == ALLOC}
    for op, h, _ in full:
        if op == FREE:
            del real[h]
    assert sorted(live.values()) == sorted(real.values())


def test_replay_peak_allocated_is_the_estimates_peak_allocated(clean_cuda_env):
    """The estimate's peak_allocated comes from the phases' arithmetic (MemTracker peaks of the
    2- and 3-block traces, extrapolated); the replay's from the extended event stream. They are
    independent computations of one step: equal up to the allocator's 512 B rounding of each
    live block and the step's edges the phases take apart (the fitted constant is not
    replayed)."""
    from hf_memkit._estimate import device

    seen = {}
    real = device.replay_step

    def spy(events, params, **kw):
        s = real(events, params, **kw)
        if kw.get("capacity") is None:
            seen["peak"] = s.peak_allocated
        return s

    device.replay_step = spy
    try:
        est = mk.estimate_memory(_config(24), {"per_device_train_batch_size": 2, "bf16": True},
                                 seq_len=256, device="A100-80GB", cuda_version="12.8")
    finally:
        device.replay_step = real
    assert est.traced_layers == (2, 3)
    phase_arithmetic = est.peak_allocated - CALIBRATION.alloc_const
    assert seen["peak"] == pytest.approx(phase_arithmetic, rel=0.002)


@pytest.mark.parametrize("seq_len", [4096, 16384])
def test_checkpoint_offload_never_raises_device_used(clean_cuda_env, seq_len):
    """Offloading checkpointed activations to the host frees device memory; the allocator terms
    must not take it back (a leaking replay once made offload 5.7 GiB dearer at 16k). Up to one
    cuBLAS workspace aside: autograd's is allocated at the backward's first matmul, in the best
    fit among the blocks free then, which the two streams leave differently (at 4k offload's
    split a freed logits block and reserves 18 MiB more than plain)."""
    args = {"per_device_train_batch_size": 1, "bf16": True, "gradient_checkpointing": True}
    common = dict(seq_len=seq_len, device="H100-80GB", cuda_version="12.8",
                  dtype=torch.bfloat16)
    plain = mk.estimate_memory("meta-llama/Llama-3.1-8B", args, **common)
    offload = mk.estimate_memory("meta-llama/Llama-3.1-8B",
                                 {**args, "gradient_checkpointing_kwargs": {"offload": True}},
                                 **common)
    assert offload.device_used <= plain.device_used + cublas_workspace((9, 0)) // 2


def test_a_sharded_stream_is_replayed_on_the_device_with_the_ranks_headroom(
        clean_cuda_env, monkeypatch):
    """A sharded engine's stream holds its states unsharded: where its live bytes exceed what
    the allocator may reserve on the device, a replay at that capacity cannot complete (run
    here: it does not). The replay on the device keeps instead the rank's headroom over its own
    live bytes, as ``required`` carries the smallest capacity over, so a step that fits reports
    a ``device_used`` within the device (it reported the unconstrained replay's, 98.4 GiB for
    Llama-3.1-70B on an 80 GiB H100)."""
    from hf_memkit._estimate import device

    runs, real = [], device.replay_step

    def spy(events, params, **kw):
        s = real(events, params, **kw)
        runs.append((kw.get("capacity"), s, events, params, kw))
        return s

    monkeypatch.setattr(device, "replay_step", spy)
    fsdp = {"fsdp": "full_shard auto_wrap", "per_device_train_batch_size": 2, "bf16": True,
            "fsdp_config": {"version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}}
    # states dominate: 90 M parameters, a short sequence
    cfg = LlamaConfig(**{**_config(2).to_dict(), "hidden_size": 1024, "intermediate_size": 2752,
                         "vocab_size": 32000})
    dev = mk.get_device("A100-80GB")
    probe = mk.estimate_memory(cfg, fsdp, seq_len=64, device=dev, num_gpus=4,
                               cuda_version="12.8")
    unconstrained = runs[0][1]
    # a device whose allocator capacity lies between the smallest the rank runs in and what it
    # reserves with nothing pressing, below the unsharded stream's live bytes
    outside = probe.breakdown["context"] + CALIBRATION.alloc_const
    rank = probe.peak_allocated - CALIBRATION.alloc_const   # the rank's live bytes, replayed
    smallest = probe.required - outside
    rank_reserved = rank + unconstrained.peak_reserved - unconstrained.peak_allocated
    assert rank < smallest < rank_reserved < unconstrained.peak_allocated
    total = outside + (smallest + rank_reserved) // 2
    small = dev.replace(total_memory=total, cuda_memory=total)   # all of it CUDA's to hand out
    runs.clear()
    est = mk.estimate_memory(cfg, fsdp, seq_len=64, device=small, num_gpus=4,
                             cuda_version="12.8")
    _, s, events, params, kw = runs[0]
    cap = small.total_memory - outside
    assert runs[0][0] is None and s.peak_allocated > cap
    assert real(events, params, **{**kw, "capacity": cap}).ooms > 0
    # the device's replay: the rank's headroom (cap - rank) over the stream's live bytes
    assert runs[1][0] == cap + s.peak_allocated - rank and runs[1][1].ooms == 0
    assert all(c is not None and c >= s.peak_allocated for c, *_ in runs[1:])
    assert est.device_used <= small.total_memory < probe.device_used
    assert est.peak_reserved == probe.peak_reserved   # with nothing pressing: unchanged
