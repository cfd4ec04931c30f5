"""``hf-memkit plan --write-config DIR`` and ``--engine`` by the names accelerate and DeepSpeed
use: the files are what accelerate and DeepSpeed read (checked by their own classes), the
launch line names them, and the engine asked for by stage is the one planned."""

from __future__ import annotations

import json
import py_compile
import re

import pytest

from tests.unit.commands.test_bad_input import run_cli as run

BASE = ["Llama-3.2-1B", "--gpu", "A100-80GB", "--num-gpus", "2", "--seq-len", "1024",
        "--target-batch", "16"]


def test_zero3_by_name_writes_what_accelerate_and_deepspeed_read(tmp_path, capsys):
    from accelerate.commands.config.config_args import ClusterConfig
    from deepspeed.runtime.config import DeepSpeedConfig

    folder = tmp_path / "run"
    code, out, err = run(["plan", *BASE, "--engine", "zero3", "--write-config", str(folder),
                          "--json"], capsys)
    assert code == 0, err
    # (DeepSpeed's import may log a line to this test's captured stdout; the CLI's goes to stderr)
    doc = json.loads(out[out.index("{\n"):])
    assert doc["chosen"]["label"].startswith("ZeRO-3")
    written = doc["written"]
    cfg = ClusterConfig.from_yaml_file(written["accelerate_config"])
    assert cfg.distributed_type == "DEEPSPEED" and cfg.num_processes == 2
    assert cfg.deepspeed_config["deepspeed_config_file"] == written["deepspeed_config"]
    ds = json.loads((folder / "ds_config.json").read_text())
    assert ds["zero_optimization"]["stage"] == 3
    # DeepSpeed's own class, at the world size it sees outside a launch (1): one rank's batch
    check = dict(ds, train_batch_size=ds["train_micro_batch_size_per_gpu"]
                 * ds["gradient_accumulation_steps"])
    assert DeepSpeedConfig(check).zero_optimization_stage == 3
    assert written["launch"] == (f"accelerate launch --config_file {folder}/accelerate_config.yaml"
                                 f" {folder}/train.py")
    py_compile.compile(written["script"], doraise=True)
    script = (folder / "train.py").read_text()
    assert '"plan.json"' in script and "meta-llama/Llama-3.2-1B" in script
    import hf_memkit as mk

    plan = mk.Plan.from_json((folder / "plan.json").read_text())
    assert plan.parallel["engine"] == "deepspeed" and "ZeRO-3" in plan.chosen.label()


def test_fsdp_shard_grad_op_by_name_and_the_text_shows_fsdp_config(tmp_path, capsys):
    from accelerate.commands.config.config_args import ClusterConfig

    folder = tmp_path / "fsdp"
    code, out, err = run(["plan", *BASE, "--engine", "fsdp-shard-grad-op", "--write-config",
                          str(folder)], capsys)
    assert code == 0, err
    cfg = ClusterConfig.from_yaml_file(str(folder / "accelerate_config.yaml"))
    assert cfg.distributed_type == "FSDP"
    assert cfg.fsdp_config["fsdp_reshard_after_forward"] is False   # SHARD_GRAD_OP in FSDP2
    assert not (folder / "ds_config.json").exists()
    text = " ".join(out.split())
    assert "fsdp_config" in text and '"reshard_after_forward": false' in text
    joined = re.sub(r"[│\s]", "", out)   # the table wraps a long path over its rows
    assert f"--config_file{folder}/accelerate_config.yaml{folder}/train.py" in joined


def test_a_folder_holding_the_files_is_refused_before_the_search(tmp_path, capsys):
    (tmp_path / "plan.json").write_text("{}")
    code, _, err = run(["plan", *BASE, "--write-config", str(tmp_path)], capsys)
    assert code == 2 and "--overwrite" in err and "plan.json" in err
    assert (tmp_path / "plan.json").read_text() == "{}"
    code, _, err = run(["plan", *BASE, "--overwrite"], capsys)
    assert code == 2 and "--write-config" in err


def test_an_unknown_engine_lists_the_names(capsys):
    code, _, err = run(["plan", *BASE, "--engine", "zero4"], capsys)
    assert code == 2
    for name in ("ddp", "fsdp-full-shard", "fsdp-shard-grad-op", "fsdp-offload", "zero2", "zero3",
                 "zero3-offload"):
        assert name in err


@pytest.mark.parametrize(("engine", "label"), [("zero2", "ZeRO-2"),
                                               ("fsdp-full-shard", "FSDP2 full shard")])
def test_plan_training_takes_a_stage_by_name(engine, label):
    import hf_memkit as mk

    plan = mk.plan_training("Llama-3.2-1B", seq_len=1024, target_batch_size=16,
                            device="A100-80GB", num_gpus=2, engine=engine)
    assert plan.chosen.label().startswith(label)


@pytest.mark.parametrize("engine", ["zero3-offload", "fsdp-offload"])
def test_offload_by_name_writes_the_offload_accelerate_and_deepspeed_read(engine, tmp_path,
                                                                          capsys):
    # Llama-3.2-1B fits two A100s without offload: the plan offloads only because it was asked
    from accelerate.commands.config.config_args import ClusterConfig
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    folder = tmp_path / engine
    code, out, err = run(["plan", *BASE, "--engine", engine, "--write-config", str(folder),
                          "--json"], capsys)
    assert code == 0, err
    doc = json.loads(out[out.index("{\n"):])
    assert "offload" in doc["chosen"]["label"] and doc["chosen"]["method"] == "full"
    # no setup without offload was asked for: none "failed" to fit, nothing fell back to LoRA
    assert not any("LoRA family" in n for n in doc["notes"])
    cfg = ClusterConfig.from_yaml_file(str(folder / "accelerate_config.yaml"))
    if engine == "fsdp-offload":
        assert cfg.distributed_type == "FSDP" and cfg.fsdp_config["fsdp_offload_params"] is True
        assert not (folder / "ds_config.json").exists()
        return
    assert cfg.distributed_type == "DEEPSPEED"
    zero = DeepSpeedZeroConfig(**json.loads((folder / "ds_config.json").read_text())
                               ["zero_optimization"])
    assert zero.stage == 3 and zero.offload_optimizer.device == "cpu"
