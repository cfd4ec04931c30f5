"""Recipes: every bundled recipe validates and plans offline (matching an independent
``estimate_memory``), bad recipes report every problem with the file and key, and the CLI exit
codes are 0 / 2. Training recipes for real (and a failed run's exit 1) is in
tests/integration/test_train_recipes.py."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import hf_memkit as mk
from hf_memkit._recipe import Recipe, bundled_recipes, bundled_recipes_dir, load_recipe
from hf_memkit._units import format_bytes
from hf_memkit.commands.main import main

BUNDLED = bundled_recipes()
TINY = "recipes/tiny-llama/1m_full_cpu.yaml"
NAME_RE = re.compile(r"^[a-z0-9.\-]+/[0-9.]+[mb]_(auto|full|lora|qlora)_[a-z0-9.\-]+\.yaml$")


def _rel(p: Path) -> str:
    return str(p.relative_to(bundled_recipes_dir()))


def write(tmp_path: Path, text: str, name: str = "r.yaml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


# ----------------------------------------------------------------------------------------------
# the bundled recipes
# ----------------------------------------------------------------------------------------------


def test_bundled_recipes_cover_the_issue():
    names = {_rel(p) for p in BUNDLED}
    assert {"bert-large-uncased/340m_full_v100-16gb.yaml", "llama-3.1/8b_qlora_rtx4090.yaml",
            "llama-3.1/8b_full_h100.yaml", "mistral/7b_lora_rtx4090.yaml",
            "llama-3.1/70b_auto_8xh100.yaml", "tiny-llama/1m_full_cpu.yaml"} <= names


@pytest.mark.parametrize("path", BUNDLED, ids=_rel)
def test_bundled_recipe_is_valid_and_self_documenting(path):
    r = load_recipe(path)
    rel = _rel(path)
    assert NAME_RE.match(rel), f"{rel} is not <model>/<size>_<method>_<hardware>.yaml"
    assert rel.split("_")[1] == r.method          # the file name tells the method
    lines = path.read_text().splitlines()
    assert lines[0].startswith("#")
    runs = [ln for ln in lines[:4] if re.search(r"(hf-memkit|main) train recipes/" + re.escape(rel), ln)]
    assert runs, f"{rel} must start with the exact command that runs it"
    for key in ("seq_len:", "target_batch_size:", "method:", "device:"):
        line = next(ln for ln in lines if ln.strip().startswith(key))
        assert "#" in line, f"{rel}: `{key}` needs a comment with its memory effect"


def test_recipes_validate_cli_finds_every_bundled_recipe(capsys):
    assert main(["recipes", "validate", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert sorted(r["path"] for r in rows) == sorted("recipes/" + _rel(p) for p in BUNDLED)
    assert all(r["valid"] for r in rows)


def test_bundled_recipe_found_from_any_directory(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert load_recipe(TINY).seq_len == 64
    assert load_recipe("llama-3.1/8b_qlora_rtx4090").method == "qlora"
    assert main(["recipes", "list", "--json"]) == 0
    listed = {r["recipe"] for r in json.loads(capsys.readouterr().out)}
    assert TINY in listed


def _memory_args(ta: dict) -> dict:
    keep = {"per_device_train_batch_size", "per_device_eval_batch_size",
            "gradient_accumulation_steps", "bf16", "fp16", "tf32", "optim", "optim_args",
            "activation_checkpointing", "activation_checkpointing_kwargs",
            "gradient_checkpointing", "gradient_checkpointing_kwargs", "max_grad_norm",
            "eval_accumulation_steps", "fsdp", "fsdp_config", "deepspeed", "accelerator_config"}
    return {k: v for k, v in ta.items() if k in keep}


def _plan_params():
    for p in BUNDLED:
        yield pytest.param(p, id=_rel(p))


@pytest.mark.parametrize("path", list(_plan_params()))
def test_plan_of_bundled_recipe_matches_independent_estimate(path, capsys, monkeypatch):
    """`hf-memkit plan RECIPE --json` for the recipe's hardware, offline from bundled configs;
    its chosen setup's memory equals estimate_memory called on its own with the plan's
    training args, model kwargs and LoRA config, in the plan's environment (`Plan.env`)."""
    assert main(["plan", str(path), "--json"]) == 0
    plan = mk.Plan.from_json(capsys.readouterr().out)
    r = load_recipe(path)
    assert plan.device.name == (r.device if r.device != "cpu" else mk.probe_device().name)
    assert plan.target_batch_size == r.target_batch_size and plan.seq_len == r.seq_len
    c = plan.chosen
    assert c.micro_batch * c.grad_accum * plan.num_gpus == r.target_batch_size
    if r.method != "auto":
        assert c.method.startswith(r.method) or (r.method == "lora" and c.method == "lora-8bit")
    for k, v in plan.env.items():   # what the plan's launch lines set
        monkeypatch.setenv(k, v)
    extra = {"num_gpus": plan.num_gpus}
    mkw = plan.model_kwargs
    quant = mkw.get("quantization_config")
    # A quantized base loads in half precision, then Plan.prepare's
    # prepare_model_for_kbit_training upcasts every non-quantized parameter to fp32: the
    # estimate takes the trained dtype (None = fp32), not the load dtype.
    est = mk.estimate_memory(r.model_ref(), _memory_args(plan.training_args_kwargs),
                             seq_len=r.seq_len, device=plan.device, task=r.task,
                             dtype=None if quant is not None else mkw.get("dtype"),
                             attn_implementation=mkw.get("attn_implementation"),
                             peft_config=plan.peft_config,
                             quantization_config=quant, **extra)
    assert c.device_used == est.device_used
    assert est.upper <= plan.budget  # the step needs no more than the budget, with margin


