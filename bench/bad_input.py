"""Bad, hostile and careless input at every user-facing input of ``hf-memkit`` and the public API.

Each case (one line in ``CASES`` below) runs in a fresh process, in a fresh working directory of
its own, with ``HOME``, the caches, ``TMPDIR`` and ``HF_MEMKIT_CACHE`` inside one temporary folder
(nothing of the user's is read or written), ``HF_HUB_OFFLINE=1`` and the trace cache off unless
the case is about the cache. Each is classified as one of:

  * ``clear error``: CLI: exit 2, no traceback, every fragment the case declares (the bad value,
    or a key word of the rule) on stderr; API: ``hf_memkit.HfMemkitError`` whose message holds
    them;
  * ``handled``: a value that must work, and did (the exit codes and output the case declares);
  * ``traceback``: any other exception, a traceback on stderr, an exit by a signal;
  * ``silently wrong``: accepted (exit 0, 1 or 3 with no traceback; a result returned) where the
    case declares it must be refused;
  * ``unclear``: refused (exit 2 / HfMemkitError) without a declared fragment, or with raw
    terminal control characters in the message;
  * ``hang``: past the case's timeout (120 s unless the case says more); the process group is
    killed;
  * ``wrote outside``: a file appeared (or went) outside the case's working directory, or at a
    hostile path the case names (checked for every case);
  * ``wrongly refused`` / ``wrong result``: a case that must work was refused / answered wrongly.

CPU seconds are ``getrusage(RUSAGE_CHILDREN)`` deltas around each case's process (user + system);
API cases also report the CPU of the call alone (after ``import hf_memkit``, torch and the names
the call uses). The bar: every refusal within about a second of CPU when it comes before torch,
and before any model trace otherwise; the counts under 1 s and under 15 s are printed.

Writes ``bench/results/bad_input.md`` (a table: case, surface, outcome, CPU seconds, first line
of the message; then every case that is neither a clear error nor handled, with its command) and
``bench/results/bad_input.json``. Takes about 30 minutes on 2 cores (most cases import torch and
transformers, some trace a tiny model, two train it for a step, one is killed at its timeout)::

    python bench/bad_input.py [--only SUBSTRING]... [--again RESULTS.json] [--keep] [--out DIR]
                              [--quick]

``--quick`` runs three refusals that come before torch (seconds) and needs ``--out``: it never
writes ``bench/results/``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from _quick import add_flag, guard

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
TINY_RECIPE = REPO / "recipes" / "tiny-llama" / "1m_full_cpu.yaml"
OUTCOMES = ("clear error", "handled", "traceback", "silently wrong", "unclear", "hang",
            "wrote outside", "wrongly refused", "wrong result")
MARK = "@@bad_input@@"
TIMEOUT = 120
QUICK = ("--seq-len 0", "--gpu A100-90GB", "unknown model name")


# ----------------------------------------------------------------------------------------------
# Cases
# ----------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Case:
    name: str
    surface: str
    run: list[str] | str            # CLI: argv after `hf-memkit`; API: Python setting `result`
    says: tuple[str, ...] = ()      # must be refused: the fragments its message holds
    ok: tuple[int, ...] | None = None   # must work: CLI exit codes (API: any return)
    out: tuple[str, ...] = ()       # must work: fragments of stdout + stderr
    check: str = ""                 # must work (API): an expression on `result` that is true
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    setup: Callable[[Path, Path], None] | None = None   # (cwd, root) before the run
    after: Callable[[Path, Path], str | None] | None = None  # (cwd, root) -> a write problem
    watch: tuple[str, ...] = ()     # hostile paths that must not exist afterwards
    timeout: int = TIMEOUT

    @property
    def api(self) -> bool:
        return isinstance(self.run, str)

    @property
    def refuse(self) -> bool:
        return self.ok is None


def cli(name: str, surface: str, argv: str | list[str], *says: str, **kw) -> Case:
    """A CLI case; ``argv`` a shell-like string (shlex) or a list."""
    return Case(name, surface, shlex.split(argv) if isinstance(argv, str) else argv, says, **kw)


def api(name: str, surface: str, code: str, *says: str, **kw) -> Case:
    return Case(name, surface, code, says, **kw)


# -- fixtures: written once under ROOT/fix --------------------------------------------------------

TINY_CFG = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
            "vocab_size": 128, "max_position_embeddings": 256}


def fixtures(fix: Path) -> None:
    def config(name: str, body: bytes | dict) -> None:
        (fix / name).mkdir(parents=True)
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        (fix / name / "config.json").write_bytes(data)

    config("tiny", TINY_CFG)
    config("deep", {**TINY_CFG, "num_hidden_layers": 10**6})
    config("malformed", b'{"model_type": "llama", "hidden_size": ')
    config("heads0", {**TINY_CFG, "num_attention_heads": 0})
    config("hidden_neg", {**TINY_CFG, "hidden_size": -64})
    config("vocab_huge", {**TINY_CFG, "vocab_size": 10**15})
    config("remote", {**TINY_CFG, "model_type": "evil-llama",
                      "auto_map": {"AutoConfig": "configuration_evil.EvilConfig"}})
    (fix / "remote" / "configuration_evil.py").write_text(
        f"open({str(fix / 'code_ran')!r}, 'w').write('ran')\n")
    (fix / "noconfig").mkdir()
    (fix / "cfgfifo").mkdir()
    os.mkfifo(fix / "cfgfifo" / "config.json")
    os.mkfifo(fix / "fifo")
    (fix / "dir").mkdir()
    lengths = {"ok.txt": b"32\n64\n48\n16\n", "ok.json": b"[32, 64, 48]", "empty.txt": b"",
               "nonutf8.txt": b"32\n\xff\xfe\n", "huge.txt": str(10**30).encode() + b"\n",
               "negative.txt": b"32\n-5\n", "nested.json": b"[[1, 2], [3]]",
               "deep.json": b"[" * 100000 + b"]" * 100000, "float.txt": b"32.5\n",
               "words.txt": b"thirty-two\n", "zero.txt": b"0\n0\n"}
    for name, data in lengths.items():
        (fix / name).write_bytes(data)
    (fix / "afile").write_text("not a folder\n")


def recipe(pins: str = "", output_dir: str | None = None, extra: str = "",
           replace: dict[str, str] | None = None, name: str = "r.yaml",
           data: bytes | None = None) -> Callable[[Path, Path], None]:
    """A setup writing the tiny CPU recipe (changed) to ``cwd/name``."""
    def setup(cwd: Path, root: Path) -> None:
        if data is not None:
            (cwd / name).write_bytes(data)
            return
        text = TINY_RECIPE.read_text().replace("  seed: 0\n", "  seed: 0\n" + pins)
        if output_dir is not None:
            text = text.replace("output_dir: demo_output", f"output_dir: {output_dir}")
        for old, new in (replace or {}).items():
            text = text.replace(old, new)
        (cwd / name).write_text(text + extra)
    return setup


def bomb(levels: int = 9, width: int = 9) -> str:
    """YAML 'billion laughs': width ** levels values from a few hundred bytes."""
    anchors = [f"&a0 [{', '.join(['lol'] * width)}]"] + [
        f"&a{i} [{', '.join([f'*a{i - 1}'] * width)}]" for i in range(1, levels)]
    return "[" + ", ".join(anchors) + "]"


def huge_recipe(cwd: Path, root: Path) -> None:
    """The tiny recipe, then 96 MiB of comment lines."""
    with open(cwd / "huge.yaml", "w") as f:
        f.write(TINY_RECIPE.read_text())
        line = "# " + "x" * 1022 + "\n"
        for _ in range(96 * 1024):
            f.write(line)


def run_link(cwd: Path, root: Path) -> None:
    """``cwd/runs`` -> ``root/escape`` (a folder outside the working directory)."""
    (root / "escape").mkdir(exist_ok=True)
    (cwd / "runs").symlink_to(root / "escape", target_is_directory=True)
    recipe(output_dir="runs/a")(cwd, root)


def special(kind: str) -> Callable[[Path, Path], None]:
    def setup(cwd: Path, root: Path) -> None:
        if kind == "fifo":
            os.mkfifo(cwd / "r.yaml")
        elif kind == "dir":
            (cwd / "r.yaml").mkdir()
        elif kind == "dangling":
            (cwd / "r.yaml").symlink_to(cwd / "nowhere.yaml")
    return setup


def open_cache(cwd: Path, root: Path) -> None:
    (cwd / "cache").mkdir()
    (cwd / "cache").chmod(0o777)


def nothing_kept(cwd: Path, root: Path) -> str | None:
    kept = [p for p in (cwd / "cache").rglob("*") if p.is_file()]
    return f"wrote {len(kept)} file(s) into the 0o777 cache folder" if kept else None


def linked_traces(cwd: Path, root: Path) -> None:
    other = root / "someone_elses"
    other.mkdir(exist_ok=True)
    (other / "a.trace").write_bytes(b"keep me")
    (cwd / "cache").mkdir(mode=0o700)
    (cwd / "cache" / "traces").symlink_to(other, target_is_directory=True)


def link_target_kept(cwd: Path, root: Path) -> str | None:
    target = root / "someone_elses" / "a.trace"
    return None if target.exists() else f"removed {target} through the link"


def afile_kept(cwd: Path, root: Path) -> str | None:
    return None if (root / "fix" / "afile").is_file() else "removed the file HF_MEMKIT_CACHE names"


def output_in(folder: str) -> Callable[[Path, Path], str | None]:
    def after(cwd: Path, root: Path) -> str | None:
        return None if (cwd / folder).is_dir() else f"no {folder}/ in the working directory"
    return after


ET = "estimate {fix}/tiny --gpu cpu --seq-len 8"
EG = "estimate gpt2 --gpu T4 --seq-len 512"
PT = "plan {fix}/tiny --gpu A100-80GB --seq-len 64 --target-batch 8"
PG = "plan gpt2 --gpu T4 --seq-len 512 --target-batch 8"
SFT = "plan {fix}/tiny --gpu A100-80GB --target-batch 8 --trainer sft"
GRPO = ("estimate {fix}/tiny --gpu cpu --trainer grpo --seq-len 48 --batch 2 "
        "max_completion_length=32")
VLLM = ("estimate {fix}/tiny --gpu A100-80GB --trainer grpo --seq-len 48 --batch 2 "
        "max_completion_length=32 use_vllm=true vllm_mode=colocate")
TR = "train r.yaml"
BIG = str(10**30)
ESC = "\x1b]0;pwned\x07\x1b[2J"
PLAN_ON = "p = mk.plan_training(tiny(), device='A100-80GB', seq_len=64, "

CASES: list[Case] = [
    # -- estimate / plan: sizes ------------------------------------------------------------------
    cli("--seq-len 0", "estimate flags", f"{EG[:-4]} 0", "--seq-len", "`0`"),
    cli("--seq-len 10**30", "estimate flags", f"{EG[:-4]} {BIG}", "--seq-len", BIG),
    cli("--seq-len nan", "estimate flags", f"{EG[:-4]} nan", "--seq-len", "nan"),
    cli("--seq-len ''", "estimate flags", f"{EG[:-4]} ''", "--seq-len"),
    cli("--seq-len ½ (non-ASCII)", "estimate flags", f"{EG[:-4]} ½", "--seq-len", "½"),
    cli("--seq-len 1 (smallest)", "estimate flags", "estimate {fix}/tiny --gpu cpu --seq-len 1",
        ok=(0,), out=("peak",)),
    cli("--batch 2.0", "estimate flags", f"{EG} --batch 2.0", "--batch", "2.0"),
    cli("--num-gpus 10**7", "estimate flags", f"{EG} --num-gpus 10000000", "--num-gpus",
        "10000000"),
    cli("--lora-r 99999999", "estimate flags", f"{EG} --method lora --lora-r 99999999",
        "--lora-r", "99999999"),
    cli("--target-batch 0", "plan flags", f"{PG[:-2]} 0", "--target-batch", "`0`"),
    cli("--target-batch 10**30", "plan flags", f"{PG[:-2]} {BIG}", "--target-batch", BIG),
    cli("--num-gpus 3 (does not divide 8)", "plan flags", f"{PT} --num-gpus 3", "3",
        "target"),
    cli("--num-nodes 3 of 8 GPUs", "plan flags", f"{PT} --num-gpus 8 --num-nodes 3",
        "num_nodes", "3"),
    # -- estimate / plan: budgets and versions -------------------------------------------------
    cli("--headroom 1.5", "plan flags", f"{PG} --headroom 1.5", "--headroom", "1.5"),
    cli("--headroom inf", "estimate flags", f"{EG} --headroom inf", "--headroom", "inf"),
    cli("--max-memory -5GiB", "plan flags", f"{PG} --max-memory -5GiB", "--max-memory",
        "--max-memory=-VALUE"),
    cli("--max-memory=-5GiB", "plan flags", f"{PG} --max-memory=-5GiB", "--max-memory",
        "-5GiB"),
    cli("--max-memory 0", "plan flags", f"{PG} --max-memory 0", "max_memory", "'0'"),
    cli("--max-memory 1e400GiB", "plan flags", f"{PG} --max-memory 1e400GiB", "--max-memory",
        "1e400GiB"),
    cli("--host-memory=-1GiB", "plan flags", f"{PG} --host-memory=-1GiB", "--host-memory",
        "-1GiB"),
    cli("--cuda-version twelve", "plan flags", f"{PG} --cuda-version twelve", "twelve"),
    # -- estimate / plan: names and choices ----------------------------------------------------
    cli("--gpu A100-90GB", "estimate flags", "estimate gpt2 --gpu A100-90GB --seq-len 64",
        "A100-90GB"),
    cli("--gpu Cyrillic А100-80GB", "estimate flags",
        "estimate gpt2 --gpu А100-80GB --seq-len 64", "А100-80GB"),
    cli("--gpu ../../etc/passwd", "plan flags", "plan gpt2 --gpu ../../etc/passwd --seq-len 64 "
        "--target-batch 8", "../../etc/passwd"),
    cli("--gpu with terminal escapes", "estimate flags",
        ["estimate", "gpt2", "--gpu", f"T4{ESC}", "--seq-len", "64"], "unknown GPU"),
    cli("--trainer ppo", "plan flags", f"{PG} --trainer ppo", "ppo"),
    cli("--task nonsense", "estimate flags", f"{EG} --task nonsense", "nonsense"),
    cli("--dtype int8", "estimate flags", f"{EG} --dtype int8", "int8"),
    # -- --lengths / --mean-len / --max-len ----------------------------------------------------
    cli("--lengths a directory", "lengths", "estimate gpt2 --gpu T4 --lengths {fix}/dir",
        "{fix}/dir", "directory"),
    cli("--lengths a FIFO", "lengths", "estimate gpt2 --gpu T4 --lengths {fix}/fifo",
        "{fix}/fifo", "FIFO"),
    cli("--lengths /dev/zero", "lengths", "estimate gpt2 --gpu T4 --lengths /dev/zero",
        "/dev/zero", "device"),
    cli("--lengths empty", "lengths", "estimate gpt2 --gpu T4 --lengths {fix}/empty.txt",
        "lengths", "empty"),
    cli("--lengths not UTF-8", "lengths", "estimate gpt2 --gpu T4 --lengths {fix}/nonutf8.txt",
        "nonutf8.txt", "UTF-8"),
    cli("--lengths 10**30", "lengths", "estimate gpt2 --gpu T4 --lengths {fix}/huge.txt",
        "lengths", "1e+30"),
    cli("--lengths negative", "lengths", "estimate gpt2 --gpu T4 --lengths {fix}/negative.txt",
        "lengths", "[-5]"),
    cli("--lengths nested JSON", "lengths", "estimate gpt2 --gpu T4 --lengths {fix}/nested.json",
        "lengths", "[[1, 2], [3]]"),
    cli("--lengths a JSON list (legit)", "lengths",
        "estimate {fix}/tiny --gpu cpu --lengths {fix}/ok.json", ok=(0,), out=("peak",)),
    cli("--mean-len 0", "lengths", f"{SFT} --mean-len 0 --max-len 64", "--mean-len", "0"),
    cli("--mean-len above --max-len", "lengths", f"{SFT} --mean-len 200 --max-len 64",
        "200", "64"),
    # -- FIELD=VALUE ---------------------------------------------------------------------------
    cli("unknown field", "FIELD=VALUE", f"{ET} learning_rat=1e-4", "learning_rat"),
    cli("bf16=maybe", "FIELD=VALUE", f"{ET} bf16=maybe", "bf16", "maybe"),
    cli("bf16=ｔｒｕｅ (fullwidth)", "FIELD=VALUE", f"{ET} bf16=ｔｒｕｅ", "ｔｒｕｅ"),
    cli("bf16=False (legit: off)", "FIELD=VALUE", f"{ET} bf16=False", ok=(0,), out=("peak",)),
    cli("per_device_train_batch_size=10**12", "FIELD=VALUE",
        f"{ET} per_device_train_batch_size=1000000000000", "per_device_train_batch_size",
        "1000000000000"),
    cli("gradient_accumulation_steps=10**30", "FIELD=VALUE",
        f"{PT} gradient_accumulation_steps={BIG}", "gradient_accumulation_steps"),
    cli("fsdp_config={bad json", "FIELD=VALUE", [*shlex.split(ET), "fsdp=true",
                                                  "fsdp_config={bad json"], "fsdp_config"),
    cli("deepspeed=/dev/zero", "FIELD=VALUE", f"{ET} deepspeed=/dev/zero", "/dev/zero"),
    cli("--batch 2 beside per_device_train_batch_size=3", "FIELD=VALUE",
        f"{ET} --batch 2 per_device_train_batch_size=3", "per_device_train_batch_size", "3"),
    cli("output_dir=/etc/x (estimate)", "FIELD=VALUE", f"{ET} output_dir=/etc/hfmk_est",
        ok=(0,), out=("peak",), watch=("/etc/hfmk_est",)),
    # -- model references ----------------------------------------------------------------------
    cli("unknown model name", "model ref", "estimate Llama-9-1B --gpu T4 --seq-len 64",
        "Llama-9-1B"),
    cli("a directory without config.json", "model ref",
        "estimate {fix}/noconfig --gpu T4 --seq-len 64", "noconfig", "config.json"),
    cli("config.json is a FIFO", "model ref", "estimate {fix}/cfgfifo --gpu T4 --seq-len 64",
        "cfgfifo", "FIFO"),
    cli("/dev/zero as the model", "model ref", "estimate /dev/zero --gpu T4 --seq-len 64",
        "/dev/zero"),
    cli("config.json with 10**6 layers", "model ref", "estimate {fix}/deep --gpu T4 --seq-len 16",
        "num_hidden_layers=1000000"),
    cli("malformed config.json", "model ref", "estimate {fix}/malformed --gpu T4 --seq-len 16",
        "config.json", "not valid JSON"),
    cli("config.json num_attention_heads=0", "model ref",
        "estimate {fix}/heads0 --gpu T4 --seq-len 16", "num_attention_heads"),
    cli("config.json hidden_size=-64", "model ref",
        "estimate {fix}/hidden_neg --gpu T4 --seq-len 16", "hidden_size"),
    cli("config.json vocab_size=10**15 (answers: does not fit)", "model ref",
        "estimate {fix}/vocab_huge --gpu T4 --seq-len 16", ok=(1,), out=("TiB",)),
    cli("custom-code config (auto_map)", "model ref", "estimate {fix}/remote --gpu T4 --seq-len 16",
        "custom code", watch=("{fix}/code_ran",)),
    cli("model name 🦙", "model ref", "estimate 🦙 --gpu T4 --seq-len 64", "🦙"),
    cli("model name of 5000 characters", "model ref",
        ["estimate", "a" * 5000, "--gpu", "T4", "--seq-len", "64"], "unknown model"),
    cli("model name with terminal escapes", "model ref",
        ["estimate", f"gpt2{ESC}", "--gpu", "T4", "--seq-len", "64"], "unknown model"),
    cli("config.json path (legit)", "model ref",
        "estimate {fix}/tiny/config.json --gpu cpu --seq-len 8", ok=(0,), out=("peak",)),
    # -- GRPO / RLOO fields ----------------------------------------------------------------------
    cli("grpo num_generations=0", "GRPO/RLOO", f"{GRPO} num_generations=0", "num_generations",
        "got 0"),
    cli("grpo num_generations=1", "GRPO/RLOO", f"{GRPO} num_generations=1", "num_generations",
        "got 1"),
    cli("grpo num_generations=-8", "GRPO/RLOO", f"{GRPO} num_generations=-8", "num_generations",
        "-8"),
    cli("rloo num_generations=1", "GRPO/RLOO", f"{GRPO.replace('grpo', 'rloo')} num_generations=1",
        "num_generations", "got 1"),
    cli("grpo batch 3, num_generations=8", "GRPO/RLOO",
        f"{GRPO.replace(' --batch 2', '')} per_device_train_batch_size=3 num_generations=8",
        "generation_batch_size (3)", "num_generations (8)"),
    cli("grpo max_completion_length=0", "GRPO/RLOO", f"{GRPO} max_completion_length=0",
        "max_completion_length", "got 0"),
    cli("grpo max_completion_length=-1", "GRPO/RLOO", f"{GRPO} max_completion_length=-1",
        "max_completion_length", "-1"),
    cli("grpo max_completion_length=10**12", "GRPO/RLOO",
        f"{GRPO} max_completion_length=1000000000000", "max_completion_length", "1000000000000"),
    cli("vllm_gpu_memory_utilization=0", "GRPO/RLOO", f"{VLLM} vllm_gpu_memory_utilization=0",
        "vllm_gpu_memory_utilization"),
    cli("vllm_gpu_memory_utilization=-0.5", "GRPO/RLOO",
        f"{VLLM} vllm_gpu_memory_utilization=-0.5", "vllm_gpu_memory_utilization", "-0.5"),
    cli("vllm_gpu_memory_utilization=1.5", "GRPO/RLOO",
        f"{VLLM} vllm_gpu_memory_utilization=1.5", "vllm_gpu_memory_utilization", "1.5"),
    cli("plan grpo num_generations=1", "GRPO/RLOO",
        "plan {fix}/tiny --gpu cpu --trainer grpo --seq-len 48 --target-batch 8 "
        "max_completion_length=32 num_generations=1", "num_generations"),
    cli("grpo num_generations=2 (legit)", "GRPO/RLOO", f"{GRPO} num_generations=2", ok=(0,),
        out=("peak",)),
    # -- train ----------------------------------------------------------------------------------
    cli("recipe missing", "train", "train nope.yaml", "nope.yaml"),
    cli("recipe a directory", "train", TR, "r.yaml", "directory", setup=special("dir")),
    cli("recipe a FIFO", "train", TR, "r.yaml", "FIFO", setup=special("fifo")),
    cli("recipe /dev/zero", "train", "train /dev/zero", "/dev/zero"),
    cli("recipe a broken symlink", "train", TR, "r.yaml", "symbolic link",
        setup=special("dangling")),
    cli("output_dir /etc/hfmk_test", "train", TR, "/etc/hfmk_test", "absolute path",
        setup=recipe(output_dir="/etc/hfmk_test"), watch=("/etc/hfmk_test",)),
    cli("output_dir absolute in the temp dir", "train", TR, "{root}/abs_target",
        "absolute path", setup=recipe(output_dir="{root}/abs_target"),
        watch=("{root}/abs_target",)),
    cli("output_dir ~/...", "train", TR, "~/hfmk_home_run", setup=recipe(output_dir="~/hfmk_home_run"),
        watch=("{root}/home/hfmk_home_run",)),
    cli("output_dir ../", "train", TR, "../hfmk_up", "outside",
        setup=recipe(output_dir="../hfmk_up"), watch=("{root}/cwd/hfmk_up",)),
    cli("output_dir through a symlink out", "train", TR, "runs/a", "symbolic link",
        setup=run_link, watch=("{root}/escape/a",)),
    cli("--output-dir ../ (flag)", "train", f"{TR} --output-dir ../hfmk_up2", "../hfmk_up2",
        "outside", setup=recipe(), watch=("{root}/cwd/hfmk_up2",)),
    cli("pins push_to_hub", "train", TR, "push_to_hub", setup=recipe("  push_to_hub: true\n")),
    cli("pins hub_model_id", "train", TR, "hub_model_id", setup=recipe("  hub_model_id: me/x\n")),
    cli("pins report_to", "train", TR, "report_to", "wandb",
        setup=recipe("  report_to: [wandb]\n")),
    cli("--report-to wandb (not installed)", "train", f"{TR} --report-to wandb", "wandb",
        "not installed", setup=recipe()),
    cli("--report-to bogus", "train", f"{TR} --report-to bogus", "bogus", setup=recipe()),
    cli("--max-steps 0", "train", f"{TR} --max-steps 0", "--max-steps", "0", setup=recipe()),
    cli("--max-steps -1", "train", f"{TR} --max-steps -1", "--max-steps", "-1", setup=recipe()),
    cli("--max-steps 10**30", "train", f"{TR} --max-steps {BIG}", "--max-steps", BIG,
        setup=recipe()),
    cli("recipe YAML billion laughs", "train", TR, "10000 values",
        setup=recipe(replace={"callbacks: [memory, throughput]": f"callbacks: {bomb()}"})),
    cli("recipe with an unknown key", "train", TR, "optimiser",
        setup=recipe(extra="optimiser: adamw\n")),
    cli("recipe !!python/object tag", "train", TR, "!!python",
        setup=recipe(replace={"source: synthetic":
                              "source: !!python/object/apply:os.system ['touch {root}/pwned']"}),
        watch=("{root}/pwned",)),
    cli("recipe of 96 MiB", "train", "train huge.yaml --max-steps 1", "huge.yaml",
        setup=huge_recipe),
    cli("--max-steps 1, bundled recipe (legit run)", "train",
        "train tiny-llama/1m_full_cpu --max-steps 1 --output-dir out", ok=(0,),
        after=output_in("out"), timeout=400),
    # -- recipes validate ----------------------------------------------------------------------
    cli("validate a FIFO", "recipes", "recipes validate r.yaml", "r.yaml", "FIFO",
        setup=special("fifo")),
    cli("validate billion laughs", "recipes", "recipes validate r.yaml", "10000 values",
        setup=recipe(replace={"callbacks: [memory, throughput]": f"callbacks: {bomb()}"})),
    cli("validate a recipe with a BOM (legit)", "recipes", "recipes validate r.yaml", ok=(0,),
        setup=recipe(data=b"\xef\xbb\xbf" + TINY_RECIPE.read_bytes())),
    # -- cache ----------------------------------------------------------------------------------
    cli("HF_MEMKIT_NO_CACHE=maybe", "cache", PG, "HF_MEMKIT_NO_CACHE", "maybe",
        env={"HF_MEMKIT_NO_CACHE": "maybe"}),
    cli("HF_MEMKIT_TRACE_CACHE_SIZE=garbage (estimate)", "cache", ET,
        "HF_MEMKIT_TRACE_CACHE_SIZE", "garbage",
        env={"HF_MEMKIT_TRACE_CACHE_SIZE": "garbage", "HF_MEMKIT_NO_CACHE": "",
             "HF_MEMKIT_CACHE": "{cwd}/cache"}),
    cli("HF_MEMKIT_CACHE a 0o777 folder (cache info)", "cache", "cache info", ok=(0,),
        out=("writable by group or others",), setup=open_cache,
        env={"HF_MEMKIT_CACHE": "{cwd}/cache", "HF_MEMKIT_NO_CACHE": ""}),
    cli("HF_MEMKIT_CACHE a 0o777 folder (estimate)", "cache", ET, ok=(0,),
        out=("writable by group or others",), setup=open_cache, after=nothing_kept,
        env={"HF_MEMKIT_CACHE": "{cwd}/cache", "HF_MEMKIT_NO_CACHE": ""}),
    cli("cache clear: traces folder a symlink", "cache", "cache clear", ok=(0,),
        out=("was a link",), setup=linked_traces, after=link_target_kept,
        env={"HF_MEMKIT_CACHE": "{cwd}/cache", "HF_MEMKIT_NO_CACHE": ""}),
    cli("cache clear: HF_MEMKIT_CACHE a file", "cache", "cache clear", "HF_MEMKIT_CACHE",
        after=afile_kept, env={"HF_MEMKIT_CACHE": "{fix}/afile", "HF_MEMKIT_NO_CACHE": ""}),
    # -- probe / devices / calibrate / demo / the root -----------------------------------------
    cli("probe --index -1", "probe", "probe --index -1", "--index", "-1"),
    cli("probe --json (legit)", "probe", "probe --json", ok=(0,), out=("{",)),
    cli("calibrate --device -3 (no GPU here: that is said)", "calibrate",
        "calibrate --device -3", "CUDA GPU"),
    cli("calibrate (no CUDA GPU)", "calibrate", "calibrate", "CUDA"),
    cli("demo --steps 0", "demo", "demo --steps 0", "--steps", "0"),
    cli("demo --steps -5", "demo", "demo --steps -5", "--steps", "-5"),
    cli("demo --steps 10**30", "demo", f"demo --steps {BIG}", "--steps", BIG),
    cli("demo --output-dir ../", "demo", "demo --steps 1 --output-dir ../hfmk_demo_up",
        "../hfmk_demo_up", watch=("{root}/cwd/hfmk_demo_up",)),
    cli("demo --steps 1 (legit run)", "demo", "demo --steps 1", ok=(0,),
        after=output_in("demo_output"), timeout=400),
    # -- API: plan_training ----------------------------------------------------------------------
    api("target_batch_size=10**9", "API plan_training",
        f"{PLAN_ON}target_batch_size=10**9)", "target_batch_size", "1000000000"),
    api("target_batch_size=0", "API plan_training", f"{PLAN_ON}target_batch_size=0)",
        "target_batch_size", "got 0"),
    api("target_batch_size=True", "API plan_training", f"{PLAN_ON}target_batch_size=True)",
        "target_batch_size", "True"),
    api("target_batch_size='8'", "API plan_training", f"{PLAN_ON}target_batch_size='8')",
        "target_batch_size", "'8'"),
    api("num_gpus=10**7", "API plan_training", f"{PLAN_ON}target_batch_size=8, num_gpus=10**7)",
        "num_gpus", "131072"),
    api("micro_batch=10**12", "API plan_training",
        f"{PLAN_ON}target_batch_size=8, micro_batch=10**12)", "micro_batch", "1048576"),
    api("parallelism_config='garbage'", "API plan_training",
        f"{PLAN_ON}target_batch_size=8, parallelism_config='garbage')", "parallelism_config"),
    api("parallelism_config={'cp_size': -1}", "API plan_training",
        f"{PLAN_ON}target_batch_size=8, parallelism_config={{'cp_size': -1}})",
        "parallelism_config", "-1"),
    api("unknown constraint", "API plan_training",
        f"{PLAN_ON}target_batch_size=8, learning_rat=1e-4)", "learning_rat"),
    # -- API: estimate_memory / reverse queries / devices / models ----------------------------
    api("estimate_memory micro-batch 10**12", "API estimate_memory",
        "mk.estimate_memory(tiny(), {'per_device_train_batch_size': 10**12}, seq_len=64, "
        "device='A100-80GB')", "per_device_train_batch_size", "1000000000000"),
    api("seq_len=0", "API estimate_memory",
        "mk.estimate_memory(tiny(), seq_len=0, device='cpu')", "seq_len", "got 0"),
    api("seq_len=2**30", "API estimate_memory",
        "mk.estimate_memory(tiny(), seq_len=2**30, device='cpu')", "seq_len", "1073741824"),
    api("max_memory='-5GiB'", "API estimate_memory",
        "mk.estimate_memory(tiny(), seq_len=8, device='cpu', max_memory='-5GiB')", "max_memory",
        "-5GiB"),
    api("headroom=1.5", "API estimate_memory",
        "mk.estimate_memory(tiny(), seq_len=8, device='cpu', headroom=1.5)", "headroom", "1.5"),
    api("dtype='int8'", "API estimate_memory",
        "mk.estimate_memory(tiny(), seq_len=8, device='cpu', dtype='int8')", "int8"),
    api("device='A100-90GB'", "API estimate_memory",
        "mk.estimate_memory(tiny(), seq_len=8, device='A100-90GB')", "A100-90GB"),
    api("lengths=[-1, 5]", "API estimate_memory",
        "mk.estimate_memory(tiny(), device='cpu', lengths=[-1, 5])", "lengths", "-1"),
    api("model=None", "API estimate_memory", "mk.estimate_memory(None, seq_len=8, device='cpu')",
        "None"),
    api("model='/dev/zero'", "API estimate_memory",
        "mk.estimate_memory('/dev/zero', seq_len=8, device='cpu')", "/dev/zero"),
    api("max_seq_len limit=10**30 (a bound, not a length)", "API reverse",
        "mk.max_seq_len(tiny(), device='cpu', limit=10**30)", ok=(0,),
        check="isinstance(result, int) and 64 <= result <= 2**24"),
    api("auto_training_args base_args='x'", "API reverse",
        "mk.auto_training_args(tiny(), base_args='x', seq_len=64, target_batch_size=8, "
        "device='cpu')", "base_args"),
    api("get_device('A100-90GB')", "API devices", "mk.get_device('A100-90GB')", "A100-90GB"),
    api("probe_device(index=-1)", "API devices", "mk.probe_device(index=-1)", "-1"),
    api("profile_model(10**6 layers)", "API models", "mk.profile_model('{fix}/deep')",
        "num_hidden_layers=1000000"),
    # -- API: Plan.from_json / to_training_args ------------------------------------------------
    api("from_json nested 10**5 deep", "API Plan.from_json",
        "mk.Plan.from_json('[' * 100000 + ']' * 100000)", "nests too deep"),
    api("from_json of bytes not UTF-8", "API Plan.from_json", "mk.Plan.from_json(b'\\xff\\xfe')",
        "does not parse"),
    api("from_json push_to_hub injected", "API Plan.from_json",
        "mk.Plan.from_json(plan_json(push_to_hub=True))", "training_args_kwargs.push_to_hub"),
    api("from_json hub_model_id injected", "API Plan.from_json",
        "mk.Plan.from_json(plan_json(hub_model_id='someone/stolen'))",
        "training_args_kwargs.hub_model_id"),
    api("from_json report_to injected", "API Plan.from_json",
        "mk.Plan.from_json(plan_json(report_to=['wandb']))", "training_args_kwargs.report_to"),
    api("from_json output_dir injected", "API Plan.from_json",
        "mk.Plan.from_json(plan_json(output_dir='/etc/hfmk_plan'))",
        "training_args_kwargs.output_dir", watch=("/etc/hfmk_plan",)),
    api("from_json learning_rate 'abc' injected", "API Plan.from_json",
        "mk.Plan.from_json(plan_json(learning_rate='abc'))", "learning_rate", "'abc'"),
    api("from_json of the plan (legit round trip)", "API Plan.from_json",
        "mk.Plan.from_json(plan_json())", ok=(0,),
        check="result.training_args_kwargs == json.load(open(FIX + '/plan.json'))"
              "['training_args_kwargs']"),
    api("to_training_args(output_dir=X) over a pinned output_dir", "API Plan.to_training_args",
        "p = mk.plan_training(tiny(), device='cpu', seq_len=64, target_batch_size=8, "
        "output_dir=CWD + '/planned'); result = p.to_training_args(output_dir=CWD + '/mine', "
        "use_cpu=True, report_to=[])", ok=(0,),
        check="result.output_dir == CWD + '/mine' and not os.path.exists(CWD + '/planned')"),
    # -- API: recipes, callbacks ---------------------------------------------------------------
    api("load_recipe(FIFO)", "API load_recipe", "mk.load_recipe('{fix}/fifo')", "fifo", "FIFO"),
    api("load_recipe(billion laughs)", "API load_recipe", "mk.load_recipe(CWD + '/r.yaml')",
        "10000 values",
        setup=recipe(replace={"callbacks: [memory, throughput]": f"callbacks: {bomb()}"})),
    api("load_recipe(b'...yaml')", "API load_recipe", "mk.load_recipe(b'r.yaml')", "bytes"),
    api("MemoryCallback(max_entries=-1)", "API callbacks",
        "mk.MemoryCallback(record_history=True, max_entries=-1)", "max_entries", "-1"),
    api("MemoryCallback(estimate='garbage')", "API callbacks",
        "mk.MemoryCallback(estimate='garbage')", "estimate", "garbage"),
    api("ThroughputCallback(device='A100-90GB')", "API callbacks",
        "mk.ThroughputCallback(device='A100-90GB')", "A100-90GB"),
    api("OOMGuardTrainer(max_oom_recoveries=-1)", "API callbacks",
        "import torch, transformers; mk.OOMGuardTrainer(model=torch.nn.Linear(2, 2), "
        "args=transformers.TrainingArguments(output_dir=CWD + '/o', use_cpu=True, report_to=[]),"
        " max_oom_recoveries=-1)", "max_oom_recoveries", "-1"),
]


# ----------------------------------------------------------------------------------------------
# Running a case
# ----------------------------------------------------------------------------------------------

CHILD = r'''
import json, os, sys, time, traceback, warnings
warnings.simplefilter("ignore")
spec = json.loads(sys.stdin.read())
FIX, CWD = spec["fix"], spec["cwd"]
import hf_memkit as mk
for name in mk.__all__:                      # the names the call uses, imported before the clock
    if name in spec["code"] or name in spec["check"]:
        getattr(mk, name)
from transformers import LlamaConfig

def tiny(**kw):
    return LlamaConfig(**{**spec["tiny"], **kw})

def plan_json(**inject):
    d = json.load(open(FIX + "/plan.json"))
    d["training_args_kwargs"].update(inject)
    return json.dumps(d)

ns = dict(mk=mk, tiny=tiny, plan_json=plan_json, FIX=FIX, CWD=CWD, json=json, os=os)
code = spec["code"]
if "result =" not in code:
    code = "result = " + code if "\n" not in code and ";" not in code else code
t0 = time.process_time()
ok = None
try:
    exec(compile(code, "<case>", "exec"), ns)
    kind, msg = "returned", repr(ns.get("result"))[:400]
    if spec["check"]:
        ok = bool(eval(spec["check"], ns))
except mk.HfMemkitError as exc:
    kind, msg = "refused", f"{type(exc).__name__}: {exc}"
except BaseException as exc:  # noqa: BLE001 - every other exception is the finding
    kind, msg = "raised", traceback.format_exc()[-4000:]
print("MARK" + json.dumps(dict(kind=kind, msg=msg, ok=ok, call_cpu=time.process_time() - t0)))
'''.replace("MARK", MARK)


def fill(text: str, where: dict[str, str]) -> str:
    for key, value in where.items():
        text = text.replace("{" + key + "}", value)
    return text


def hf_memkit_cli() -> list[str]:
    script = Path(sys.executable).with_name("hf-memkit")
    return [str(script)] if script.exists() else [sys.executable, "-m",
                                                    "hf_memkit.commands.main"]


def base_env(root: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_MEMKIT")}
    for d in ("home", "xdg", "mpl", "tmpdir", "cache"):
        (root / d).mkdir(exist_ok=True)
    env.update(HOME=str(root / "home"), XDG_CACHE_HOME=str(root / "xdg"),
               MPLCONFIGDIR=str(root / "mpl"), TMPDIR=str(root / "tmpdir"),
               HF_MEMKIT_CACHE=str(root / "cache"), HF_MEMKIT_NO_CACHE="1", HF_HUB_OFFLINE="1",
               PYTHONDONTWRITEBYTECODE="1", COLUMNS="250", PYTHONPATH=str(REPO))
    return env


SCRATCH = ("cache", "xdg", "mpl", "tmpdir")


def snapshot(root: Path, cwd: Path) -> set[str]:
    """Every path under ``root`` but the case's working directory and the scratch folders."""
    skip = {str(cwd)} | {str(root / d) for d in SCRATCH}
    seen: set[str] = set()
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if os.path.join(dirpath, d) not in skip]
        seen.update(os.path.join(dirpath, n) for n in dirnames + filenames)
    return seen


