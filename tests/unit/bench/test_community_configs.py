"""bench/community_configs.yaml, the published configurations bench/community_configs.py checks.

Schema only (no estimate is run): every row names its source, its outcome, a catalog GPU, a
model the catalog knows or the published config values, and a setup the bench can build.
"""

from __future__ import annotations

import re
import sys

import pytest

from tests.helpers import BENCH

sys.path.insert(0, str(BENCH))

import community_configs as cc  # noqa: E402  (bench/community_configs.py)

ROWS = cc.load_rows()
REQUIRED = ("id", "source", "outcome", "gpu", "task", "method", "args", "seq_len", "trainer",
            "stage", "fidelity")
IDS = [r.get("id", f"row{i}") for i, r in enumerate(ROWS)]
# transformers 5 forces tie_word_embeddings=True on T5-family configs (configuration_t5.py)
OVERRIDDEN_BY_TRANSFORMERS = {("t5", "tie_word_embeddings"), ("mt5", "tie_word_embeddings")}


def test_enough_rows_of_each_outcome():
    counted = [r for r in ROWS if r.get("counted", True)]
    ran = [r for r in counted if r["outcome"] == "ran"]
    assert len(ran) >= 18, f"{len(ran)} counted rows that ran; the issue asks for at least 18"
    assert sum(r["outcome"] == "oom" for r in counted) >= 3
    assert sum(bool(r.get("longest")) for r in ran) >= 3, "rows at the longest published context"


def test_ids_are_unique_and_plain():
    assert len(IDS) == len(set(IDS)), [i for i in IDS if IDS.count(i) > 1]
    assert all(re.fullmatch(r"[a-z0-9_]+", i) for i in IDS), IDS


@pytest.mark.parametrize("row", ROWS, ids=IDS)
def test_row_schema(row):
    import hf_memkit as mk
    from hf_memkit._model.catalog import list_models

    missing = [k for k in REQUIRED if k not in row]
    assert not missing, f"missing {missing}"
    src = row["source"]
    assert re.match(r"https?://\S+$", src["url"]), src
    assert src.get("where") and src.get("group"), "say where in the source the figure is"
    assert row["outcome"] in ("ran", "oom")
    assert row["gpu"] in mk.list_devices(), f"{row['gpu']!r} is not a catalog GPU"
    if "config" in row:
        assert row["config"].get("model_type"), "a published config needs its model_type"
        assert row.get("config_source", "").startswith("https://"), "say where the config is from"
    else:
        assert row.get("model") in list_models(), f"{row.get('model')!r} is not in the catalog"
    assert row["task"] in cc.TASK_TYPES
    assert row["method"] in ("full", "lora", "qlora")
    if row["method"] != "full":
        assert {"r", "alpha", "target_modules"} <= set(row["lora"])
    if row["method"] == "qlora":
        assert {"quant_type", "compute_dtype", "double_quant"} <= set(row["quantization"])
    if row.get("adapter_dtype"):
        assert row["method"] != "full" and row["adapter_dtype"] in ("bfloat16", "float16")
    assert row["stage"] in ("train", "forward_backward")
    assert row["trainer"] in ("trainer", "dpo")
    assert row["fidelity"] in ("exact", "approximate")
    assert isinstance(row["seq_len"], int) and row["seq_len"] > 0
    assert row["args"].get("per_device_train_batch_size", 0) >= 1
    if row["fidelity"] == "approximate":
        assert row.get("assumed"), "an approximate row says what it assumed"
    if row.get("counted", True) is False:
        assert row.get("why_not_counted")


@pytest.mark.parametrize("row", [r for r in ROWS if r.get("published")],
                         ids=[r["id"] for r in ROWS if r.get("published")])
def test_published_figure_has_a_unit_and_a_measure(row):
    pub = row["published"]
    assert pub["unit"] in cc.UNITS
    assert pub["measure"] in cc.MEASURE_FIELD
    assert float(pub["value"]) > 0
    assert row["outcome"] == "ran", "a figure is published for runs that ran"


def test_longest_rows_ran():
    assert all(r["outcome"] == "ran" for r in ROWS if r.get("longest"))


@pytest.mark.parametrize("row", [r for r in ROWS if "config" in r or r.get("config_overrides")],
                         ids=[r["id"] for r in ROWS if "config" in r or r.get("config_overrides")])
def test_published_configs_build_without_a_download(row):
    """The bench builds these configs locally (transformers' own classes, nothing fetched) and
    they keep the published values, except where transformers overrides one on purpose (the
    row's `assumed` says what that changes)."""
    config = cc.build_model(row)
    values = dict(row.get("config") or row.get("config_overrides"))
    model_type = values.pop("model_type", None)
    for key, value in values.items():
        if (model_type, key) in OVERRIDDEN_BY_TRANSFORMERS:
            assert any(key in a for a in row["assumed"]), f"say what the override of {key} does"
            continue
        assert getattr(config, key) == value, key


def test_the_verdict_words_and_what_counts_as_wrong():
    """The bench's verdicts are hf_memkit's three words, from required, upper and budget: a run
    that ran is wrong only when called `does not fit`, an OOM only when called `fits`; a
    `tight` row of either is listed with its margin."""
    GiB = 2**30

    def row(outcome, required, upper, budget=20 * GiB):
        return cc.Result("r", outcome, "RTX-4090", 24 * GiB, True, False, required=required,
                         upper=upper, budget=budget, fits=True)

    assert row("ran", 18 * GiB, 19 * GiB).verdict == "fits"
    tight = row("ran", 19 * GiB, 21 * GiB)
    assert tight.verdict == "tight" and tight.correct is True
    assert row("oom", 19 * GiB, 21 * GiB).correct is True           # tight, not called fits
    assert row("oom", 18 * GiB, 19 * GiB).correct is False          # an OOM called fits
    refused = row("ran", 21 * GiB, 22 * GiB)
    assert refused.verdict == "does not fit" and refused.correct is False
    s = cc.summarize([tight, refused, row("oom", 25 * GiB, 26 * GiB)])
    assert s["refused"] == ["r"] and s["accepted"] == [] and s["bar_met"] is True  # 1 allowed
    assert s["tight"] == {"r": {"outcome": "ran", "margin": 2 * GiB, "within_budget_by": GiB}}
