"""The depth extrapolation against a real measurement: bench/estimator_cpu.py's 8-layer Llama cases
(deeper than ``FULL_TRACE_MAX_LAYERS``, so the estimate comes from traces of 2 and 3 blocks),
measured with the independent CPU ground truth (``hf_memkit.testing.groundtruth``) running the
whole model through a real Trainer. The bench measured -0.03% (fp32) and -0.05% (checkpointing);
the tolerance is the worst-case CPU bar, 3% (docs/quality-bars.md)."""

from __future__ import annotations

import sys

import pytest

from tests.helpers import BENCH

sys.path.insert(0, str(BENCH))

import estimator_cpu  # noqa: E402  (bench/estimator_cpu.py: the cases and their code path)

from hf_memkit._estimate.activations import EXTRAPOLATE_AT, FULL_TRACE_MAX_LAYERS  # noqa: E402
from hf_memkit._model.facts import layer_count  # noqa: E402

DEEP = ["llama8 fp32 adamw sdpa", "llama8 fp32 adamw ckpt"]


@pytest.mark.slow
@pytest.mark.parametrize("name", DEEP)
def test_extrapolated_estimate_matches_measured_peak(name):
    c = next(c for c in estimator_cpu.CASES if c["name"] == name)
    assert layer_count(c["config"]) > FULL_TRACE_MAX_LAYERS
    e = estimator_cpu.predict(c)
    assert tuple(e.traced_layers) == tuple(EXTRAPOLATE_AT)    # the extrapolation is exercised
    assert e.breakdown["activations"] >= 0.2 * e.peak_allocated   # not weights-dominated
    measured = estimator_cpu.measure(c)["peak"]
    assert e.peak_allocated == pytest.approx(measured, rel=0.03), (e.peak_allocated, measured)
