"""The docs' benchmark tables are generated from the committed results files (bench/tables.py):
a table that differs from its file, or a figure typed over, fails here."""

from __future__ import annotations

import json
import sys

import pytest

from tests.helpers import ROOT

BENCH = ROOT / "bench"
sys.path.insert(0, str(BENCH))

import tables  # noqa: E402


def test_every_generated_table_equals_its_results_file(capsys):
    assert tables.main(["--check"]) == 0, capsys.readouterr()


def test_every_table_is_shown_and_reads_a_committed_file():
    shown = {m["name"] for doc in tables.DOCS for m in tables.MARKER.finditer(doc.read_text())}
    assert shown == set(tables.TABLES)
    for path, _ in tables.TABLES.values():
        assert path is None or path.is_file(), path


def test_a_figure_typed_over_is_found_and_rewritten():
    doc = ROOT / "docs" / "benchmarks.md"
    text = doc.read_text()
    m = next(m for m in tables.MARKER.finditer(text) if m["name"] == "gpu-reestimate")
    typed = text[:m.start("body")] + m["body"].replace("32/32", "31/32", 1) + text[m.end("body"):]
    assert typed != text
    assert tables.update(typed)[0] == text


def test_the_gpu_table_reads_its_file(tmp_path, monkeypatch):
    """The holdout's figure as measured on the GPU (``then``) is the one in bold, the
    re-estimate is marked as a fit figure; the cells are the file's numbers."""
    doc = json.loads(tables.TABLES["gpu-reestimate"][0].read_text())
    hold = doc["holdout"]["then"]["allocated"]
    out = tables.gpu_reestimate(doc)
    line = next(ln for ln in out.splitlines() if ln.startswith("| **holdout**") and "allocated" in ln)
    assert f"**{100 * hold['median']:+.1f}%, {100 * hold['worst']:+.1f}%, " \
           f"{hold['within_10pct']}/{hold['n']}**" in line
    assert line.endswith("(a fit figure) |")


def test_an_unknown_table_name_is_refused(tmp_path):
    with pytest.raises(KeyError):
        tables.update("<!-- table: no-such-table -->\nx\n<!-- /table -->\n")


def test_the_sharding_bar_leaves_the_offload_run_out():
    """On a CPU the offload run holds what full shard holds: it is shown, marked, and left out of
    the bar's count; the count is the file's other runs."""
    doc = json.loads(tables.TABLES["sharding-runs"][0].read_text())
    counted = [r for r in doc["runs"] if not r["offload"]]
    out = tables.sharding_runs(doc)
    within = sum(abs(r["error"]) <= 0.08 for r in counted)
    assert f"{within} of {len(counted)} within the 8% bar" in out.splitlines()[0]
    offload = [ln for ln in out.splitlines() if "not counted" in ln]
    assert len(offload) == len(doc["runs"]) - len(counted) >= 1


def test_the_community_counts_are_the_ones_the_bench_printed():
    """The table recounts the bar from the file's rows; the counts equal the summary the bench
    wrote when it ran (a row field lost on the way would change a verdict)."""
    doc = json.loads(tables.TABLES["community-configs"][0].read_text())
    s = doc["summary"]
    head = tables.community_configs(doc).split("\n\n")[0]
    assert f"`does not fit`: {len(s['refused'])} / {s['ran']}" in head
    assert f"called `fits`: {len(s['accepted'])} / {s['oom']}" in head
    assert f"{100 * s['median_abs_err']:.1f}% over {s['n_err']} rows" in head
    assert f"A plan for {s['planned']} / {s['ran']}" in head
