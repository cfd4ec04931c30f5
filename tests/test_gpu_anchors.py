"""A few published GPU anchors (shared/anchors/published_gpu_cases.yaml) through the same code path
as bench/estimator_gpu_anchors.py: prediction vs the *published* measurement, within 10%."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))

import _anchors  # noqa: E402  (bench/_anchors.py: the code path the bench uses)

from .conftest import STRICT  # noqa: E402

# one per model x attention kind (small shapes: the trace of 2+3 blocks takes < 1 s each),
# plus the NVML weights-loaded case
CASES = ["sdpa_pythia410m_sdpa_bs2_s512", "sdpa_pythia410m_eager_bs1_s1024",
         "sdpa_opt350m_sdpa_bs4_s256", "sdpa_opt350m_eager_bs2_s512",
         "hf_perf_bert_large_weights_loaded"]


@pytest.fixture(scope="module")
def cases():
    if not _anchors.ANCHORS.exists():
        # CI always has ../shared beside the clone: a missing file there is a failure
        if STRICT:
            pytest.fail(f"shared anchors not found at {_anchors.ANCHORS}")
        pytest.skip(f"anchors not found at {_anchors.ANCHORS} (run beside ../shared)")
    return {c["id"]: c for c in _anchors.load_cases()}


@pytest.mark.parametrize("case_id", CASES)
def test_within_10_percent_of_published(cases, case_id):
    c = cases[case_id]
    assert _anchors.exclusion(c) is None
    row = _anchors.predict(c)
    assert abs(row.err) <= 0.10, (case_id, row.published, row.predicted, row.detail)


def test_excluded_rows_have_reasons(cases):
    assert "copy error" in _anchors.exclusion(cases["sdpa_opt350m_sdpa_bs4_s2048"])
    assert "OOM" in _anchors.exclusion(cases["sdpa_opt350m_eager_bs8_s2048"])


def test_units():
    assert _anchors.to_bytes(1789.95, "MB (1e6 bytes)") == 1_789_950_000
    assert _anchors.to_bytes(1, "GiB") == 1 << 30