def first_line(text: str) -> str:
    """The error line (with the first problem where it is a header), else the first line with
    words (not a rule or a table border)."""
    lines = [ln.strip(" │┃─━┌┐└┘┏┓┗┛") for ln in text.splitlines()]
    lines = [ln for ln in lines if sum(c.isalpha() for c in ln) >= 3]
    at = next((i for i, ln in enumerate(lines)
               if ": error:" in ln or ln.startswith(("HfMemkitError", "ConfigError"))), 0)
    if not lines:
        return ""
    ln = lines[at]
    if ln.endswith(":") and at + 1 < len(lines):   # "N problem(s) in X:", then the first
        ln += " " + lines[at + 1]
    return ln


def visible(text: str) -> str:
    """``text`` with control characters (terminal escapes among them) written as ``\\xNN``:
    what the results quote of a message is safe to print."""
    return "".join(c if c.isprintable() or c in "\n\t" else f"\\x{ord(c):02x}" for c in text)


def last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1] if lines else ""


def run_case(case: Case, root: Path, index: int, env0: dict[str, str]) -> dict:
    cwd = root / "cwd" / f"{index:03d}"
    cwd.mkdir(parents=True)
    where = {"fix": str(root / "fix"), "root": str(root), "cwd": str(cwd)}
    if case.setup is not None:
        case.setup(cwd, root)
        for p in cwd.glob("*.yaml"):      # placeholders inside written recipes
            if p.is_file() and p.stat().st_size < 2**20:
                p.write_text(fill(p.read_text(errors="surrogateescape"), where),
                             errors="surrogateescape")
    watch = [fill(w, where) for w in case.watch]
    stale = [w for w in watch if os.path.lexists(w)]
    if stale:
        raise SystemExit(f"{case.name}: {stale} exist before the case runs; remove them first")
    env = dict(env0, **{k: fill(v, where) for k, v in case.env.items()})
    if case.api:
        code = fill(case.run, where)
        cmd = [sys.executable, "-c", CHILD]
        stdin = json.dumps(dict(code=code, check=case.check, fix=where["fix"], cwd=str(cwd),
                                tiny={k: v for k, v in TINY_CFG.items() if k != "model_type"}))
        shown = code
    else:
        argv = [fill(a, where) for a in case.run]
        cmd = [*hf_memkit_cli(), *argv]
        stdin = None
        shown = "hf-memkit " + shlex.join(argv)
    before = snapshot(root, cwd)
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, start_new_session=True, text=True,
                            stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, errors="replace")
    hung = False
    try:
        out, err = proc.communicate(stdin, timeout=case.timeout)
    except subprocess.TimeoutExpired:
        hung = True
        os.killpg(proc.pid, signal.SIGKILL)      # the group this case's process leads
        out, err = proc.communicate()
    wall = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    wrote = sorted(snapshot(root, cwd) ^ before)
    hostile = [w for w in watch if os.path.lexists(w)]
    for w in hostile:                             # what this case made at a hostile path
        shutil.rmtree(w, ignore_errors=True) if os.path.isdir(w) and not os.path.islink(w) \
            else os.unlink(w)
    problem = case.after(cwd, root) if case.after is not None else None
    row = dict(case=case.name, surface=case.surface, command=shown, expect="refuse"
               if case.refuse else f"work (exit {case.ok})", exit=proc.returncode,
               cpu_s=round(cpu, 3), wall_s=round(wall, 2), call_cpu_s=None, says=list(case.says))
    case = dataclasses.replace(case, says=tuple(fill(s, where) for s in case.says))
    outcome, message = classify(case, proc.returncode, out, err, hung)
    if case.api:
        got = next((json.loads(ln[len(MARK):]) for ln in out.splitlines()
                    if ln.startswith(MARK)), None)
        if got is not None:
            row["call_cpu_s"] = round(got["call_cpu"], 3)
    if outcome != "hang" and (hostile or problem or wrote):
        outcome = "wrote outside"
        message = "; ".join([*(f"created {w}" for w in hostile), *([problem] if problem else []),
                             *(f"changed {w}" for w in wrote[:3])]) + f" | {message}"
    row.update(outcome=outcome, message=visible(message[:300]), command=visible(shown))
    return row


