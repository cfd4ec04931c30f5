"""What a person reads: the fits verdict and its budget (API, table, --json), compact reprs and
notebook HTML, CLI tables that never cut a number, the compact `plan --json`, the train summary's
install hint, and breakdown rows named for the phase the peak is in."""

from __future__ import annotations

import dataclasses
import json
import re
import warnings
from html.parser import HTMLParser

import pytest
from transformers import LlamaConfig

import hf_memkit as mk
from hf_memkit._errors import ConfigError
from hf_memkit._estimate.budget import cuda_capacity
from hf_memkit._units import GiB, MiB, format_bytes
from hf_memkit._views.text import render_to_text
from hf_memkit.commands.main import main

TINY = LlamaConfig(hidden_size=128, intermediate_size=344, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, vocab_size=2000,
                   tie_word_embeddings=False, attention_dropout=0.0)
ARGS = {"per_device_train_batch_size": 2}
SEQ = 128


def _quiet(fn, *a, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*a, **kw)


@pytest.fixture(scope="module")
def tiny_plan():
    return _quiet(mk.plan_training, TINY, seq_len=SEQ, target_batch_size=8, device="T4")


@pytest.fixture
def tiny_dir(tmp_path):
    TINY.save_pretrained(tmp_path)
    return str(tmp_path)


# -- fits / budget -----------------------------------------------------------------------------

def test_8b_full_finetune_does_not_fit_a_4090():
    """The README's example: a full fine-tune of Llama-3.1-8B on a 24 GiB RTX 4090 gets a
    verdict, in Python and in explain()."""
    est = mk.estimate_memory("Llama-3.1-8B", {"per_device_train_batch_size": 1, "bf16": True,
                                              "gradient_checkpointing": True,
                                              "optim": "adamw_bnb_8bit"},
                             seq_len=2048, device="RTX-4090")
    dev = mk.get_device("RTX-4090")
    assert est.budget == cuda_capacity(dev)[0] < dev.total_memory   # no headroom by default
    assert est.required > est.budget and est.fits is False and est.verdict == "does not fit"
    text = est.explain()
    assert re.search(r"verdict\s*│\s*does not fit", text)
    assert f"{format_bytes(est.required - est.budget)} missing" in text
    d = est.to_dict()
    assert d["fits"] is False and d["verdict"] == "does not fit" and d["budget"] == est.budget


def test_tiny_model_fits_and_budget_follows_headroom_and_max_memory():
    t4 = mk.get_device("T4")
    est = mk.estimate_memory(TINY, ARGS, seq_len=SEQ, device="T4")
    assert est.fits is True and est.verdict == "fits" and est.budget == cuda_capacity(t4)[0]
    assert "no other tenant assumed" in est.budget_basis
    half = mk.estimate_memory(TINY, ARGS, seq_len=SEQ, device="T4", headroom=0.5)
    assert half.budget == int(cuda_capacity(t4)[0] * 0.5)
    tight = mk.estimate_memory(TINY, ARGS, seq_len=SEQ, device="T4", max_memory="1MiB")
    assert tight.budget == MiB and tight.fits is False and tight.budget_basis == "max_memory"
    assert tight.device_used == est.device_used       # the budget changes the verdict only


def test_estimate_budget_is_the_planners():
    """One rule: a plan's budget and an estimate's, for the same device and arguments."""
    p = _quiet(mk.plan_training, TINY, seq_len=SEQ, target_batch_size=8, device="T4",
               max_memory="3GiB", headroom=0.3)
    est = mk.estimate_memory(TINY, ARGS, seq_len=SEQ, device="T4", max_memory="3GiB",
                             headroom=0.3)
    assert est.budget == p.budget == 3 * GiB
    assert p.estimate.budget == p.budget and p.estimate.fits is True


