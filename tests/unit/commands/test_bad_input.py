"""Bad input, as a user meets it: every case is refused with exit code 2 (CLI) or an
``HfMemkitError`` / ``ConfigError`` (API, recipes) whose message names the bad value and what is
allowed. Nothing runs a model directory's own code, and no YAML trick makes validation slow."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
from transformers import LlamaConfig

import hf_memkit as mk
from hf_memkit._recipe import load_recipe
from hf_memkit.commands.main import main

TINY_RECIPE = "recipes/tiny-llama/1m_full_cpu.yaml"
RECIPE_HEAD = ("model: Llama-3.2-1B\ntraining: {seq_len: 64, target_batch_size: 8}\n"
               "hardware: {device: cpu}\n")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    """A small Llama's config.json (estimates of it take a moment)."""
    d = tmp_path_factory.mktemp("tiny")
    LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=1, vocab_size=128,
                max_position_embeddings=256).save_pretrained(d)
    return d


# bad config.json files: (name, file bytes, what the message must contain)
BAD_CONFIGS = {
    "malformed": (b'{"model_type": "llama",', ["not valid JSON", "line 1", "model_type"]),
    "empty": (b"", ["is empty", "JSON object"]),
    "non_utf8": (b'{"model_type": "llama", "x": "\xff\xfe"}', ["not UTF-8", "0xff"]),
    "a_list": (b"[1, 2]", ["JSON list", "JSON object"]),
    "no_model_type": (b'{"hidden_size": 8}', ["no `model_type`", "llama"]),
    "unknown_type": (b'{"model_type": "lama"}', ["`lama`", "did you mean `llama`"]),
    "bad_field": (b'{"model_type": "llama", "hidden_size": "abc"}', ["hidden_size", "'abc'"]),
    "zero_heads": (b'{"model_type": "llama", "hidden_size": 64, "num_attention_heads": 0}',
                   ["num_attention_heads=0 is not a size", "positive integer"]),
    "nested_deep": (b'{"model_type": "llama", "x": ' + b"[" * 100000 + b"]" * 100000 + b"}",
                    ["nests too deep to read", "config.json"]),
}


@pytest.fixture(scope="module")
def bad_configs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("badcfg")
    out = {}
    for name, (data, _) in BAD_CONFIGS.items():
        (root / name).mkdir()
        (root / name / "config.json").write_bytes(data)
        out[name] = root / name
    return out


def remote_code_dir(root: Path) -> tuple[Path, Path]:
    """A model directory whose config needs its own Python (``auto_map``, a model type
    transformers does not ship); the code would create ``marker`` if it ever ran."""
    d, marker = root / "custom_model", root / "code_ran"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({
        "model_type": "evil-llama", "hidden_size": 8,
        "auto_map": {"AutoConfig": "configuration_evil.EvilConfig",
                     "AutoModelForCausalLM": "modeling_evil.EvilModel"}}))
    code = (f"open({str(marker)!r}, 'w').write('ran')\n"
            "from transformers import PretrainedConfig\n"
            "class EvilConfig(PretrainedConfig):\n    model_type = 'evil-llama'\n")
    (d / "configuration_evil.py").write_text(code)
    (d / "modeling_evil.py").write_text(code)
    return d, marker


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    """``hf-memkit ARGV`` in this process: (exit code, stdout, stderr). argparse's own errors
    exit through SystemExit; both count."""
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


def cli(argv: list[str], capsys) -> tuple[int, str]:
    """``run_cli`` without stdout: (exit code, stderr)."""
    code, _, err = run_cli(argv, capsys)
    return code, err


# ----------------------------------------------------------------------------------------------
# API: each call raises HfMemkitError naming the value and what is allowed
# ----------------------------------------------------------------------------------------------

def _est(args=None, **kw):
    return lambda d: mk.estimate_memory(d, args, seq_len=8, device="cpu", **kw)


