"""The hf-memkit CLI root: devices, probe, estimate and plan against the API, help, bad input
(the demo's end-to-end slice, a real Trainer run, is in tests/integration/test_train_recipes.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

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


# --- estimate --method lora|qlora, --max-batch with its reason -----------------------------------

@pytest.fixture(scope="module")
def mid_dir(tmp_path_factory):
    """A Llama whose weights dominate a short step (LoRA and QLoRA show in device_used)."""
    from transformers import LlamaConfig

    d = tmp_path_factory.mktemp("mid")
    LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                num_attention_heads=8, num_key_value_heads=4, vocab_size=1024,
                max_position_embeddings=512).save_pretrained(d)
    return d


def _estimate_json(capsys, model, *extra):
    assert main(["estimate", str(model), "--gpu", "RTX-4090", "--seq-len", "64", "--batch", "1",
                 "bf16=true", "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


def test_estimate_method_lora_and_qlora_shrink_the_step(capsys, mid_dir):
    full = _estimate_json(capsys, mid_dir)
    lora = _estimate_json(capsys, mid_dir, "--method", "lora")
    qlora = _estimate_json(capsys, mid_dir, "--method", "qlora")
    assert qlora["device_used"] < lora["device_used"] < full["device_used"]
    assert qlora["model_states"] < lora["model_states"] < full["model_states"] / 4
    # as plan_training builds it: the API with the method's peft and quantization configs
    from hf_memkit._methods import METHODS

    dev = mk.get_device("RTX-4090")
    m = METHODS.get("qlora")
    api = mk.estimate_memory(str(mid_dir), dict(per_device_train_batch_size=1,
                                                per_device_eval_batch_size=1, bf16=True),
                             seq_len=64, device=dev, peft_config=m.peft_config("causal-lm"),
                             quantization_config=m.quantization_config(dev),
                             dtype=m.load_dtype("bf16", dev))
    assert qlora["device_used"] == api.device_used


def test_estimate_lora_rank_changes_the_adapters(capsys, mid_dir):
    r16 = _estimate_json(capsys, mid_dir, "--method", "lora")
    r64 = _estimate_json(capsys, mid_dir, "--method", "lora", "--lora-r", "64")
    # adapters (r x (in + out) per linear), their gradients and AdamW state grow 4x with the rank
    assert r64["model_states"] > r16["model_states"]
    assert r64["breakdown"]["optimizer"] / r16["breakdown"]["optimizer"] == pytest.approx(4, rel=1e-3)


@pytest.mark.parametrize("extra,words", [
    (["--method", "qlor"], ["--method", "invalid choice: 'qlor'", "'lora'", "'qlora'"]),
    (["--method", "lora", "--lora-r", "0"], ["--lora-r", "positive integer", "`0`"]),
    (["--lora-r", "8"], ["--lora-r 8", "--method lora", "--method qlora"]),
])
def test_estimate_bad_method_or_rank_exits_2(capsys, extra, words):
    try:  # argparse's own errors exit through SystemExit
        code = main(["estimate", "gpt2", "--gpu", "T4", "--seq-len", "64", *extra])
    except SystemExit as exc:
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err
    assert all(w in err for w in words), err


def test_estimate_qlora_without_bitsandbytes_says_how_to_install(tmp_path):
    """A machine without bitsandbytes: exit 2, the install command, and what works instead."""
    code = ("import sys; sys.modules['bitsandbytes'] = None\n"
            "from hf_memkit.commands.main import main\n"
            "sys.exit(main(['estimate', 'gpt2', '--gpu', 'T4', '--seq-len', '64', "
            "'--method', 'qlora']))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 2, out.stderr
    assert "needs bitsandbytes: pip install 'hf-memkit[bnb]'" in out.stderr
    assert "--method full / lora" in out.stderr


def test_max_batch_prints_its_reason(capsys, mid_dir):
    from hf_memkit._plan.reverse import max_batch_answer
    from hf_memkit._units import format_bytes

    args = ["estimate", str(mid_dir), "--gpu", "RTX-4090", "--seq-len", "128", "bf16=true",
            "--method", "lora", "--max-memory", "1.5GiB", "--max-batch"]
    assert main(args) == 0
    line = capsys.readouterr().out.strip()
    a = max_batch_answer(str(mid_dir), {"bf16": True}, seq_len=128, device="RTX-4090",
                         max_memory="1.5GiB", **_lora_kwargs())
    assert a.batch >= 1 and a.needed <= a.budget < a.next_needed and a.next_batch == a.batch + 1
    assert line == (f"max micro-batch {a.batch} at seq_len 128: {format_bytes(a.needed)} of "
                    f"{format_bytes(a.budget)} budget; {a.batch + 1} needs "
                    f"{format_bytes(a.next_needed)}")
    assert main([*args, "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["max_batch_size"] == a.batch and d["next_needed"] == a.next_needed
    assert d["budget"] == 3 << 29


def _lora_kwargs() -> dict:
    from hf_memkit._methods import METHODS

    dev = mk.get_device("RTX-4090")
    m = METHODS.get("lora")
    return dict(peft_config=m.peft_config("causal-lm"), dtype=m.load_dtype("bf16", dev))
