"""Two real gloo ranks on this CPU (torchrun): DDP through the Trainer and FSDP2 through
accelerate's own FSDP2 preparation, measured per rank by ``hf_memkit.testing.groundtruth_dist``;
and a bf16-loaded model under FSDP2 with ``bf16=True`` (accelerate's fp32 upcast) against the
estimate."""

from __future__ import annotations

import sys
import warnings

import pytest

import hf_memkit as mk
from hf_memkit._run.synthetic import tiny_llama_config
from hf_memkit.testing.groundtruth_dist import measure_distributed_peak
from tests.helpers import BENCH

# 2 layers, vocab 2048: model states (~4.6 MiB fp32 AdamW states per full replica) are a visible
# part of the peak at seq 64; learnable counting sequences so the loss falls in a few steps.
CONFIG = tiny_llama_config(num_hidden_layers=2, vocab_size=2048).to_dict()


def _spec(mode: str, **kw) -> dict:
    spec = {"mode": mode, "config": CONFIG, "seq_len": 64, "steps": 4, "learnable": True,
            "args": {"per_device_train_batch_size": 4, "learning_rate": 3e-3}}
    spec.update(kw)
    return spec


@pytest.fixture(scope="module")
def ddp():
    return measure_distributed_peak(_spec("ddp"), nproc=2)


