"""``hf-memkit train`` of ``trainer: sft`` and ``trainer: dpo`` recipes through the real
``trl.SFTTrainer`` and ``trl.DPOTrainer`` on CPU, each run's measured peak checked against the
plan's prediction (the CLI and recipe side of TRL is in tests/unit/commands/test_trl_options.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from tests.helpers import require

require("trl")

from hf_memkit._recipe import load_recipe  # noqa: E402
from tests.unit.commands.test_trl_options import DPO_RECIPE, SFT_RECIPE  # noqa: E402


def _train_cli(recipe: Path, out: Path) -> dict:
    """``hf-memkit train RECIPE --json`` as its own process (the CLI re-executes itself with
    MALLOC_MMAP_THRESHOLD_ so that its CPU readings are exact)."""
    import os

    proc = subprocess.run([sys.executable, "-m", "hf_memkit.commands.main", "train",
                           str(recipe), "--output-dir", str(out), "--json"],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout)
    report = json.loads(Path(res["memory_report"]).read_text())
    assert report["cpu_readings"]["exact"] is True
    assert [s["step"] for s in report["steps"]] == [1, 2] and res["steps"] == 2
    assert res["measured_over_predicted"] == pytest.approx(
        res["measured_peak_allocated"] / res["predicted_peak_allocated"])
    return res


def _plan_as(recipe: Path, trainer: str):
    """The recipe's plan for another trainer (its pins that the other config lacks dropped)."""
    import dataclasses

    from hf_memkit._run.train import plan_recipe
    from hf_memkit._setup.fields import config_class, config_field_names

    r = load_recipe(recipe)
    fields = config_field_names(config_class(trainer))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return plan_recipe(dataclasses.replace(
            r, trainer=trainer, pins={k: v for k, v in r.pins.items() if k in fields}))


def test_train_sft_recipe_runs_sfttrainer_and_reports_measured_vs_predicted(tmp_path):
    """2 steps through the real trl.SFTTrainer. The measured peak is TRL's: within 3% of the
    SFT prediction, far above the plain Trainer's for the same setup."""
    res = _train_cli(SFT_RECIPE, tmp_path / "run")
    assert res["trainer"] == "sft" and res["device"] == "cpu"
    assert res["plan"]["training_args"]["max_length"] == 64            # an SFTConfig field
    measured, predicted = res["measured_peak_allocated"], res["predicted_peak_allocated"]
    assert abs(measured / predicted - 1) < 0.03, (measured, predicted)
    assert measured > 1.5 * _plan_as(SFT_RECIPE, "trainer").estimate.peak_allocated
    # SFTTrainer saves its processing class: the in-memory word-level tokenizer
    out = tmp_path / "run"
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()


def test_train_dpo_recipe_runs_dpotrainer_with_a_reference_copy(tmp_path):
    """2 steps through the real trl.DPOTrainer on synthetic pairs (chosen + rejected rows, a
    frozen copy of the policy as reference): within 3% of the DPO prediction, which holds the
    reference's weights and the doubled rows that the SFT prediction of the same setup lacks."""
    res = _train_cli(DPO_RECIPE, tmp_path / "run")
    assert res["trainer"] == "dpo" and res["plan"]["training_args"]["beta"] == 0.1
    measured, predicted = res["measured_peak_allocated"], res["predicted_peak_allocated"]
    assert abs(measured / predicted - 1) < 0.03, (measured, predicted)
    sft = _plan_as(DPO_RECIPE, "sft").estimate
    assert measured > sft.peak_allocated + sft.breakdown["weights"]