def classify(case: Case, code: int, out: str, err: str, hung: bool) -> tuple[str, str]:
    if hung:
        return "hang", f"killed after {case.timeout} s; stderr: {last_line(err)}"
    if case.api:
        return classify_api(case, code, out, err)
    if "Traceback (most recent call last)" in err:
        return "traceback", last_line(err)
    if code not in (0, 1, 2, 3):
        return "traceback", f"exit {code}: {last_line(err)}"
    if case.refuse:
        if code != 2:
            return "silently wrong", f"exit {code}: {first_line(err) or first_line(out)}"
        msg = first_line(err)
        if any(c in err for c in ("\x1b", "\x07", "\x9b")):
            return "unclear", "raw terminal control characters on stderr | " + msg
        missing = [s for s in case.says if s not in err]
        return ("unclear", f"missing {missing} | {msg}") if missing else ("clear error", msg)
    if code == 2:
        return "wrongly refused", first_line(err)
    missing = [s for s in case.out if s not in out + err]
    if code not in case.ok or missing:
        return "wrong result", f"exit {code}, missing {missing} | {first_line(err) or first_line(out)}"
    warn = next((ln for ln in err.splitlines() if "warning" in ln), "")
    return "handled", f"exit {code}: {(warn or first_line(out))}".strip()