API_CASES = {
    # TrainingArguments fields by type and range (dict args)
    "bf16 maybe": (_est({"bf16": "maybe"}), ["'maybe'", "True or False"]),
    "bf16 2": (_est({"bf16": 2}), ["got 2", "a boolean"]),
    "learning_rate abc": (_est({"learning_rate": "abc"}), ["'abc'", "a number"]),
    "learning_rate nan": (_est({"learning_rate": float("nan")}), ["nan", "a number"]),
    "learning_rate negative": (_est({"learning_rate": -1e-4}), ["-0.0001", ">= 0"]),
    "max_steps 0": (_est({"max_steps": 0}), ["got 0", "positive number of optimizer steps",
                                             "-1"]),
    "max_steps -5": (_est({"max_steps": -5}), ["-5", "or -1"]),
    "max_steps 1.5": (_est({"max_steps": 1.5}), ["1.5", "an integer"]),
    "warmup_steps -1": (_est({"warmup_steps": -1}), ["got -1", ">= 0"]),
    "micro-batch 0": (_est({"per_device_train_batch_size": 0}), ["got 0", "positive integer"]),
    "accumulation 2.5": (_est({"gradient_accumulation_steps": 2.5}), ["2.5", "an integer"]),
    "logging_steps 2.5": (_est({"logging_steps": 2.5}), ["2.5", "integer"]),
    "logging_steps 0": (_est({"logging_steps": 0}), ["got 0", "positive number of steps"]),
    "adam_beta1 1.5": (_est({"adam_beta1": 1.5}), ["1.5", "[0, 1)"]),
    "seed -1": (_est({"seed": -1}), ["got -1", "[0, 2**32)"]),
    "epochs 0": (_est({"num_train_epochs": 0}), ["got 0", "positive number of epochs"]),
    "workers -2": (_est({"dataloader_num_workers": -2}), ["-2", ">= 0"]),
    "empty cache steps 0": (_est({"torch_empty_cache_steps": 0}), ["got 0", "positive"]),
    # load dtype
    "dtype float17": (_est(dtype="float17"), ["'float17'", "bfloat16", "float32"]),
    "dtype 5": (_est(dtype=5), ["5", "float16", "'auto'"]),
    # reverse queries
    "max_seq_len multiple_of 0": (
        lambda d: mk.max_seq_len(d, device="cpu", multiple_of=0), ["multiple_of", "got 0",
                                                                  "positive integer"]),
    "max_seq_len limit < multiple_of": (
        lambda d: mk.max_seq_len(d, device="cpu", limit=32), ["limit 32", "limit >= 64"]),
    "max_batch_size limit 0": (
        lambda d: mk.max_batch_size(d, seq_len=8, device="cpu", limit=0), ["limit", "got 0",
                                                                           "positive integer"]),
    "max_batch_size seq_len 0": (
        lambda d: mk.max_batch_size(d, seq_len=0, device="cpu"), ["seq_len", "got 0"]),
    "max_batch_size headroom 2": (
        lambda d: mk.max_batch_size(d, seq_len=8, device="cpu", headroom=2), ["got 2",
                                                                              "[0, 1)"]),
    "max_batch_size headroom -0.1": (
        lambda d: mk.max_batch_size(d, seq_len=8, device="cpu", headroom=-0.1),
        ["-0.1", "fraction of device memory kept free"]),
    "max_batch_size max_memory lots": (
        lambda d: mk.max_batch_size(d, seq_len=8, device="cpu", max_memory="lots"),
        ["'lots'", "20GiB"]),
    "max_batch_size unknown model": (
        lambda d: mk.max_batch_size("Llama-9-1B", seq_len=8, device="cpu"),
        ["Llama-9-1B", "bundled configs"]),
    "max_batch_size bad field": (
        lambda d: mk.max_batch_size(d, {"bf16": "sometimes"}, seq_len=8, device="cpu"),
        ["'sometimes'", "True or False"]),
    # load_recipe of something that is not a path
    "load_recipe(5)": (lambda d: load_recipe(5), ["int 5", "path of a recipe .yaml"]),
    "load_recipe(None)": (lambda d: load_recipe(None), ["None", "bundled recipe"]),
}


@pytest.mark.parametrize("case", list(API_CASES))
def test_api_bad_input_names_value_and_allowed(case, tiny_dir):
    call, fragments = API_CASES[case]
    with pytest.raises(mk.HfMemkitError) as ei:
        call(str(tiny_dir))
    for f in fragments:
        assert f in str(ei.value), f"{case}: missing {f!r} in:\n{ei.value}"


