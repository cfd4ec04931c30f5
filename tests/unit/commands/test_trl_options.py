"""TRL trainers on the command line and in recipes: ``hf-memkit estimate|plan --trainer sft``,
FIELD=VALUE typed by SFTConfig, lengths files, and the recipe ``trainer:`` key. ``hf-memkit train``
of ``trainer: sft`` / ``dpo`` recipes through the real TRL trainers (checked against their measured
peaks) is in tests/integration/test_train_trl_recipes.py."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from tests.helpers import require

require("trl")

from transformers import LlamaConfig  # noqa: E402

import hf_memkit as mk  # noqa: E402
from hf_memkit._errors import ConfigError  # noqa: E402
from hf_memkit._recipe import load_recipe  # noqa: E402
from hf_memkit.commands.main import main  # noqa: E402
from tests.helpers import TEST_RECIPES  # noqa: E402, require

SFT_RECIPE = TEST_RECIPES / "9m_sft_cpu.yaml"
DPO_RECIPE = TEST_RECIPES / "9m_dpo_cpu.yaml"
FP32 = ["bf16=false", "gradient_checkpointing=false"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    """A local model directory holding only a tiny Llama's config.json (as test_sft_and_dpo's)."""
    d = tmp_path_factory.mktemp("tiny_llama")
    LlamaConfig(hidden_size=128, intermediate_size=344, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, vocab_size=32000,
                tie_word_embeddings=False).save_pretrained(d)
    return str(d)


def _api(*args, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return mk.estimate_memory(*args, **kw)


def _json(capsys) -> dict:
    return json.loads(capsys.readouterr().out)


def test_estimate_trainer_sft_matches_the_api_and_differs_from_the_plain_trainer(model_dir,
                                                                                 capsys):
    # no --seq-len: max_length=256 gives it; packing=no is typed by SFTConfig (a bool field)
    assert main(["estimate", model_dir, "--gpu", "cpu", "--trainer", "sft", "--batch", "2",
                 "max_length=256", "packing=no", *FP32, "--json"]) == 0
    sft = _json(capsys)
    api = _api(model_dir, dict(per_device_train_batch_size=2, per_device_eval_batch_size=2,
                               max_length=256, packing=False, bf16=False,
                               gradient_checkpointing=False), device="cpu", trainer="sft")
    assert sft["trainer"] == "sft" and sft["setup"]["trainer"]["name"] == "sft"
    assert sft["seq_len"] == 256
    assert sft["peak_allocated"] == api.peak_allocated
    assert sft["device_used"] == api.device_used
    assert sft["setup"]["trainer"]["options"]["max_length"] == 256
    # the same step through transformers.Trainer: the model's logits and loss, not TRL's fused
    # head with its fp32 [tokens x 32768] CPU tiles (integration/test_trl_measured.py: the real
    # SFTTrainer run is the larger one), so the two estimates differ
    assert main(["estimate", model_dir, "--gpu", "cpu", "--seq-len", "256", "--batch", "2",
                 *FP32, "--json"]) == 0
    plain = _json(capsys)
    assert plain["trainer"] == "trainer"
    assert sft["peak_allocated"] > 1.2 * plain["peak_allocated"]


def test_plan_trainer_sft_matches_the_api(model_dir, capsys):
    assert main(["plan", model_dir, "--gpu", "cpu", "--seq-len", "128", "--target-batch", "4",
                 "--trainer", "sft", "packing=true", "--json"]) == 0
    out = _json(capsys)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        api = mk.plan_training(model_dir, seq_len=128, target_batch_size=4, device="cpu",
                               trainer="sft", packing=True)
    assert out["trainer"] == "sft"
    assert out["training_args_kwargs"] == api.training_args_kwargs
    assert out["training_args_kwargs"]["packing"] is True
    assert out["training_args_kwargs"]["max_length"] == 128        # seq_len, not pinned
    assert out["chosen"]["memory"]["device_used"] == api.chosen.device_used
    # the SFTConfig the plan builds is what TRL's own class accepts
    import trl

    assert isinstance(api.to_training_args(output_dir="unused", use_cpu=True), trl.SFTConfig)


@pytest.mark.parametrize("argv, says", [
    (["--trainer", "orpo", "--seq-len", "64"], ["ORPOTrainer", "not modelled"]),
    (["--trainer", "sfy", "--seq-len", "64"], ["`sfy`", "`sft`", "trainer, sft, dpo"]),
    (["--trainer", "sft", "max_length=abc"], ["max_length=abc", "an integer", "'abc'"]),
    (["--trainer", "sft", "--seq-len", "64", "packing=maybe"], ["packing=maybe", "a boolean"]),
    (["--trainer", "sft", "--seq-len", "64", "max_length=0"], ["max_length=0", "positive"]),
    (["--trainer", "sft", "--seq-len", "64", "packin=true"],
     ["`packin` is not a SFTConfig field", "`packing`"]),
    (["--trainer", "sft"], ["--seq-len is required", "max_length=N"]),
])
def test_bad_trainer_or_sft_field_exits_2_naming_it(model_dir, capsys, argv, says):
    assert main(["estimate", model_dir, "--gpu", "cpu", *argv]) == 2
    err = capsys.readouterr().err
    for s in says:
        assert s in err, (s, err)


def test_plan_bad_sft_field_exits_2(model_dir, capsys):
    assert main(["plan", model_dir, "--gpu", "cpu", "--seq-len", "64", "--target-batch", "4",
                 "--trainer", "sft", "padding_free=sometimes"]) == 2
    assert "padding_free=sometimes" in capsys.readouterr().err


def test_plan_from_a_lengths_file_matches_the_api(model_dir, capsys, tmp_path):
    lengths = [30] * 60 + [200, 220]
    f = tmp_path / "lengths.txt"
    f.write_text("# token counts of the rows\n" + "\n".join(map(str, lengths)) + "\n")
    argv = ["plan", model_dir, "--gpu", "cpu", "--target-batch", "8", "--trainer", "sft",
            *FP32, "--json"]
    assert main([*argv, "--lengths", str(f)]) == 0
    out = _json(capsys)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        api = mk.plan_training(model_dir, target_batch_size=8, device="cpu", trainer="sft",
                               lengths=lengths, bf16=False, gradient_checkpointing=False)
    assert out["training_args_kwargs"] == api.training_args_kwargs
    assert out["chosen"]["memory"]["device_used"] == api.chosen.device_used
    # a JSON list reads the same
    f.write_text(json.dumps(lengths))
    assert main([*argv, "--lengths", str(f)]) == 0
    assert _json(capsys)["training_args_kwargs"] == api.training_args_kwargs
    # and the summary form
    assert main([*argv, "--mean-len", "35.5", "--max-len", "220"]) == 0
    assert _json(capsys)["trainer"] == "sft"


@pytest.mark.parametrize("content, extra, says", [
    ("12\nabc\n", [], ["line 2", "'abc' is not an integer"]),
    ("[1, 2", [], ["not a JSON list"]),
    ("12\n0\n", [], ["positive integers", "[0]"]),
    (None, [], ["cannot read it"]),
    ("12\n", ["--seq-len", "64"], ["leave seq_len out"]),
])
def test_plan_bad_lengths_exit_2_naming_them(model_dir, capsys, tmp_path, content, extra, says):
    f = tmp_path / "lengths.txt"
    if content is not None:
        f.write_text(content)
    assert main(["plan", model_dir, "--gpu", "cpu", "--target-batch", "4", "--trainer", "sft",
                 "--lengths", str(f), *extra]) == 2
    err = capsys.readouterr().err
    for s in says:
        assert s in err, (s, err)


def test_estimate_from_a_lengths_file_matches_the_api(model_dir, capsys, tmp_path):
    lengths = [30] * 10 + [200, 90, 60]
    f = tmp_path / "lengths.txt"
    f.write_text("\n".join(map(str, lengths)))
    argv = ["estimate", model_dir, "--gpu", "cpu", "--batch", "4", "--lengths", str(f), *FP32,
            "--json"]
    # padding-free SFT: the fullest micro-batch of these rows (not 4 x the longest); without
    # packing TRL takes the rows as they are (max_length=none)
    assert main([*argv, "--trainer", "sft", "padding_free=true", "max_length=none"]) == 0
    pf = _json(capsys)
    api = _api(model_dir, dict(per_device_train_batch_size=4, per_device_eval_batch_size=4,
                               padding_free=True, max_length=None, bf16=False,
                               gradient_checkpointing=False),
               device="cpu", trainer="sft", lengths=lengths)
    assert pf["peak_allocated"] == api.peak_allocated
    # the plain Trainer pads: the longest row
    assert main(argv) == 0
    padded = _json(capsys)
    assert padded["seq_len"] == 200
    assert padded["peak_allocated"] == _api(
        model_dir, dict(per_device_train_batch_size=4, per_device_eval_batch_size=4,
                        bf16=False, gradient_checkpointing=False),
        device="cpu", seq_len=200).peak_allocated
    assert pf["peak_allocated"] < _api(model_dir, dict(
        per_device_train_batch_size=4, per_device_eval_batch_size=4, bf16=False,
        gradient_checkpointing=False), device="cpu", seq_len=200, trainer="sft").peak_allocated


def test_estimate_bad_lengths_exit_2(model_dir, capsys, tmp_path):
    f = tmp_path / "lengths.txt"
    f.write_text("")
    assert main(["estimate", model_dir, "--gpu", "cpu", "--lengths", str(f)]) == 2
    assert "an empty list" in capsys.readouterr().err
    f.write_text("12\n40\n")
    assert main(["estimate", model_dir, "--gpu", "cpu", "--lengths", str(f), "--max-batch"]) == 2
    assert "give --seq-len instead" in capsys.readouterr().err


def test_plan_lengths_need_the_sft_trainer(model_dir, capsys):
    assert main(["plan", model_dir, "--gpu", "cpu", "--target-batch", "4",
                 "--mean-len", "40", "--max-len", "90"]) == 2
    assert "trainer='sft'" in capsys.readouterr().err
    assert main(["plan", model_dir, "--gpu", "cpu", "--target-batch", "4", "--trainer", "sft"]) == 2
    assert "--lengths FILE or --mean-len/--max-len" in capsys.readouterr().err


def test_trainer_sft_without_trl_says_how_to_install(model_dir):
    code = ("import sys; sys.modules['trl'] = None\n"   # as if TRL were not installed
            "from hf_memkit.commands.main import main\n"
            f"sys.exit(main(['estimate', {model_dir!r}, '--gpu', 'cpu', '--trainer', 'sft', "
            "'--seq-len', '64']))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 2, proc.stderr
    assert "pip install 'hf-memkit[trl]'" in proc.stderr


# ----------------------------------------------------------------------------------------------
# recipes: the trainer key
# ----------------------------------------------------------------------------------------------


def _recipe(tmp_path: Path, trainer: str, pins: str) -> Path:
    text = SFT_RECIPE.read_text()
    head = text.split("trainer: sft")[0]
    p = tmp_path / "r.yaml"
    p.write_text(f"{head}trainer: {trainer}\npins: {pins}\n")
    return p


def test_recipe_trainer_key_is_validated_and_reaches_the_plan(tmp_path):
    r = load_recipe(_recipe(tmp_path, "sft", "{packing: yes, max_length: 48, max_steps: 2}"))
    assert r.trainer == "sft" and r.pins == {"packing": True, "max_length": 48, "max_steps": 2}
    kw = r.plan_kwargs()
    assert kw["trainer"] == "sft" and kw["packing"] is True
    assert load_recipe(_recipe(tmp_path, "trainer", "{}")).trainer == "trainer"
    with pytest.raises(ConfigError) as exc:
        load_recipe(_recipe(tmp_path, "sfy", "{max_steps: 2}"))
    msg = str(exc.value)
    assert "trainer: unknown trainer 'sfy'" in msg and "(did you mean `sft`?)" in msg
    assert "allowed: trainer (Trainer), sft (SFTTrainer), dpo (DPOTrainer)" in msg
    with pytest.raises(ConfigError, match="ORPOTrainer"):
        load_recipe(_recipe(tmp_path, "orpo", "{max_steps: 2}"))
    with pytest.raises(ConfigError) as exc:   # SFTConfig's types and names
        load_recipe(_recipe(tmp_path, "sft", "{packing: maybe, max_lenght: 64}"))
    msg = str(exc.value)
    assert "pins.packing: `packing` expects a boolean" in msg
    assert "pins.max_lenght: not a SFTConfig field (did you mean `max_length`?)" in msg
    with pytest.raises(ConfigError, match="pins.packing: not a TrainingArguments field"):
        load_recipe(_recipe(tmp_path, "trainer", "{packing: true}"))


def test_dpo_recipe_with_file_data_is_planned_but_not_trained(tmp_path, capsys):
    from hf_memkit._trainers.data import word_tokenizer

    word_tokenizer(32000).save_pretrained(tmp_path / "tok")
    (tmp_path / "pairs.jsonl").write_text(json.dumps({"text": "w5 w6 w7"}) + "\n")
    text = DPO_RECIPE.read_text().replace(
        "  source: synthetic ", "  source: pairs.jsonl\n#").replace(
        "  name: Llama-3.2-1B", "  name: Llama-3.2-1B\n  tokenizer: tok")
    p = tmp_path / "dpo_file.yaml"
    p.write_text(text)
    assert main(["plan", str(p), "--json"]) == 0
    assert _json(capsys)["trainer"] == "dpo"
    assert main(["train", str(p), "--output-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "data.source: `hf-memkit train` makes DPO's preference pairs" in err
    assert "only for data: synthetic" in err
    assert not (tmp_path / "out").exists()

def test_trainer_help_names_every_registered_trainer(capsys):
    """The help text is written out (importing the registry would import torch for --help)."""
    from hf_memkit._trainers import TRAINERS

    for cmd in ("estimate", "plan"):
        with pytest.raises(SystemExit):
            main([cmd, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert "--trainer sft" in text                        # the epilog's example
        for kind in TRAINERS:
            assert f"{kind.name} (" in text and kind.title in text, (cmd, kind.name)