def classify_api(case: Case, code: int, out: str, err: str) -> tuple[str, str]:
    got = next((json.loads(ln[len(MARK):]) for ln in out.splitlines() if ln.startswith(MARK)),
               None)
    if got is None:
        return "traceback", f"exit {code}, no result: {last_line(err)}"
    kind, msg = got["kind"], got["msg"]
    if kind == "raised":
        return "traceback", last_line(msg)
    if kind == "refused":
        if not case.refuse:
            return "wrongly refused", first_line(msg)
        missing = [s for s in case.says if s not in msg]
        return ("unclear", f"missing {missing} | {first_line(msg)}") if missing else \
            ("clear error", first_line(msg))
    if case.refuse:
        return "silently wrong", f"returned {msg}"
    if case.check and not got["ok"]:
        return "wrong result", f"check failed: {case.check} | {msg}"
    return "handled", f"returned {msg}"


# ----------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------

def make_plan_fixture(root: Path, env: dict[str, str]) -> None:
    """``fix/plan.json``: a real plan's JSON, for the from_json cases."""
    case = api("plan fixture", "fixture",
               f"{PLAN_ON}target_batch_size=8); open(CWD + '/plan.json', 'w').write(p.to_json());"
               " result = 1", ok=(0,))
    row = run_case(case, root, 999, env)
    if row["outcome"] != "handled":
        raise SystemExit(f"could not make the plan fixture: {row['message']}")
    shutil.move(root / "cwd" / "999" / "plan.json", root / "fix" / "plan.json")


