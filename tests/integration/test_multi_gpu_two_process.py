"""Multi-GPU estimates against 2-process CPU runs under torchrun (DDP, FSDP2, DeepSpeed ZeRO-3 on
gloo): the measured per-rank peak (``hf_memkit.testing.groundtruth_dist``) vs the per-rank
estimate, for bench/_dist_cases.py's cases shortened to 3 steps."""

from __future__ import annotations

import json

import pytest

from tests.unit.engines.test_multi_gpu import _bench, est


def _run_and_estimate(spec):
    from transformers import AutoConfig

    from hf_memkit.testing.groundtruth_dist import measure_distributed_peak

    _bench()
    from sharding import _our_args

    m = measure_distributed_peak(spec, nproc=2)
    cfg = dict(spec["config"])
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    e = est(config, _our_args(spec), seq_len=spec["seq_len"], device="cpu", num_gpus=2)
    m["estimate"] = e
    return m, e.peak_allocated + e.host_offloaded


def _small_case(mode, **kw):
    _bench()
    import _dist_cases

    name = kw.pop("name")
    spec = next(c for c in _dist_cases.cases() if c["name"] == name)
    spec = json.loads(json.dumps(spec))
    spec["steps"] = 3
    assert spec["mode"] == mode
    return spec


@pytest.mark.parametrize("name,mode", [("ddp-fp32-adamw", "ddp"),
                                       ("fsdp2-full-shard", "fsdp2"),
                                       ("deepspeed-zero3-bf16", "deepspeed")])
def test_two_process_run_matches_per_rank_estimate(name, mode):
    m, predicted = _run_and_estimate(_small_case(mode, name=name))
    assert len(m["ranks"]) == 2
    if mode != "deepspeed":
        assert predicted == pytest.approx(m["peak"], rel=0.08)
        return
    # ZeRO-3 (issue 44): the bf16 flat gradient-partition buffer (2 B / N, resident from the
    # start) sets the backward's peak: 4 B / N is +3.4%, none -3.0%
    assert predicted == pytest.approx(m["peak"], rel=0.02)
    # the optimizer step, measured in a window of its own: each sub-group's gradients flattened
    # and cast to fp32 (6 B an element) and held through torch AdamW's step on the flat fp32
    # partition (its sqrt and quotient, 8 B); without that transient the phase is 33% under
    stepped = max(s["step_peak"] for r in m["ranks"] for s in r["steps"] if s["step"] >= 2)
    assert m["estimate"].phase_peaks["optimizer step"] == pytest.approx(stepped, rel=0.12)


def test_fsdp1_holds_the_root_unit_that_fsdp2_splits():
    """FSDP1 and FSDP2 full shard of the same model on 2 gloo ranks (accelerate's own preparation
    of each): FSDP1 keeps its root unit (embedding, final norm, head) gathered through the step,
    so its peak is higher by the embedding; the estimate's difference is the measured one. As
    FSDP2 (before issue 44) the estimate saw no difference at all."""
    one, p1 = _run_and_estimate(_small_case("fsdp2", name="fsdp1-full-shard"))
    two, p2 = _run_and_estimate(_small_case("fsdp2", name="fsdp2-full-shard"))
    measured = one["peak"] - two["peak"]
    assert measured > 0
    assert p1 - p2 == pytest.approx(measured, rel=0.1)
    assert p1 == pytest.approx(one["peak"], rel=0.08)
