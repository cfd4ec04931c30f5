"""The hf-memkit CLI root: devices, probe, estimate and plan against the API, help, bad input
(the demo's end-to-end slice, a real Trainer run, is in tests/integration/test_train_recipes.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import hf_memkit as mk
from hf_memkit.commands.main import main


def test_devices_json_lists_catalog(capsys):
    assert main(["devices", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in rows] == mk.list_devices()


def test_devices_table(capsys):
    assert main(["devices"]) == 0
    out = capsys.readouterr().out
    assert "A100-80GB" in out and "GiB" in out


def test_probe_json_is_this_machine(capsys):
    assert main(["probe", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert mk.DeviceInfo.from_dict(d).kind == mk.probe_device().kind


def test_no_command_prints_help_and_exits_2(capsys):
    assert main([]) == 2
    assert "COMMAND" in capsys.readouterr().out


def test_console_script_help_has_examples():
    out = subprocess.run([sys.executable, "-m", "hf_memkit.commands.main", "probe", "--help"],
                         capture_output=True, text=True, check=True).stdout
    assert "Examples:" in out


def test_estimate_command_matches_api(capsys):
    args = ["estimate", "gpt2", "--gpu", "A100-80GB", "--seq-len", "256", "--batch", "2",
            "bf16=true", "--json", "optim=adafactor"]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    api = mk.estimate_memory("gpt2", dict(per_device_train_batch_size=2,
                                          per_device_eval_batch_size=2, bf16=True,
                                          optim="adafactor"),
                             seq_len=256, device="A100-80GB")
    assert out["device_used"] == api.device_used
    assert out["setup"]["optim"] == "adafactor" and out["setup"]["amp"] == "bf16"


def test_estimate_bad_input_exits_2(capsys):
    assert main(["estimate", "gpt2", "--gpu", "A100-90GB", "--seq-len", "128"]) == 2
    assert "unknown GPU `A100-90GB`" in capsys.readouterr().err
    assert main(["estimate", "gpt2", "--seq-len", "128", "optim=adamw_fast"]) == 2
    assert "adamw_fast" in capsys.readouterr().err


def test_plan_command_json_matches_api(capsys):
    assert main(["plan", "gpt2", "--gpu", "T4", "--seq-len", "256", "--target-batch", "16",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    api = mk.plan_training("gpt2", seq_len=256, target_batch_size=16, device="T4")
    assert out["training_args_kwargs"] == api.training_args_kwargs
    chosen = next(c for c in out["candidates"] if c["chosen"])
    assert chosen["device_used"] == api.chosen.device_used


def test_plan_command_bad_target_exits_2(capsys):
    assert main(["plan", "gpt2", "--gpu", "T4", "--seq-len", "256", "--target-batch", "30",
                 "--num-gpus", "4"]) == 2
    assert "nearest valid targets: 28, 32" in capsys.readouterr().err


def test_estimate_reverse_query(capsys):
    assert main(["estimate", "gpt2", "--gpu", "T4", "--seq-len", "1024", "--max-batch",
                 "fp16=true", "--json"]) == 0
    n = json.loads(capsys.readouterr().out)["max_batch_size"]
    assert n == mk.max_batch_size("gpt2", dict(fp16=True), seq_len=1024, device="T4") and n > 0
