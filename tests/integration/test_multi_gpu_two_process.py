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
    assert predicted == pytest.approx(m["peak"], rel=0.08)