def test_plan_text_of_recipe_prints_the_estimate(capsys):
    bert = "recipes/bert-large-uncased/340m_full_v100-16gb.yaml"
    assert main(["plan", bert]) == 0
    out = capsys.readouterr().out
    r = load_recipe(bert)
    plan = mk.plan_training(**r.plan_kwargs())
    est = mk.estimate_memory(r.model_ref(), _memory_args(plan.training_args_kwargs),
                             seq_len=512, device="V100-SXM2-16GB", task=r.task,
                             attn_implementation=plan.model_kwargs.get("attn_implementation"))
    line = next(ln for ln in out.splitlines() if "predicted memory" in ln)
    assert f"needs {format_bytes(est.required)} of {format_bytes(plan.budget)}: fits" in line


def test_plan_cli_flags_override_the_recipe(capsys):
    assert main(["plan", "llama-3.1/8b_qlora_rtx4090", "--gpu", "A100-80GB", "--seq-len", "512",
                 "--method", "full", "--json", "optim=adamw_torch_fused"]) == 0
    plan = mk.Plan.from_json(capsys.readouterr().out)
    assert plan.device.name == "A100-80GB" and plan.seq_len == 512
    assert plan.chosen.method == "full" and plan.chosen.optim == "adamw_torch_fused"
    assert plan.target_batch_size == 16                         # from the recipe
    assert plan.training_args_kwargs["learning_rate"] == 2e-4   # recipe pins pass through


def test_plan_model_without_seq_len_is_bad_input(capsys):
    assert main(["plan", "gpt2", "--gpu", "T4"]) == 2
    assert "--seq-len and --target-batch required" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------
# bad recipes: every problem, with the file and the key
# ----------------------------------------------------------------------------------------------