@pytest.mark.parametrize("name", list(BAD_CONFIGS))
def test_bad_config_json_is_bad_input(name, bad_configs):
    _, fragments = BAD_CONFIGS[name]
    with pytest.raises(mk.HfMemkitError) as ei:
        mk.profile_model(str(bad_configs[name]))
    msg = str(ei.value)
    assert "config.json" in msg, msg
    for f in fragments:
        assert f in msg, f"{name}: missing {f!r} in:\n{msg}"


# ----------------------------------------------------------------------------------------------
# CLI: exit 2, the message on stderr names the value and what is allowed
# ----------------------------------------------------------------------------------------------

EST = ["estimate", "{tiny}", "--gpu", "cpu", "--seq-len", "8"]
CLI_CASES = {
    "bf16=maybe": (EST + ["bf16=maybe"], ["bf16=maybe", "true/false"]),
    "learning_rate=abc": (EST + ["learning_rate=abc"], ["'abc'", "a number"]),
    "max_steps=0": (EST + ["max_steps=0"], ["got 0", "-1"]),
    "fp16=2": (EST + ["fp16=2"], ["'2'", "1/0"]),
    "per_device_train_batch_size=x": (EST + ["per_device_train_batch_size=x"],
                                      ["'x'", "an integer"]),
    "field after an option": (["estimate", "{tiny}", "--gpu", "cpu", "bf16=nah", "--seq-len",
                               "8"], ["'nah'", "yes/no"]),
    "save_strategy=stpes": (EST + ["save_strategy=stpes"], ["'stpes'", "'epoch'"]),
    "no field name": (EST + ["=5"], ["`=5`", "FIELD=VALUE"]),
    "--dtype float17": (EST + ["--dtype", "float17"], ["'float17'", "bfloat16"]),
    "--headroom 2": (EST + ["--max-batch", "--headroom", "2"], ["`2`", "[0, 1)"]),
    "--headroom abc": (EST + ["--max-batch", "--headroom", "abc"], ["`abc`", "[0, 1)"]),
    "--seq-len 0": (["estimate", "{tiny}", "--gpu", "cpu", "--seq-len", "0"],
                    ["`0`", "positive integer"]),
    "--batch -1": (EST + ["--batch", "-1"], ["`-1`", "positive integer"]),
    "--num-gpus 0": (EST + ["--num-gpus", "0"], ["`0`", "positive integer"]),
    "--max-seq-len below 64": (EST + ["--max-seq-len"], ["limit 8", "limit >= 64"]),
    "--gpu unknown": (EST[:2] + ["--gpu", "A100-90GB", "--seq-len", "8"],
                      ["A100-90GB", "A100-80GB"]),
    "plan --target-batch 0": (["plan", "{tiny}", "--gpu", "cpu", "--seq-len", "8",
                               "--target-batch", "0"], ["`0`", "positive integer"]),
    "plan --headroom 1.5": (["plan", "{tiny}", "--gpu", "cpu", "--seq-len", "8",
                             "--target-batch", "8", "--headroom", "1.5"], ["`1.5`", "[0, 1)"]),
    "plan fp16=perhaps": (["plan", "{tiny}", "--gpu", "T4", "--seq-len", "8", "--target-batch",
                           "8", "fp16=perhaps"], ["'perhaps'", "true/false"]),
    "train bf16=nope": (["train", TINY_RECIPE, "bf16=nope"], ["'nope'", "true/false"]),
    "train learning_rate=fast": (["train", TINY_RECIPE, "learning_rate=fast"],
                                 ["'fast'", "a number"]),
    "train max_steps=-3": (["train", TINY_RECIPE, "max_steps=-3"], ["-3", "or -1"]),
    "train fp16 on a CPU recipe": (["train", TINY_RECIPE, "fp16=true"],
                                   ["pins.fp16", "fp16 mixed precision needs a GPU"]),
}


@pytest.mark.parametrize("case", list(CLI_CASES))
def test_cli_bad_input_exits_2(case, tiny_dir, capsys):
    argv, fragments = CLI_CASES[case]
    code, err = cli([a.replace("{tiny}", str(tiny_dir)) for a in argv], capsys)
    assert code == 2, err
    assert "Traceback" not in err
    for f in fragments:
        assert f in err, f"{case}: missing {f!r} in:\n{err}"