@pytest.fixture(scope="module")
def fsdp2():
    return measure_distributed_peak(
        _spec("fsdp2", fsdp={"reshard_after_forward": True,
                             "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}), nproc=2)


def test_ddp_through_trainer_trains_in_sync(ddp):
    r0, r1 = ddp["ranks"]
    assert (r0["rank"], r1["rank"]) == (0, 1) and r0["world_size"] == 2
    assert r0["ddp"]["wrapper"] == "DistributedDataParallel"
    # each rank saw different samples, yet all-reduced gradients keep the replicas identical
    assert r0["data_digest"] != r1["data_digest"]
    assert r0["param_digest"] == r1["param_digest"] != r0["param_digest_initial"]
    assert r0["param_digest_initial"] == r1["param_digest_initial"]
    losses = ddp["losses"]
    assert len(losses) == 4 and all(0 < x < 20 for x in losses)
    assert losses[-1] < losses[0] - 0.1, losses


def test_ddp_per_rank_states_and_buckets(ddp):
    for rk in ddp["ranks"]:
        n = rk["local_param_bytes"]
        assert n == rk["full_param_bytes"]                   # a full replica per rank
        assert rk["local_grad_bytes"] == n
        assert rk["local_optimizer_bytes"] >= 2 * n          # AdamW exp_avg + exp_avg_sq
        # the Trainer's DDP keeps its own flat buckets (gradient_as_bucket_view=False): one
        # more copy of every gradient, counted at each window opening
        assert rk["ddp"]["gradient_as_bucket_view"] is False
        assert rk["ddp"]["bucket_bytes"] == n
        states = n + rk["local_grad_bytes"] + rk["local_optimizer_bytes"] + rk["ddp"]["bucket_bytes"]
        assert rk["peak"] > states
        assert all(s["peak"] >= s["alive_open"] for s in rk["steps"])
    peaks = [rk["peak"] for rk in ddp["ranks"]]
    assert max(peaks) < 1.05 * min(peaks)                    # same shapes on both ranks


def test_fsdp2_shards_states_and_trains(fsdp2):
    for rk in fsdp2["ranks"]:
        full = rk["full_param_bytes"]
        assert rk["local_param_bytes"] == pytest.approx(full / 2, rel=0.02)
        assert rk["local_grad_bytes"] == rk["local_param_bytes"]   # sharded gradients
        assert rk["local_optimizer_bytes"] == pytest.approx(2 * rk["local_param_bytes"], rel=0.01)
        units = {u["module"]: u["reshard_after_forward"] for u in rk["fsdp"]["units"]}
        assert units["model.layers.0"] is True and units["model.layers.1"] is True
        assert units["lm_head"] is False                           # accelerate's tail group
        # the peak holds this rank's states plus gathered layers and activations
        assert rk["peak"] > rk["local_param_bytes"] + rk["local_grad_bytes"] + rk[
            "local_optimizer_bytes"]
        assert rk["optimizer_impl"] == "fused"                    # Trainer default works on DTensor
    r0, r1 = fsdp2["ranks"]
    assert r0["data_digest"] != r1["data_digest"]                 # data seeded by rank
    losses = fsdp2["losses"]
    assert all(0 < x < 20 for x in losses) and losses[-1] < losses[0] - 0.1, losses


def _bench_case(name: str) -> dict:
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    import _dist_cases

    return next(c for c in _dist_cases.cases() if c["name"] == name)


def _measured_and_estimated(name: str, **kw) -> tuple[dict, mk.MemoryEstimate]:
    """A case of bench/_dist_cases.py measured on 2 gloo ranks, then estimated alike."""
    spec = _bench_case(name)
    measured = measure_distributed_peak({k: v for k, v in spec.items() if k != "name"}, nproc=2)
    from sharding import _our_args
    from transformers import AutoConfig

    cfg = dict(spec["config"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        est = mk.estimate_memory(AutoConfig.for_model(cfg.pop("model_type"), **cfg),
                                 _our_args(spec), seq_len=spec["seq_len"], device="cpu",
                                 num_gpus=2, **kw)
    return measured, est


@pytest.fixture(scope="module")
def bf16_loaded():
    """bench/_dist_cases.py's 7.4M-parameter Llama (model states ~30% of the peak), loaded in
    bf16, FSDP2 full shard with bf16 mixed precision: measured, then estimated alike."""
    return _measured_and_estimated("fsdp2-full-shard-bf16-loaded", dtype="bfloat16")


def test_fsdp2_upcasts_a_bf16_loaded_model_and_the_estimate_follows(bf16_loaded):
    measured, est = bf16_loaded
    for rk in measured["ranks"]:
        assert rk["fsdp"]["mixed_precision"] == "bf16"
        # accelerate upcast the trainable bf16 parameters: each rank's DTensor shards are fp32,
        # half the elements at twice the bytes of the bf16 model it was given
        assert rk["fsdp"]["param_dtype"] == "torch.float32"
        assert rk["local_param_bytes"] == pytest.approx(rk["full_param_bytes"], rel=0.01)
        assert rk["local_grad_bytes"] == rk["local_param_bytes"]           # fp32 grad shards
        assert rk["local_optimizer_bytes"] == pytest.approx(2 * rk["local_param_bytes"],
                                                            rel=0.01)    # fp32 AdamW moments
        states = rk["local_param_bytes"] + rk["local_grad_bytes"] + rk["local_optimizer_bytes"]
        assert est.model_states == pytest.approx(states, rel=0.01)
    # issue 24's acceptance was 8%; measured 2026-11-28, 2 runs: +1.86%, +1.89% (2.6x that)
    assert est.peak_allocated == pytest.approx(measured["peak"], rel=0.05)
    assert any("upcasts" in n for n in est.notes)


def test_fsdp2_accumulating_with_a_sync_each_batch_holds_its_sharded_gradients():
    """FSDP2 with checkpointing, 4 micro-batches, each reduce-scattered (accelerate's
    ``sync_each_batch``, what a plan sets): a later micro-step's backward holds the sharded
    gradients of the earlier ones beside what the first micro-step's backward holds. The
    estimate counted the traced gradients it had already held out twice and fell 6.3% short
    of the measured peak (a plan could pass a setup that does not fit)."""
    measured, est = _measured_and_estimated("fsdp2-full-shard-ckpt-accum4-sync")
    assert est.setup.sharding.sync_each_batch and est.setup.grad_accum == 4
    assert est.peak_phase == "backward (accumulating)"
    grads = measured["ranks"][0]["local_grad_bytes"]
    assert est.phase_peaks["backward (accumulating)"] - est.phase_peaks["backward"] == \
        pytest.approx(grads, rel=0.01)     # one rank's sharded gradients, measured
    # measured 2026-11-28, 2 runs: +1.65%, +1.73% (4% is 2.3x that)
    assert est.peak_allocated == pytest.approx(measured["peak"], rel=0.04)


def test_fsdp2_needs_less_per_rank_than_ddp(ddp, fsdp2):
    # same model, data shapes and optimizer: sharding halves every state on each rank
    assert max(r["peak"] for r in fsdp2["ranks"]) < min(r["peak"] for r in ddp["ranks"])


def test_bad_spec_is_rejected_before_launch():
    with pytest.raises(ValueError, match="mode 'zero3' is not one of ddp, fsdp2"):
        measure_distributed_peak({"mode": "zero3", "config": CONFIG, "seq_len": 64})
    with pytest.raises(ValueError, match="unknown fsdp option"):
        measure_distributed_peak(_spec("fsdp2", fsdp={"sharding_strategy": "FULL_SHARD"}))


def test_failing_rank_raises_with_its_stderr():
    bad = dict(CONFIG, hidden_size=130)   # not a multiple of 4 heads: every rank fails to build it
    with pytest.raises(RuntimeError,
                       match=r"(?s)0 of 2 ranks reported.*not a multiple of the number of attention"):
        measure_distributed_peak(_spec("fsdp2", config=bad), nproc=2, timeout=300)