def test_all_problems_reported_together_with_file_and_key(tmp_path):
    p = write(tmp_path, """
model: {name: Llama-3.1-8B, overides: {}}
trainig: {seq_len: 2048}
training: {seq_len: abc, target_batch_size: "32", method: qlorra}
hardware: {device: A100-90GB, num_gpus: 0}
pins: {learning_rat: 1.0e-4, output_dir: x}
callbacks: [memory, thruput]
""", "bad.yaml")
    with pytest.raises(mk.ConfigError) as ei:
        load_recipe(p)
    probs = ei.value.problems
    text = "\n".join(probs)
    assert all(pr.startswith(f"{p}: ") for pr in probs)
    expected = [
        "model.overides: unknown key (did you mean `overrides`?)",
        "trainig: unknown key (did you mean `training`?)",
        "training.seq_len: expected a positive integer, got 'abc'",
        "training.target_batch_size: expected a positive integer, got '32' (a string)",
        "training.method: expected one of auto, full, lora, qlora, got 'qlorra' "
        "(did you mean `qlora`?)",
        "hardware.device: unknown GPU `A100-90GB` (did you mean `A100-80GB`?)",
        "hardware.num_gpus: expected a positive integer, got 0",
        "pins.learning_rat: not a TrainingArguments field (did you mean `learning_rate`?)",
        "pins.output_dir: set it as the top-level `output_dir` key instead",
        "callbacks: unknown callback `thruput` (did you mean `throughput`?)",
    ]
    for e in expected:
        assert e in text, f"missing: {e}\n{text}"
    assert len(probs) == len(expected)
    assert "10 problem(s) in" in str(ei.value)


def test_python_tag_is_rejected_and_never_run(tmp_path):
    marker = tmp_path / "pwned"
    p = write(tmp_path, f"""
model: !!python/object/apply:os.system ["touch {marker}"]
training: {{seq_len: 8, target_batch_size: 1}}
""", "evil.yaml")
    with pytest.raises(mk.ConfigError) as ei:
        load_recipe(p)
    msg = str(ei.value)
    assert "evil.yaml" in msg and "!!python/object/apply:os.system" in msg
    assert "yaml.safe_load" in msg
    assert not marker.exists()


@pytest.mark.parametrize("body, key, fragment", [
    ("model: Llama-3.1-8b-typo\ntraining: {seq_len: 8, target_batch_size: 1}",
     "model.name", "unknown model `Llama-3.1-8b-typo`"),
    ("model: {name: Llama-3.2-1B, overrides: {num_hiden_layers: 2}}\n"
     "training: {seq_len: 8, target_batch_size: 1}",
     "model.overrides.num_hiden_layers", "(did you mean `num_hidden_layers`?)"),
    ("model: bert-large-uncased\ntraining: {seq_len: 1024, target_batch_size: 1}",
     "training.seq_len", "longer than the model's 512 learned positions"),
    ("model: gpt2\ntraining: {seq_len: 8, target_batch_size: 12}\nhardware: {device: A100-80GB,"
     " num_gpus: 8}", "training.target_batch_size", "nearest valid targets: 8, 16"),
    ("model: gpt2\ntraining: {seq_len: 8, target_batch_size: 8}\nhardware: {device: T4}\n"
     "pins: {tf32: true}", "pins.tf32", "tf32=True on T4 (compute capability 7.5): TF32 needs"),
    ("model: gpt2\ntraining: {seq_len: 8, target_batch_size: 8}\n"
     "pins: {per_device_train_batch_size: 3}", "pins.per_device_train_batch_size",
     "does not divide the per-GPU batch 8"),
    ("model: gpt2\ntraining: {seq_len: 8, target_batch_size: 8}\ndata: missing.jsonl",
     "data.source", "no such file `missing.jsonl`"),
    ("model: gpt2\ntraining: {seq_len: 8, target_batch_size: 8}\nhardware: {max_memory: 20 GiBs}",
     "hardware.max_memory", "expected bytes or a size such as '20GiB'"),
    ("model: gpt2\ntraining: {seq_len: 8, target_batch_size: 8}\n"
     "hardware: {device: H100-80GB, num_gpus: 8, engine: deepspeeed}",
     "hardware.engine", "did you mean `deepspeed`"),
    ("model: gpt2\ntraining: {seq_len: 8, target_batch_size: 16}\n"
     "hardware: {device: H100-80GB, num_gpus: 16, num_nodes: 3}",
     "hardware.num_nodes", "not a multiple of num_nodes=3"),
    ("model: gpt2\ntraining: {seq_len: 8, target_batch_size: 8}\n"
     "hardware: {device: A100-80GB, cuda_version: 12}",
     "hardware.cuda_version", "expected a CUDA version such as '12.8'"),
    ("model: gpt2\nseq_len: 8\ntraining: {target_batch_size: 8}",
     "seq_len", "unknown key (did you mean `training.seq_len`?)"),
    ("- just\n- a list", "", "the top level must be a mapping"),
])
def test_bad_recipe_names_key_and_fix(tmp_path, body, key, fragment):
    p = write(tmp_path, body)
    with pytest.raises(mk.ConfigError) as ei:
        load_recipe(p)
    hit = [pr for pr in ei.value.problems if fragment in pr]
    assert hit, ei.value.problems
    assert hit[0].startswith(f"{p}: {key}")