def test_bad_headroom_and_max_memory_are_reported_together():
    with pytest.raises(ConfigError) as e:
        mk.estimate_memory(TINY, ARGS, seq_len=SEQ, device="T4", headroom=1.5,
                           max_memory="lots")
    assert "headroom must be in [0, 1)" in str(e.value) and "max_memory" in str(e.value)


def test_without_a_budget_the_verdict_says_unknown():
    est = mk.estimate_memory(TINY, ARGS, seq_len=SEQ, device="T4")
    old = {k: v for k, v in est.to_dict().items() if k not in ("budget", "fits", "upper")}
    again = mk.MemoryEstimate.from_dict(old)          # an estimate saved before budgets
    assert again.budget is None and again.fits is None
    assert re.search(r"verdict\s*│\s*unknown", again.explain())
    assert mk.MemoryEstimate.from_dict(est.to_dict()).fits is True


def test_estimate_cli_table_and_json_carry_the_verdict(tiny_dir, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    base = ["estimate", tiny_dir, "--gpu", "T4", "--seq-len", str(SEQ), "--batch", "2"]
    assert _quiet(main, [*base, "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["fits"] is True and d["budget"] == cuda_capacity(mk.get_device("T4"))[0]
    assert d["verdict"] == "fits"
    assert d["upper"] >= d["device_used"]
    assert _quiet(main, [*base, "--max-memory", "1MiB"]) == 1     # does not fit: exit 1
    out = capsys.readouterr().out
    assert re.search(r"budget\s*│\s*1.00 MiB", out)
    assert re.search(r"verdict\s*│\s*does not fit", out)
    assert "missing" in out and "…" not in out


def test_tight_is_the_centre_within_the_budget_and_its_margin_over_it(tiny_dir, capsys):
    """Three words: a budget between what the step needs and that plus its margin is `tight`
    (expected to run: `fits` is True), with what to do; the CLI exits 3 on it."""
    est = mk.estimate_memory(TINY, ARGS, seq_len=SEQ, device="T4")
    assert est.upper > est.required
    between = est.required + (est.upper - est.required) // 2
    tight = mk.estimate_memory(TINY, ARGS, seq_len=SEQ, device="T4", max_memory=between)
    assert tight.required <= tight.budget < tight.upper
    assert tight.verdict == "tight" and tight.fits is True
    assert tight.to_dict()["verdict"] == "tight" and "verdict='tight'" in repr(tight)
    text = tight.explain()
    assert re.search(r"verdict\s*│\s*tight", text)
    assert "expandable_segments:True" in text and "one micro-batch" in text
    below = mk.estimate_memory(TINY, ARGS, seq_len=SEQ, device="T4", max_memory=est.required - 1)
    assert below.verdict == "does not fit" and below.fits is False
    base = ["estimate", tiny_dir, "--gpu", "T4", "--seq-len", str(SEQ), "--batch", "2"]
    assert _quiet(main, [*base, "--max-memory", str(between)]) == 3
    assert "tight" in capsys.readouterr().out


# -- reprs and notebook HTML -------------------------------------------------------------------

class _Tags(HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)


def test_plan_and_estimate_reprs_are_short(tiny_plan):
    r = repr(tiny_plan)
    assert len(r) <= 2000 and tiny_plan.chosen.label() in r and "verdict='fits'" in r
    assert len(repr(tiny_plan.estimate)) <= 2000 and "verdict='fits'" in repr(tiny_plan.estimate)
    assert all(len(repr(c)) <= 2000 for c in tiny_plan.candidates)
    assert repr(tiny_plan) == repr(mk.Plan.from_json(tiny_plan.to_json()))


def test_repr_html_shows_setup_bar_and_verdict(tiny_plan):
    for obj in (tiny_plan, tiny_plan.estimate):
        page = obj._repr_html_()
        parser = _Tags()
        parser.feed(page)
        assert "script" not in parser.tags and "http" not in page   # no JS, nothing external
        assert "fits" in page and "budget" in page and "weights" in page
    page = tiny_plan._repr_html_()
    assert tiny_plan.chosen.label() in page
    tight = mk.estimate_memory(TINY, ARGS, seq_len=SEQ, device="T4", max_memory="1MiB")
    assert "does not fit" in tight._repr_html_()


# -- CLI tables never cut a number -------------------------------------------------------------

@pytest.mark.parametrize("columns", [80, 60])
def test_devices_table_keeps_every_number_whole(columns, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", str(columns))
    assert main(["devices"]) == 0
    out = capsys.readouterr().out
    assert "…" not in out
    for name in mk.list_devices():
        dev = mk.get_device(name)
        row = next(ln for ln in out.splitlines() if ln.startswith(name + " "))
        assert format_bytes(dev.total_memory) in row and f"{dev.peak_tflops['fp32']:g}" in row
    if columns == 80:
        assert max(len(ln) for ln in out.splitlines()) <= 80


def test_tables_hold_brackets_and_long_values_verbatim():
    from hf_memkit._views.text import add_column, add_row, new_table

    t = new_table("x")
    add_column(t, "field")
    add_column(t, "value", numeric=True)
    add_row(t, "hint: pip install 'hf-memkit[plot]' " * 3, "123456789.00 GiB")
    text = render_to_text(t, width=30)
    assert "123456789.00 GiB" in text and "hf-memkit[plot]" in text and "…" not in text


def test_train_summary_prints_the_plot_extra(tiny_plan, tmp_path):
    from hf_memkit._run.train import TrainResult
    from hf_memkit.commands.train import summary_table

    result = TrainResult(recipe="r.yaml", plan=tiny_plan, steps=2, first_loss=7.0, last_loss=6.0,
                         seconds=1.0, device="cpu", predicted_peak=100, measured_peak=101,
                         output_dir=str(tmp_path), model_dir=None, memory_report=None,
                         memory_plot=None)
    assert "pip install 'hf-memkit[plot]'" in render_to_text(summary_table(result))


# -- plan --json -------------------------------------------------------------------------------

def test_plan_json_is_compact_with_chosen_first(tiny_dir, capsys):
    base = ["plan", tiny_dir, "--gpu", "T4", "--seq-len", str(SEQ), "--target-batch", "8",
            "--json"]
    assert _quiet(main, base) == 0
    out = capsys.readouterr().out
    d = json.loads(out)
    assert next(iter(d)) == "chosen"
    ch = d["chosen"]
    assert ch["memory"]["fits"] is True and ch["memory"]["upper"] <= d["budget"]
    assert ch["training_args_kwargs"]["per_device_train_batch_size"] == ch["micro_batch"]
    assert len(out) < 40_000 and sum(d["candidates_not_estimated"].values()) > 0
    plan = mk.Plan.from_json(out)                     # the compact form still loads
    assert plan.chosen.label() == ch["label"] and plan.estimate.fits is True
    assert _quiet(main, [*base, "--full"]) == 0
    full = json.loads(capsys.readouterr().out)
    assert len(full["candidates"]) > len(d["candidates"]) and full["chosen"] == ch


# -- breakdown in the peak phase's terms -------------------------------------------------------

def test_breakdown_names_the_peak_phase_and_empty_terms():
    est = mk.estimate_memory(TINY, ARGS, seq_len=SEQ, device="T4")
    at_forward = dataclasses.replace(est, peak_phase="forward",
                                     breakdown={**est.breakdown, "gradients": 0})
    text = at_forward.explain()
    assert "gradients (none alive yet)" in text and "peak in: forward (" in text
    at_step = dataclasses.replace(est, peak_phase="optimizer step",
                                  breakdown={**est.breakdown, "activations": 8})
    assert "activations (freed by then)" in at_step.explain()
    ev = mk.estimate_memory(TINY, {**ARGS, "per_device_eval_batch_size": 2}, seq_len=SEQ,
                            device="T4", stage="eval")
    assert "gradients (none in eval)" in ev.explain()
