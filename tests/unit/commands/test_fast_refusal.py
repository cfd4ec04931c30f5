"""Bad command-line input is refused before torch or transformers load (issue 28: an unknown
model name used to wait ~20 s for the heavy imports and a trace before its error). Each case
runs in a fresh interpreter, which then reports whether torch or transformers were imported."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

CHILD = """
import json, sys
from hf_memkit.commands.main import main
try:
    rc = main(ARGV)
except SystemExit as exc:  # argparse's own errors
    rc = exc.code
print(json.dumps([rc, 'torch' in sys.modules, 'transformers' in sys.modules]))
"""
PLAN = ["--seq-len", "2048", "--target-batch", "32"]

CASES = {
    "estimate: unknown model": (["estimate", "Llama-3.1-9B", "--gpu", "RTX-4090", "--seq-len",
                                 "2048", "bf16=true"],
                                ["unknown model `Llama-3.1-9B`", "`meta-llama/Llama-3.1-9B`",
                                 "bundled configs"]),
    "plan: unknown model": (["plan", "gpt3", "--gpu", "T4", *PLAN, "optim=adafactor"],
                            ["unknown model `gpt3`", "`gpt2`"]),
    "estimate: unknown GPU": (["estimate", "gpt2", "--gpu", "A100-90GB", "--seq-len", "512"],
                              ["unknown GPU `A100-90GB`", "A100-80GB"]),
    "plan: unknown GPU": (["plan", "Llama-3.1-8B", "--gpu", "RTX-4091", *PLAN],
                          ["unknown GPU `RTX-4091`", "RTX-4090"]),
    "plan recipe: unknown GPU": (["plan", "llama-3.1/8b_qlora_rtx4090", "--gpu", "T5"],
                                 ["unknown GPU `T5`", "T4"]),
    "bad --seq-len": (["estimate", "gpt2", "--gpu", "T4", "--seq-len", "0"],
                      ["--seq-len", "`0`", "positive integer"]),
    "bad --method": (["plan", "gpt2", "--gpu", "T4", *PLAN, "--method", "lorra"],
                     ["'lorra'", "lora"]),
    "bad --max-memory": (["estimate", "gpt2", "--gpu", "T4", "--seq-len", "512",
                          "--max-memory", "20GBs"],
                         ["--max-memory", "`20GBs`", "20GiB"]),
    "bad --host-memory": (["plan", "gpt2", "--gpu", "T4", *PLAN, "--host-memory", "lots"],
                          ["--host-memory", "`lots`"]),
    "bad --cuda-version": (["plan", "gpt2", "--gpu", "T4", *PLAN, "--cuda-version", "twelve"],
                           ["cuda_version", "'twelve'", "12.8"]),
    "field without a name": (["estimate", "gpt2", "--gpu", "T4", "--seq-len", "512", "=5"],
                             ["`=5`", "FIELD=VALUE"]),
    # sizes a user types are bounded before any trace (issue 47: a huge target batch hung the
    # planner, a huge --batch reached torch's storage overflow)
    "huge --target-batch": (["plan", "gpt2", "--gpu", "A100-80GB", "--seq-len", "128",
                             "--target-batch", "1000000000"],
                            ["--target-batch", "at most 1048576 samples", "`1000000000`"]),
    "huge --batch": (["estimate", "gpt2", "--gpu", "T4", "--seq-len", "128", "--batch",
                      "1000000000000"], ["--batch", "at most 1048576", "`1000000000000`"]),
    "huge --seq-len": (["plan", "gpt2", "--gpu", "T4", "--seq-len", str(2**24 + 1)],
                       ["--seq-len", "at most 16777216 tokens"]),
    "huge --num-gpus": (["plan", "gpt2", "--gpu", "T4", *PLAN, "--num-gpus", "10000000"],
                        ["--num-gpus", "at most 131072"]),
    "huge --lora-r": (["estimate", "gpt2", "--gpu", "T4", "--seq-len", "128", "--method",
                       "lora", "--lora-r", "99999999"], ["--lora-r", "at most 65536"]),
    "negative --max-memory": (["plan", "gpt2", "--gpu", "T4", *PLAN, "--max-memory", "-5GiB"],
                              ["--max-memory", "goes after '='", "--max-memory=-VALUE"]),
    "a device as the model": (["estimate", "/dev/zero", "--gpu", "T4", "--seq-len", "128"],
                              ["`/dev/zero` is a device", "give a model directory"]),
    "escapes in a GPU name": (["estimate", "gpt2", "--gpu", "T4\x1b]0;pwned\x07\x1b[2J",
                               "--seq-len", "64"],
                              ["unknown GPU `T4\\x1b]0;pwned\\x07\\x1b[2J`"]),
    "probe --index -1": (["probe", "--index", "-1"], ["--index", "integer >= 0", "`-1`"]),
    "demo --steps 0": (["demo", "--steps", "0"], ["--steps", "positive integer", "`0`"]),
    "train --max-steps 10**30": (["train", "tiny-llama/1m_full_cpu", "--max-steps", "1" + "0" * 30],
                                 ["--max-steps", "at most 2147483648 optimizer steps"]),
    "negative --max-memory=": (["plan", "gpt2", "--gpu", "T4", *PLAN, "--max-memory=-5GiB"],
                               ["--max-memory", "`-5GiB`"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_refused_before_torch_loads(case):
    argv, fragments = CASES[case]
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", CHILD.replace("ARGV", repr(argv))],
                       capture_output=True, text=True, timeout=120)
    seconds = time.perf_counter() - t0
    rc, torch_loaded, transformers_loaded = json.loads(r.stdout.strip().splitlines()[-1])
    assert rc == 2, r.stderr
    assert not torch_loaded and not transformers_loaded, f"{case}: {r.stderr}"
    assert "Traceback" not in r.stderr and "\x1b" not in r.stderr   # no raw escape either
    for f in fragments:
        assert f in r.stderr, f"{case}: missing {f!r} in:\n{r.stderr}"
    # generous on a loaded machine (the bench measures it: bench/cli_speed.py, < 1 s)
    assert seconds < 30


def test_a_good_name_is_not_refused_by_the_fast_check(tmp_path):
    """What the fast check lets through: bundled names, hub ids naming them, local config
    directories and files, and bundled recipe names."""
    import argparse

    from transformers import LlamaConfig

    from hf_memkit.commands.estimate import check_input
    from hf_memkit.commands.plan import check_plan_input

    LlamaConfig(num_hidden_layers=2).save_pretrained(tmp_path / "cfg")
    base = dict(gpu="T4", max_memory=None, host_memory=None, cuda_version=None)
    for ref in ("gpt2", "meta-llama/Llama-3.1-8B", "llama-3.1-8b", str(tmp_path / "cfg"),
                str(tmp_path / "cfg" / "config.json")):
        check_input(argparse.Namespace(model=ref, **base))
    check_plan_input(argparse.Namespace(model="llama-3.1/8b_qlora_rtx4090", **base))


def test_the_command_lines_bounds_are_the_librarys():
    """The CLI restates the bounds (it parses without importing torch); they stay equal."""
    from hf_memkit._model.profile import MAX_LAYERS
    from hf_memkit._plan.request import MAX_RANKS
    from hf_memkit._trainers.packing import MAX_BATCH, MAX_TOKENS
    from hf_memkit.commands import estimate

    assert (estimate.MAX_TOKENS, estimate.MAX_BATCH, estimate.MAX_RANKS) == (
        MAX_TOKENS, MAX_BATCH, MAX_RANKS)
    assert MAX_LAYERS >= 1000      # DeepNet's depth still plans