@pytest.mark.parametrize("name", ["malformed", "empty", "non_utf8", "no_model_type"])
def test_cli_bad_config_json_exits_2(name, bad_configs, capsys):
    code, err = cli(["estimate", str(bad_configs[name]), "--gpu", "cpu", "--seq-len", "8"],
                    capsys)
    assert code == 2 and "Traceback" not in err
    assert "config.json" in err and BAD_CONFIGS[name][1][0] in err


# ----------------------------------------------------------------------------------------------
# recipes: ConfigError with FILE: KEY: message
# ----------------------------------------------------------------------------------------------

def _bomb(levels: int = 9, width: int = 9) -> str:
    """Nested YAML aliases: `width ** levels` values from a few hundred bytes."""
    anchors = [f"&a0 [{', '.join(['lol'] * width)}]"] + [
        f"&a{i} [{', '.join([f'*a{i - 1}'] * width)}]" for i in range(1, levels)]
    return "[" + ", ".join(anchors) + "]"


RECIPE_CASES = {
    "pins.learning_rate abc": ("pins: {learning_rate: abc}",
                               "pins.learning_rate", ["'abc'", "a number"]),
    "pins.max_steps 0": ("pins: {max_steps: 0}", "pins.max_steps", ["got 0", "-1"]),
    "pins.max_steps -3": ("pins: {max_steps: -3}", "pins.max_steps", ["-3", "or -1"]),
    "pins.bf16 maybe": ("pins: {bf16: maybe}", "pins.bf16", ["'maybe'", "true/false"]),
    "pins.warmup_steps -1": ("pins: {warmup_steps: -1}", "pins.warmup_steps", ["-1", ">= 0"]),
    "pins.logging_steps 0": ("pins: {logging_steps: 0}", "pins.logging_steps",
                             ["got 0", "positive number of steps"]),
    "pins.seed -1": ("pins: {seed: -1}", "pins.seed", ["-1", "[0, 2**32)"]),
    "pins.adam_beta2 1.0": ("pins: {adam_beta2: 1.0}", "pins.adam_beta2", ["1.0", "[0, 1)"]),
    "pins.num_train_epochs 0": ("pins: {num_train_epochs: 0}", "pins.num_train_epochs",
                                ["got 0", "positive number of epochs"]),
    "pins.gradient_accumulation_steps 0": (
        "pins: {gradient_accumulation_steps: 0}", "pins.gradient_accumulation_steps",
        ["got 0", "positive integer"]),
    "pins.per_device_train_batch_size two": (
        "pins: {per_device_train_batch_size: two}", "pins.per_device_train_batch_size",
        ["'two'", "an integer"]),
    "pins.save_strategy unquoted no": ("pins: {save_strategy: no}", "pins.save_strategy",
                                       ["got False", "one of 'no', 'steps'", "quote it"]),
    "pins.lr_scheduler_type typo": ("pins: {lr_scheduler_type: cosin}", "pins.lr_scheduler_type",
                                    ["'cosin'", "did you mean `cosine`"]),
    "hardware.headroom 2": ("hardware: {device: cpu, headroom: 2}\n", "hardware.headroom",
                            ["got 2", "[0, 1)"]),
    "duplicate top-level key": ("model: gpt2", "line 4", ["duplicate key `model`", "line 1"]),
    "duplicate pin": ("pins:\n  max_steps: 10\n  max_steps: 20", "line 6",
                      ["duplicate key `max_steps`", "line 5"]),
    "duplicate key in a flow mapping": ("pins: {seed: 1, seed: 2}", "line 4",
                                        ["duplicate key `seed`", "first on line 4"]),
    "alias bomb under pins.label_names": (f"callbacks: {_bomb()}\npins: {{label_names: *a8}}",
                                          "", ["more than 10000 values", "write them out"]),
    "alias bomb under model.overrides": (
        f"model: {{name: Llama-3.2-1B, overrides: {{architectures: {_bomb()}}}}}", "",
        ["more than 10000 values", "alias"]),
    "too many aliases": ("pins: {label_names: [&x a, " + ", ".join(["*x"] * 150) + "]}", "",
                         ["more than 100 YAML aliases", "write the values out"]),
    "recursive alias": ("callbacks: &c [memory, *c]", "line 4",
                        ["alias to itself", "write the values out"]),
    "nested too deeply": ("pins: {label_names: " + "[" * 2000 + "]" * 2000 + "}", "",
                          ["nested too deeply", "plain keys"]),
    "training.seq_len 0": ("training: {seq_len: 0, target_batch_size: 8}",
                           "training.seq_len", ["got 0", "positive integer"]),
}