def write_results(rows: list[dict], out_dir: Path, total_s: float) -> tuple[Counter, dict]:
    counts = Counter(r["outcome"] for r in rows)
    refused = [r for r in rows if r["outcome"] == "clear error"]
    speed = {"refused": len(refused),
             "under_1s_cpu": sum(r["cpu_s"] < 1 for r in refused),
             "under_15s_cpu": sum(r["cpu_s"] < 15 for r in refused),
             "api_call_under_1s_cpu": sum((r["call_cpu_s"] or 0) < 1 for r in refused
                                          if r["call_cpu_s"] is not None),
             "api_refused": sum(r["call_cpu_s"] is not None for r in refused),
             "total_wall_s": round(total_s, 1)}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bad_input.json").write_text(json.dumps(
        {"counts": dict(counts), "speed": speed, "cases": rows}, indent=1, ensure_ascii=False)
        + "\n")

    def cell(text: object) -> str:
        return (str(text).replace("|", "\\|").replace("\n", " ").replace("`", "'")
                .replace("*", "\\*"))

    lines = ["# Bad input: every user-facing input of hf-memkit and its API",
             "", "Written by `python bench/bad_input.py` (see its docstring for the outcomes).",
             "", "Counts: " + ", ".join(f"{k} {counts[k]}" for k in OUTCOMES if counts[k]),
             "", f"Refused with a clear error: {speed['refused']}; under 1 s of CPU: "
             f"{speed['under_1s_cpu']}, under 15 s: {speed['under_15s_cpu']} (the whole "
             f"process; API cases import torch and transformers first: of "
             f"{speed['api_refused']} API refusals, {speed['api_call_under_1s_cpu']} took "
             f"under 1 s of CPU in the call itself). Total wall time {speed['total_wall_s']} s.",
             "", "| case | surface | outcome | CPU s | first line of the message |",
             "|---|---|---|---|---|"]
    for r in rows:
        cpu = f"{r['cpu_s']:.2f}" + (f" (call {r['call_cpu_s']:.2f})" if r["call_cpu_s"]
                                     is not None else "")
        lines.append(f"| {cell(r['case'])} | {r['surface']} | {r['outcome']} | {cpu} | "
                     f"{cell(r['message'][:160])} |")
    bad = [r for r in rows if r["outcome"] not in ("clear error", "handled")]
    lines += ["", f"## Neither a clear error nor handled ({len(bad)})", ""]
    for r in bad:
        how = "API call" if r["call_cpu_s"] is not None else f"exit {r['exit']}"
        command = r["command"][:400].replace("`", "'")
        lines += [f"- **{cell(r['case'])}** ({r['surface']}): {r['outcome']}, {how}, "
                  f"{r['cpu_s']:.2f} s CPU", f"  - `{command}`",
                  f"  - {cell(r['message'])}"]
    (out_dir / "bad_input.md").write_text("\n".join(lines) + "\n")
    return counts, speed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", action="append", default=[],
                    help="run the cases whose name or surface holds this (repeatable)")
    ap.add_argument("--again", metavar="JSON", default=None,
                    help="run the cases of an earlier results file that were neither a clear "
                         "error nor handled")
    ap.add_argument("--keep", action="store_true", help="keep the temporary folder")
    ap.add_argument("--out", default=None,
                    help="folder of the results (default bench/results; --quick: required)")
    add_flag(ap)
    a = ap.parse_args(argv)
    guard(a.quick, a.out, "--out")
    a.out = a.out or str(HERE / "results")
    only = list(a.only) + (list(QUICK) if a.quick and not a.only else [])
    if a.again:
        only += [r["case"] for r in json.loads(Path(a.again).read_text())["cases"]
                 if r["outcome"] not in ("clear error", "handled")]
    exact = a.again or (a.quick and not a.only)
    cases = [c for c in CASES if not only or any(o == c.name or (not exact and
                                                 (o in c.name or o in c.surface)) for o in only)]
    root = Path(tempfile.mkdtemp(prefix="hf_memkit-bad-input-")).resolve()
    t0 = time.perf_counter()
    try:
        fixtures(root / "fix")
        env = base_env(root)
        if any("plan_json(" in c.run for c in cases if c.api):
            make_plan_fixture(root, env)
        rows = []
        for i, case in enumerate(cases):
            row = run_case(case, root, i, env)
            rows.append(row)
            print(f"[{i + 1}/{len(cases)}] {row['outcome']:<15} {row['cpu_s']:7.2f} s  "
                  f"{case.surface}: {case.name}: {row['message'][:110]}", flush=True)
    finally:
        if a.keep:
            print(f"kept {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    counts, speed = write_results(rows, Path(a.out), time.perf_counter() - t0)
    print("\n" + ", ".join(f"{k}: {counts[k]}" for k in OUTCOMES if counts[k]))
    print(f"clear errors: {speed['refused']}, under 1 s of CPU: {speed['under_1s_cpu']}, "
          f"under 15 s: {speed['under_15s_cpu']}; total {speed['total_wall_s']} s")
    print(f"wrote {Path(a.out) / 'bad_input.md'} and {Path(a.out) / 'bad_input.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
