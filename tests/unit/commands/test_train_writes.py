"""``hf-memkit train`` writes only where it should (issue 28): nothing pushed to the Hub or reported
to a service unless a flag says so, ``output_dir`` inside the working directory unless absolute,
no training over a directory that holds something unless ``--overwrite``, and an unwritable
directory said so, exit 2, before the plan (the real run's arguments: test_train_recipes.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from hf_memkit._errors import ConfigError
from hf_memkit._recipe import bundled_recipes_dir, load_recipe
from hf_memkit._run.train import check_run_writes
from tests.unit.commands.test_bad_input import cli

TINY = bundled_recipes_dir() / "tiny-llama" / "1m_full_cpu.yaml"


@pytest.fixture
def in_tmp(tmp_path, monkeypatch) -> Path:
    """The working directory is a fresh folder (the recipe's output_dir is relative to it)."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture
def no_plan(monkeypatch):
    """These refusals come before the plan: planning fails the test."""
    from hf_memkit._run import train

    def planned(*a, **k):
        raise AssertionError("planned before the refusal")

    monkeypatch.setattr(train, "plan_recipe", planned)


def recipe(folder: Path, pins: str = "", output_dir: str | None = None) -> str:
    text = TINY.read_text().replace("  seed: 0\n", "  seed: 0\n" + pins)
    if output_dir is not None:
        text = text.replace("output_dir: demo_output", f"output_dir: {output_dir}")
    p = folder / "r.yaml"
    p.write_text(text)
    return str(p)


# -- the Hub and reporting services -------------------------------------------------------------

HUB_PINS = ("  push_to_hub: true\n  hub_model_id: me/tiny\n  hub_token: hf_secret123\n"
            "  report_to: [wandb, tensorboard]\n")


def test_hub_and_report_pins_are_refused_without_the_flags(in_tmp, no_plan, capsys):
    code, err = cli(["train", recipe(in_tmp, HUB_PINS)], capsys)
    assert code == 2 and "Traceback" not in err
    for words in ("pins.push_to_hub: True pushes the model to the Hugging Face Hub",
                  "pins.hub_model_id: 'me/tiny'", "pins.hub_token: set", "add --push-to-hub",
                  "pins.report_to: ['wandb', 'tensorboard'] reports the run to wandb, "
                  "tensorboard", "add --report-to wandb,tensorboard", "or drop the pin"):
        assert words in err, (words, err)
    assert "hf_secret123" not in err                 # a token is never echoed
    assert not (in_tmp / "demo_output").exists()


def test_command_line_pins_count_as_the_recipes(in_tmp, no_plan, capsys):
    code, err = cli(["train", recipe(in_tmp), "push_to_hub=true", "report_to=all"], capsys)
    assert code == 2
    assert "pins.push_to_hub" in err and "--push-to-hub" in err
    assert "reports the run to every installed integration" in err and "--report-to all" in err


def test_the_flags_allow_what_they_name(in_tmp):
    r = load_recipe(recipe(in_tmp, HUB_PINS.replace("[wandb, tensorboard]", "[tensorboard]")))
    got = check_run_writes(r, push_to_hub=True, report_to=["tensorboard"])
    assert got == {"output_dir": "demo_output", "push_to_hub": True,
                   "report_to": ["tensorboard"]}
    # a flag naming fewer services than the recipe still refuses the others
    with pytest.raises(ConfigError, match="reports the run to wandb.*--report-to "
                                          "tensorboard,wandb"):
        check_run_writes(load_recipe(recipe(in_tmp, HUB_PINS)), push_to_hub=True,
                         report_to=["tensorboard"])
    # without pins, the trainer's config carries no push and report_to="none"
    plain = load_recipe(recipe(in_tmp))
    assert check_run_writes(plain) == {"output_dir": "demo_output", "push_to_hub": False,
                                       "report_to": "none"}
    assert check_run_writes(plain, report_to="tensorboard")["report_to"] == ["tensorboard"]


def test_a_service_that_is_not_installed_exits_2_before_the_plan(in_tmp, no_plan, capsys):
    from transformers.integrations.integration_utils import (
        INTEGRATION_TO_CALLBACK,
        get_available_reporting_integrations,
    )

    here = get_available_reporting_integrations()
    absent = next(s for s in ("wandb", *INTEGRATION_TO_CALLBACK) if s not in here)
    code, err = cli(["train", recipe(in_tmp), "--report-to", absent], capsys)
    assert code == 2 and "Traceback" not in err
    assert f"--report-to: {absent} is not installed here" in err and "pip install" in err


def test_an_unknown_report_to_service_exits_2(in_tmp, capsys):
    code, err = cli(["train", recipe(in_tmp), "--report-to", "wandbb"], capsys)
    assert code == 2
    assert "--report-to: unknown service 'wandbb' (did you mean `wandb`?)" in err
    assert "allowed: " in err and "tensorboard" in err


# -- output_dir ---------------------------------------------------------------------------------

def test_output_dir_may_not_climb_out_of_the_working_directory(in_tmp, no_plan, capsys):
    outside = os.path.normpath(in_tmp / ".." / "elsewhere")
    code, err = cli(["train", recipe(in_tmp, output_dir="../elsewhere")], capsys)
    assert code == 2
    assert ("r.yaml: output_dir: `../elsewhere` resolves to " + outside) in err
    assert f"outside the working directory {in_tmp}" in err
    assert f"give the absolute path ({outside})" in err
    code, err = cli(["train", recipe(in_tmp), "--output-dir", "sub/../../elsewhere"], capsys)
    assert code == 2 and "--output-dir: `sub/../../elsewhere` resolves to" in err
    assert not Path(outside).exists()
    # inside, and an absolute path anywhere, are allowed
    r = load_recipe(recipe(in_tmp))
    assert check_run_writes(r, output_dir="runs/../runs/a")["output_dir"] == "runs/../runs/a"
    assert check_run_writes(r, output_dir=outside)["output_dir"] == outside


def test_a_non_empty_output_dir_needs_overwrite(in_tmp, no_plan, capsys):
    other = in_tmp / "other_model"
    other.mkdir()
    (other / "config.json").write_text('{"model_type": "bert"}')
    (other / "model.safetensors").write_bytes(b"x")
    code, err = cli(["train", recipe(in_tmp), "--output-dir", "other_model"], capsys)
    assert code == 2
    assert ("--output-dir: `other_model` is not empty: it holds config.json, "
            "model.safetensors;") in err
    assert "Pass --overwrite" in err and "choose a new or empty directory" in err
    assert (other / "config.json").read_text() == '{"model_type": "bert"}'   # untouched
    r = load_recipe(recipe(in_tmp))
    assert check_run_writes(r, output_dir="other_model", overwrite=True)["output_dir"] == \
        "other_model"
    (in_tmp / "empty").mkdir()
    assert check_run_writes(r, output_dir="empty")["output_dir"] == "empty"


def test_an_unwritable_output_dir_exits_2_before_the_plan(in_tmp, no_plan, capsys):
    (in_tmp / "a_file").write_text("x")
    code, err = cli(["train", recipe(in_tmp), "--output-dir", "a_file/run"], capsys)
    assert code == 2 and "Traceback" not in err
    assert "cannot write to `a_file/run`" in err and "a_file is a file, not a directory" in err
    code, err = cli(["train", recipe(in_tmp), "--output-dir", "a_file"], capsys)
    assert code == 2 and "`a_file` is a file, not a directory" in err
    if os.geteuid() == 0:      # root writes through permissions: a folder no one can write to
        locked = "/proc/hf_memkit_out"
    else:
        (in_tmp / "locked").mkdir(mode=0o500)
        locked = str(in_tmp / "locked" / "run")
    code, err = cli(["train", recipe(in_tmp), "--output-dir", locked], capsys)
    assert code == 2 and "Traceback" not in err
    assert f"cannot write to `{locked}`" in err and "choose a directory you can write to" in err


def test_a_recipes_absolute_output_dir_needs_the_users_flag(in_tmp, no_plan, capsys):
    target = in_tmp / "elsewhere" / "run"
    code, err = cli(["train", recipe(in_tmp, output_dir=str(target))], capsys)
    assert code == 2 and "Traceback" not in err
    assert f"r.yaml: output_dir: `{target}` is an absolute path; a recipe is a shared file" in err
    assert f"--output-dir {target}" in err
    assert not target.parent.exists()                    # nothing created
    code, err = cli(["train", recipe(in_tmp, output_dir="~/.config/autostart/x")], capsys)
    assert code == 2 and "`~/.config/autostart/x` is an absolute path" in err
    # the user's own flag (or argument) names it: allowed
    r = load_recipe(recipe(in_tmp, output_dir=str(target)))
    assert check_run_writes(r, output_dir=str(target))["output_dir"] == str(target)


def test_a_symlinked_output_dir_is_resolved_before_the_check(in_tmp, no_plan, capsys):
    outside = in_tmp.parent / f"{in_tmp.name}_outside"
    outside.mkdir()
    (in_tmp / "runs").symlink_to(outside, target_is_directory=True)
    for in_recipe, flag in (("runs/a", []), (None, ["--output-dir", "runs/a"])):
        code, err = cli(["train", recipe(in_tmp, output_dir=in_recipe), *flag], capsys)
        assert code == 2 and "Traceback" not in err
        assert f"`runs/a` resolves through a symbolic link to {outside / 'a'}" in err
        assert f"give the absolute path ({outside / 'a'})" in err
    assert list(outside.iterdir()) == []
    # a link that stays inside the working directory is fine
    (in_tmp / "real").mkdir()
    (in_tmp / "inside").symlink_to(in_tmp / "real", target_is_directory=True)
    assert check_run_writes(load_recipe(recipe(in_tmp, output_dir="inside/a")))["output_dir"] \
        == "inside/a"