def _recipe(body: str, *, keep_head: bool = False) -> str:
    """``RECIPE_HEAD`` with ``body`` after it; a head section the body sets again is dropped
    unless ``keep_head`` (the cases about duplicate keys)."""
    head = [ln for ln in RECIPE_HEAD.splitlines(keepends=True)
            if keep_head or not body.startswith(ln.split(":")[0] + ":")]
    return "".join(head) + body + "\n"


@pytest.mark.parametrize("case", list(RECIPE_CASES))
def test_bad_recipe_names_value_and_allowed(case, tmp_path):
    body, key, fragments = RECIPE_CASES[case]
    p = tmp_path / "r.yaml"
    p.write_text(_recipe(body, keep_head=case.startswith("duplicate")))
    t0 = time.perf_counter()
    with pytest.raises(mk.ConfigError) as ei:
        load_recipe(p)
    assert time.perf_counter() - t0 < 20
    hit = [pr for pr in ei.value.problems if all(f in pr for f in fragments)]
    assert hit, f"{case}: {ei.value.problems}"
    assert hit[0].startswith(f"{p}: {key}"), hit[0]


@pytest.mark.parametrize("name", ["malformed", "empty", "no_model_type"])
def test_recipe_with_bad_config_json_names_model_name(name, bad_configs, tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text(f"model: {bad_configs[name]}\ntraining: {{seq_len: 8, target_batch_size: 8}}\n")
    with pytest.raises(mk.ConfigError) as ei:
        load_recipe(p)
    hit = [pr for pr in ei.value.problems if BAD_CONFIGS[name][1][0] in pr]
    assert hit and hit[0].startswith(f"{p}: model.name: "), ei.value.problems


def test_non_utf8_recipe_is_bad_input(tmp_path):
    p = tmp_path / "latin1.yaml"
    p.write_bytes(RECIPE_HEAD.encode() + b"# caf\xe9\n")
    with pytest.raises(mk.ConfigError) as ei:
        load_recipe(p)
    assert "line 4: not UTF-8 text (byte 0xe9" in str(ei.value)
    assert "save the file as UTF-8" in str(ei.value)


# ----------------------------------------------------------------------------------------------
# one test per issue item, as a user meets it
# ----------------------------------------------------------------------------------------------

def test_estimate_of_a_custom_code_model_never_runs_its_code(tmp_path, capsys):
    """Item 2: `hf-memkit estimate DIR` with `y` piped to stdin: exit 2, the code never ran."""
    d, marker = remote_code_dir(tmp_path)
    r = subprocess.run([sys.executable, "-m", "hf_memkit.commands.main", "estimate", str(d),
                        "--gpu", "cpu", "--seq-len", "8"],
                       input="y\ny\n", capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr
    assert "needs custom code" in r.stderr and "trust_remote_code=False" in r.stderr
    assert "build the model yourself" in r.stderr and "Traceback" not in r.stderr
    assert "Do you wish to run the custom code" not in r.stdout + r.stderr
    assert not marker.exists()
    code, err = cli(["plan", str(d), "--gpu", "cpu", "--seq-len", "8", "--target-batch", "8"],
                    capsys)
    assert code == 2 and "needs custom code" in err and not marker.exists()


def test_custom_code_model_in_api_and_recipe_is_refused(tmp_path):
    d, marker = remote_code_dir(tmp_path)
    with pytest.raises(mk.HfMemkitError, match="needs custom code"):
        mk.estimate_memory(str(d), None, seq_len=8, device="cpu")
    p = tmp_path / "r.yaml"
    p.write_text(f"model: {d}\ntraining: {{seq_len: 8, target_batch_size: 8}}\n")
    with pytest.raises(mk.ConfigError, match="model.name: .* needs custom code"):
        load_recipe(p)
    assert not marker.exists()


def test_bf16_false_on_the_command_line_turns_bf16_off(tiny_dir, capsys):
    """Item 3: `bf16=False` is False (it was the string "False", which is true)."""
    outs = {}
    for fields in ((), ("bf16=False",), ("bf16=FALSE", "fp16=no"), ("bf16=true",)):
        code = main(["estimate", str(tiny_dir), "--gpu", "A100-80GB", "--seq-len", "64",
                     "--batch", "2", "--json", *fields])
        assert code == 0
        outs[fields] = json.loads(capsys.readouterr().out)["peak_allocated"]
    assert outs[("bf16=False",)] == outs[()] == outs[("bf16=FALSE", "fp16=no")]
    assert outs[("bf16=true",)] != outs[()]
    # with bf16 off, fp16 is the only mixed precision: on a CPU recipe it is refused
    code, err = cli(["train", TINY_RECIPE, "bf16=False", "fp16=True"], capsys)
    assert code == 2 and "pins.fp16: fp16=True on a CPU: fp16 mixed precision needs a GPU" in err
    capsys.readouterr()
    assert main(["estimate", str(tiny_dir), "--gpu", "cpu", "--seq-len", "8", "--json",
                 "bf16=False", "fp16=True"]) == 0
    assert ("hf-memkit estimate: warning: fp16=True on a CPU: fp16 mixed precision needs a GPU"
            in capsys.readouterr().err)


def test_yaml_alias_bomb_is_refused_fast(tmp_path, capsys):
    """Item 4: a billion-laughs recipe under valid keys is refused in well under a second of
    YAML work (it took minutes and a MemoryError), and duplicate keys are refused."""
    bombs = []
    for i, body in enumerate([f"pins: {{label_names: {_bomb()}}}", f"callbacks: {_bomb()}",
                              f"model: {{name: Llama-3.2-1B, overrides: "
                              f"{{architectures: {_bomb()}}}}}"]):
        p = tmp_path / f"bomb{i}.yaml"
        p.write_text(RECIPE_HEAD.replace("model: Llama-3.2-1B\n", "") if i == 2 else
                     RECIPE_HEAD)
        p.write_text(p.read_text() + body + "\n")
        bombs.append(str(p))
    dup = tmp_path / "dup.yaml"
    dup.write_text(RECIPE_HEAD + "training: {seq_len: 128, target_batch_size: 8}\n")
    t0 = time.perf_counter()
    code, err = cli(["recipes", "validate", *bombs, str(dup)], capsys)
    assert time.perf_counter() - t0 < 30
    assert code == 2
    assert err.count("expands to more than 10000 values") == 3
    assert "line 4: duplicate key `training` (first on line 2)" in err


def test_recipes_validate_lists_every_files_problems(tmp_path, capsys):
    """Item 13: a non-UTF-8 recipe is one invalid row; the other files are still checked."""
    bad = tmp_path / "latin1.yaml"
    bad.write_bytes(RECIPE_HEAD.encode() + b"# r\xe9sum\xe9\n")
    worse = tmp_path / "worse.yaml"
    worse.write_text(RECIPE_HEAD + "pins: {learning_rate: abc}\n")
    code, out, err = run_cli(["recipes", "validate", str(bad), TINY_RECIPE, str(worse),
                              "--json"], capsys)
    assert code == 2 and "Traceback" not in err
    rows = {r["path"]: r["valid"] for r in json.loads(out)}
    assert rows == {str(bad): False, TINY_RECIPE: True, str(worse): False}
    assert f"{bad}: 1 problem(s)" in err and "not UTF-8" in err
    assert f"{worse}: 1 problem(s)" in err and "pins.learning_rate" in err
    assert TINY_RECIPE not in err  # the valid one is valid


def test_api_bad_input_that_used_to_crash(tiny_dir, bad_configs):
    """Item 13: exit 1 with a traceback before; now an HfMemkitError."""
    with pytest.raises(mk.HfMemkitError, match="multiple_of must be a positive integer"):
        mk.max_seq_len(str(tiny_dir), device="cpu", multiple_of=0)
    with pytest.raises(mk.ConfigError, match="load_recipe takes the path"):
        load_recipe(5)
    with pytest.raises(mk.HfMemkitError, match="is empty"):
        mk.estimate_memory(str(bad_configs["empty"]), None, seq_len=8, device="cpu")


def test_pins_are_checked_by_type_when_the_recipe_loads(tmp_path):
    """Item 14: `learning_rate: abc` is named at load time; `2e-4` (a YAML string) is a float."""
    p = tmp_path / "r.yaml"
    p.write_text(RECIPE_HEAD + "pins: {learning_rate: abc, max_steps: 0, bf16: 'False'}\n")
    with pytest.raises(mk.ConfigError) as ei:
        load_recipe(p)
    assert len(ei.value.problems) == 2
    p.write_text(RECIPE_HEAD + "pins: {learning_rate: 2e-4, bf16: 'no', max_steps: '10'}\n")
    r = load_recipe(p)
    assert r.pins == {"learning_rate": 2e-4, "bf16": False, "max_steps": 10}


def test_reverse_query_limits_and_headroom(tiny_dir, capsys):
    """Item 14: `--max-batch --headroom 2` printed 0 and `limit=0` returned 1; `headroom` is
    ignored beside `max_memory`, and says so."""
    code, err = cli(["estimate", str(tiny_dir), "--gpu", "T4", "--seq-len", "64", "--max-batch",
                     "--headroom", "2"], capsys)
    assert code == 2 and "fraction of device memory kept free, in [0, 1)" in err
    with pytest.raises(mk.HfMemkitError, match="limit must be a positive integer"):
        mk.max_batch_size(str(tiny_dir), seq_len=64, device="T4", limit=0)
    with pytest.warns(UserWarning, match="headroom=0.2 is ignored because max_memory"):
        n = mk.max_batch_size(str(tiny_dir), seq_len=64, device="T4", headroom=0.2,
                              max_memory="1GiB", limit=2)
    assert n >= 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mk.max_batch_size(str(tiny_dir), seq_len=64, device="T4", max_memory="1GiB", limit=2)
    code, err = cli(["plan", str(tiny_dir), "--gpu", "T4", "--seq-len", "64", "--target-batch",
                     "8", "--max-memory", "4GiB", "--headroom", "0.3", "--json"], capsys)
    assert code == 0 and "--headroom 0.3 is ignored: max_memory 4GiB is the whole budget" in err


def test_recipe_headroom_beside_max_memory_warns(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text("model: gpt2\ntraining: {seq_len: 64, target_batch_size: 8}\n"
                 "hardware: {device: T4, max_memory: 8GiB, headroom: 0.2}\n")
    with pytest.warns(UserWarning, match=r"hardware.headroom \(0.2\) is ignored: "
                                         r"hardware.max_memory \(8GiB\) is the whole budget"):
        load_recipe(p)


def test_dtype_outside_the_allowed_list_is_refused(tiny_dir, capsys):
    """Item 14: `--dtype float17` was ignored (the model's own dtype was used)."""
    code, err = cli(["estimate", str(tiny_dir), "--gpu", "cpu", "--seq-len", "8", "--dtype",
                     "float17"], capsys)
    assert code == 2 and "invalid choice: 'float17'" in err and "bfloat16" in err
    with pytest.raises(mk.HfMemkitError, match="dtype 'float17' is not a dtype weights can be "
                                               "loaded in .*allowed: float32, bfloat16, float16"):
        mk.estimate_memory(str(tiny_dir), None, seq_len=8, device="cpu", dtype="float17")


def test_estimate_warns_about_precision_the_device_lacks(tiny_dir):
    """Item 14: bf16 on a V100 (compute capability 7.0) and fp16 on a CPU are estimated, with a
    warning that the run cannot happen as asked."""
    with pytest.warns(UserWarning, match=r"bf16=True on V100-SXM2-16GB \(compute capability "
                                         r"7.0\): no bf16 tensor cores before compute "
                                         r"capability 8.0 .* the run starts"):
        mk.estimate_memory(str(tiny_dir), dict(bf16=True), seq_len=64, device="V100-16GB")
    with pytest.warns(UserWarning, match="fp16=True on a CPU"):
        mk.estimate_memory(str(tiny_dir), dict(fp16=True), seq_len=64, device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        mk.estimate_memory(str(tiny_dir), dict(bf16=True), seq_len=64, device="A100-80GB")
        mk.estimate_memory(str(tiny_dir), dict(fp16=True), seq_len=64, device="V100-16GB")
