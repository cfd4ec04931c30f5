"""Published GPU anchors (shared/anchors/published_gpu_cases.yaml) through the same code path as
bench/estimator_gpu_anchors.py, on HOLDOUT-half rows only (``_anchors.half_of``: CRC32 of the id
odd), one per model x attention kind. The holdout has no NVML row (both NVML rows hash to the fit
half, and the context row defines ``_cuda.CONTEXT_EAGER_LOADING``) and no reserved row.

What the bench says about the holdout half (32 sdpa_* max_memory_allocated rows):
* the estimator's own account (``reconstruct=False``: trace of transformers 5 code + cuBLAS
  workspaces + ``alloc_const``) misses by median 14.9%, worst -35.9%, every row under-predicted
  (the benchmark script keeps ``out`` alive, and transformers 4.4x code kept more tensors);
  only 8/32 rows are within 10%;
* with the reconstruction terms of ``_anchors.sdpa_terms`` it lands at median 0.7%, worst -6.4%.
  Those terms were designed looking at all rows, holdout included: the with-terms test below
  checks that the trace plus the documented terms still reproduce the published numbers, it is
  not a blind holdout test.

So: ``test_with_reconstruction_terms`` holds the four rows WITH the terms to about twice each
row's measured error (at most the 10% bar), and ``test_estimator_alone`` holds the same rows
WITHOUT any term to within half of each row's measured miss, inside the band the bench documents
(-40% .. +10%: holdout worst -35.9%, none above 0). The rows are activation-heavy: weights +
gradients alone miss each of them by more than 50%, which the no-terms test checks, so a trace
that lost the activations fails both tests. An estimator change that moves a row beyond its
tolerance updates ``CASES`` with the new measured error and the reason (the anchors are pure fp16
without autocast, so of the trace's move to CUDA's autocast and SDPA kernels only the SDPA part
can matter here).
"""

from __future__ import annotations

import sys

import pytest

from tests.helpers import BENCH, STRICT

sys.path.insert(0, str(BENCH))

import _anchors  # noqa: E402  (bench/_anchors.py: the code path the bench uses)

# one holdout row per model x attention kind, each with its own tolerances, about twice the
# error measured on 2026-11-28 (``_anchors.predict(...).err``, deterministic: no measurement runs):
#   with terms: |err| <= max(1 point, 2 x |measured|), never above the 10% bar;
#   without any term: within max(1 point, half the measured error) of it, never outside the
#   bench's holdout band -40% .. +10%.
# case id: (with-terms bound, (without-terms low, high))   measured with terms / without
CASES = {
    "sdpa_pythia410m_sdpa_bs4_s512": (0.10, (-0.40, -0.157)),     # -5.31% / -31.39%
    "sdpa_pythia410m_eager_bs1_s2048": (0.03, (-0.110, -0.036)),  # -1.35% /  -7.35%
    "sdpa_opt350m_sdpa_bs8_s1024": (0.09, (-0.346, -0.115)),      # -4.57% / -23.03%
    "sdpa_opt350m_eager_bs4_s512": (0.01, (-0.312, -0.103)),      # +0.03% / -20.75%
}
BAR = 0.10                      # docs/quality-bars.md: holdout rows within 10%
ALONE_BAND = (-0.40, 0.10)      # bench holdout without terms: worst -35.9%, max -1.8%


@pytest.fixture(scope="module")
def cases():
    if not _anchors.ANCHORS.exists():
        # CI always has ../shared beside the clone: a missing file there is a failure
        if STRICT:
            pytest.fail(f"shared anchors not found at {_anchors.ANCHORS}")
        pytest.skip(f"anchors not found at {_anchors.ANCHORS} (run beside ../shared)")
    return {c["id"]: c for c in _anchors.load_cases()}


def _usable_holdout(cases, case_id):
    c = cases[case_id]
    assert _anchors.half_of(case_id) == "holdout", case_id
    assert _anchors.exclusion(c) is None
    return c


@pytest.mark.parametrize("case_id", CASES)
def test_with_reconstruction_terms(cases, case_id):
    row = _anchors.predict(_usable_holdout(cases, case_id), reconstruct=True)
    assert row.half == "holdout" and row.figure == "allocated"
    assert row.detail["script_out"] > 0          # the terms are really in
    assert abs(row.err) <= CASES[case_id][0] <= BAR, (case_id, row.published, row.predicted,
                                                      row.detail)


@pytest.mark.parametrize("case_id", CASES)
def test_estimator_alone(cases, case_id):
    c = _usable_holdout(cases, case_id)
    row = _anchors.predict(c, reconstruct=False)
    d = row.detail
    assert d["script_out"] == d["old_code"] == d["old_code_static"] == 0
    lo, hi = CASES[case_id][1]
    assert ALONE_BAND[0] <= lo <= row.err <= hi <= ALONE_BAND[1], (case_id, row.published,
                                                                    row.predicted, d)
    # the band is not met by construction: weights + gradients alone (pure fp16) fall outside it
    _, weights = _anchors.traced_phases(_anchors.MODELS[c["model"]], c["attention_impl"],
                                        int(c["batch_size"]), int(c["seq_len"]))
    assert 2 * weights / row.published - 1 < lo - 0.10, (case_id, weights)


def test_split_covers_every_row(cases):
    """half_of decides every row, NVML included; the context row is marked as a constant."""
    for cid in ("hf_perf_bert_large_weights_loaded", "hf_perf_cuda_context_overhead"):
        assert _anchors.predict(cases[cid]).half == _anchors.half_of(cid)
    assert "hf_perf_cuda_context_overhead" in _anchors.DEFINES_CONSTANT


def test_excluded_rows_have_reasons(cases):
    assert "copy error" in _anchors.exclusion(cases["sdpa_opt350m_sdpa_bs4_s2048"])
    assert "OOM" in _anchors.exclusion(cases["sdpa_opt350m_eager_bs8_s2048"])


def test_units():
    assert _anchors.to_bytes(1789.95, "MB (1e6 bytes)") == 1_789_950_000
    assert _anchors.to_bytes(1, "GiB") == 1 << 30