def test_file_data_needs_a_tokenizer(tmp_path):
    (tmp_path / "d.txt").write_text("hello world\n")
    p = write(tmp_path, "model: gpt2\ndata: d.txt\ntraining: {seq_len: 8, target_batch_size: 1}")
    with pytest.raises(mk.ConfigError, match="model.tokenizer: data from a file .* needs a "
                                             "tokenizer"):
        load_recipe(p)


def test_recipe_round_trips_through_save_and_load(tmp_path):
    r = load_recipe(TINY)
    r.save(tmp_path / "copy.yaml")
    again = load_recipe(tmp_path / "copy.yaml")
    assert again == r
    assert Recipe.schema()[0][0] == "model.name"
    assert all(help_ for _, _, help_ in Recipe.schema())


# ----------------------------------------------------------------------------------------------
# exit codes
# ----------------------------------------------------------------------------------------------


def test_impossible_budget_exits_2(tmp_path, capsys):
    p = write(tmp_path, "model: Llama-3.1-8B\ntraining: {seq_len: 2048, target_batch_size: 8, "
                        "method: full}\nhardware: {device: T4, max_memory: 1GiB}")
    assert main(["plan", str(p)]) == 2
    err = capsys.readouterr().err
    assert "needs at least" in err and "try a shorter seq_len" in err


def test_validate_bad_recipe_exits_2_listing_problems(tmp_path, capsys):
    bad = write(tmp_path, "model: gpt2\ntraining: {seq_len: -1, target_batch_size: 8}")
    assert main(["recipes", "validate", str(bad), TINY]) == 2
    err = capsys.readouterr().err
    assert "training.seq_len: expected a positive integer, got -1" in err


def test_train_gpu_recipe_without_gpu_exits_2(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert main(["train", "llama-3.1/8b_qlora_rtx4090"]) == 2
    err = capsys.readouterr().err
    assert "hardware.device" in err and "no CUDA GPU" in err and "hf-memkit plan" in err


def test_console_script_exit_codes(tmp_path):
    script = Path(sys.executable).with_name("hf-memkit")
    bad = write(tmp_path, "model: gpt2\ntraining: {seq_len: 8, target_batch_size: 8}\n"
                          "hardware: {device: RTX-9090}")
    r = subprocess.run([str(script), "recipes", "validate", str(bad)], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 2
    assert "hardware.device: unknown GPU `RTX-9090`" in r.stderr
    assert "1 valid" not in r.stdout and "0 valid, 1 invalid" in r.stdout


@pytest.mark.parametrize("cmd", ["train", "recipes", "plan", "demo"])
def test_help_has_examples(cmd, capsys):
    with pytest.raises(SystemExit) as ei:
        main([cmd, "--help"])
    assert ei.value.code == 0
    assert "Examples:" in capsys.readouterr().out


def test_recipe_cuda_version_reaches_the_plan(tmp_path):
    """hardware.cuda_version is the target's CUDA: 11.2 loads every kernel at start, so the
    plan's estimate carries the eager-loading context (1343 MiB, _cuda.CONTEXT_EAGER_LOADING)."""
    from hf_memkit._cuda import runtime as _cuda

    p = write(tmp_path, "model: gpt2\ntraining: {seq_len: 64, target_batch_size: 4}\n"
                        "hardware: {device: A100-80GB, cuda_version: '11.2'}")
    r = load_recipe(p)
    assert r.cuda_version == "11.2"
    plan = mk.plan_training(**r.plan_kwargs())
    assert plan.estimate.cuda_version == "11.2"
    assert plan.estimate.breakdown["context"] == _cuda.CONTEXT_EAGER_LOADING
