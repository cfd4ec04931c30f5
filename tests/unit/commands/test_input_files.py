"""Files a user names on the command line or in a recipe (issue 28): a FIFO or a device is
refused at once rather than read forever, sizes are capped, binary or non-JSON content is a clear
error (exit 2, never a traceback), messages quote at most a short excerpt of what they read, and
the warnings our own traces make torch raise are not shown."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from hf_memkit._compat import quiet_notices
from tests.unit.commands.test_bad_input import RECIPE_HEAD, cli

# a bundled model: every check below refuses before any model is built or traced
MODEL = "gpt2"

def test_a_fifo_given_as_lengths_is_refused_at_once(tmp_path):
    """It waited forever for a writer; a real FIFO, in a process that must end in time."""
    fifo = tmp_path / "lengths.fifo"
    os.mkfifo(fifo)
    r = subprocess.run([sys.executable, "-m", "hf_memkit.commands.main", "estimate",
                        MODEL, "--gpu", "cpu", "--lengths", str(fifo)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert (f"--lengths {fifo} is a FIFO (named pipe), not a regular file (reading it could "
            "wait forever or never end); give a file of the rows' token counts, one per line "
            "or a JSON list, saved as a regular file") in r.stderr


@pytest.mark.parametrize("name, make, says", [
    ("dev_zero", lambda p: Path("/dev/zero"), "--lengths /dev/zero is a device, not a regular "
                                              "file"),
    ("directory", lambda p: p, "is a directory; give a file of the rows' token counts"),
    ("huge", lambda p: _sparse(p / "big.txt", 256 * 2**20 + 1),
     "big.txt is larger than 256 MiB, the most hf_memkit reads here; give a file of the rows' "
     "token counts, one per line or a JSON list of at most 256 MiB"),
    ("binary", lambda p: _write(p / "bin", b"\x00\x01\xfe\xff" * 100),
     "bin: not UTF-8 text (byte 0xfe at offset 2)"),
    ("overflowing count", lambda p: _write(p / "l.txt", b"12\n100000000000000000000000000\n"),
     "lengths must be the token counts of the dataset's rows, in dataset order: a list, tuple "
     "or 1-D array of positive integers (at most 16777216 = 2**24 each); got 1 that are not: "
     "[1e+26]"),
    ("5000 digits", lambda p: _write(p / "l.json", b"[" + b"9" * 5000 + b"]"),
     "l.json: not a JSON list of integers (Exceeds the limit"),
    ("long bad line", lambda p: _write(p / "l.txt", b"12\n" + b"x" * 5_000_000 + b"\n"),
     "l.txt, line 2: 'xxxxxxxx"),
])
def test_lengths_files_that_cannot_be_counts_exit_2(name, make, says, tmp_path, capsys):
    path = make(tmp_path)
    code, err = cli(["estimate", MODEL, "--gpu", "cpu", "--trainer", "sft",
                     "max_length=none", "padding_free=true", "--lengths", str(path)], capsys)
    assert code == 2 and "Traceback" not in err
    assert says in err, err
    assert len(err) < 1000  # at most an excerpt of the file


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def _sparse(path: Path, size: int) -> Path:
    with open(path, "wb") as f:
        f.truncate(size)
    return path


@pytest.mark.parametrize("content, says", [
    (b"not json {", "deepspeed={} is not valid JSON (line 1, column 1: Expecting value); give "
                    "deepspeed a dict, or the path of a JSON file holding one object"),
    (b"[1, 2]", "deepspeed={} holds a JSON list, not an object"),
    (b"\xff\xfe{}", "deepspeed={} is not UTF-8 text (byte 0xff at offset 0)"),
])
def test_a_deepspeed_pin_that_is_not_a_json_object_exits_2(content, says, tmp_path, capsys):
    f = _write(tmp_path / "ds.json", content)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(RECIPE_HEAD.replace("{device: cpu}", "{device: A100-80GB, num_gpus: 2}")
                      + f"pins: {{deepspeed: {f}}}\n")
    for argv in (["recipes", "validate", str(recipe)], ["plan", str(recipe)],
                 ["estimate", "gpt2", "--gpu", "A100-80GB", "--num-gpus", "2", "--seq-len",
                  "64", f"deepspeed={f}"]):
        code, err = cli(argv, capsys)
        assert code == 2 and "Traceback" not in err, argv
        assert says.format(f) in err, (argv, err)
    fifo = tmp_path / "ds.fifo"
    os.mkfifo(fifo)
    code, err = cli(["estimate", "gpt2", "--gpu", "A100-80GB", "--num-gpus", "2", "--seq-len",
                     "64", f"deepspeed={fifo}"], capsys)
    assert code == 2 and f"deepspeed={fifo} is a FIFO (named pipe), not a regular file" in err


def test_validating_a_file_that_is_no_recipe_echoes_none_of_it(tmp_path, capsys):
    shadow = tmp_path / "shadow"
    shadow.write_text("root:$6$abcdefgh$secrethash:19000:0:99999:7:::\n"
                      "daemon:*:19000:0:99999:7:::\n")
    code, err = cli(["recipes", "validate", str(shadow)], capsys)
    assert code == 2
    assert (f"{shadow}: not a recipe: none of its 2 top-level key(s) is a recipe key "
            "(callbacks, data, hardware, model, output_dir, pins, trainer, training)") in err
    assert "secrethash" not in err and "daemon" not in err


@pytest.mark.parametrize("line", [
    "{big}: 1",                        # YAML's own error (a simple key: 1024 characters at most)
    "{kib}: 1",                        # an unknown key
    "trainer: {big}",                  # an unknown trainer
    "callbacks: [{big}]",
    "data: {big}",                     # no such file (a name too long for the file system)
    "pins: {{optim: {big}}}",
    "pins: {{learning_rate: {big}}}",
])
def test_a_bad_line_near_the_size_cap_is_quoted_as_an_excerpt(line, tmp_path, capsys):
    """A line of 900 KB (a recipe file is read up to 1 MiB: _recipe.load.RECIPE_CAP)."""
    p = tmp_path / "r.yaml"
    p.write_text(RECIPE_HEAD + line.format(big="x" * 900_000, kib="x" * 1000) + "\n")
    code, err = cli(["recipes", "validate", str(p)], capsys)
    assert code == 2 and "Traceback" not in err
    assert len(err) < 2000 and "x" * 81 not in err
    assert "x" * 78 + "…" in err or "not valid YAML" in err  # repr quotes: 78 of 80


def test_a_model_name_of_900kb_is_quoted_as_an_excerpt(tmp_path, capsys):
    p = tmp_path / "r.yaml"
    p.write_text(RECIPE_HEAD.replace("Llama-3.2-1B", "y" * 900_000))
    code, err = cli(["recipes", "validate", str(p)], capsys)
    assert code == 2 and "Traceback" not in err
    assert "model.name: unknown model `" + "y" * 79 + "…`" in err and len(err) < 2000


def test_max_memory_zero_on_the_command_line_names_the_value(capsys):
    code, err = cli(["plan", MODEL, "--gpu", "T4", "--seq-len", "64",
                     "--target-batch", "8", "--max-memory", "0"], capsys)
    assert code == 2
    assert "max_memory='0' is a budget of 0 bytes, in which nothing fits" in err
    assert "T4 has" not in err


def test_bert_commands_print_no_torch_warnings(capsys):
    """MemTracker's "Module is None. Skipping PRE_BW hook." lines on every BERT estimate and
    twice per plan candidate; filtered by exact message, category and module, nothing else."""
    code, err = cli(["estimate", "bert-base-uncased", "--gpu", "T4", "--seq-len", "128",
                     "--batch", "8", "--json"], capsys)
    assert code == 0 and err == ""
    code, err = cli(["plan", "bert-base-uncased", "--gpu", "T4", "--seq-len", "128",
                     "--target-batch", "32", "--json"], capsys)
    assert code == 0 and err == ""


def test_the_trace_warning_filter_is_exact_and_only_around_our_calls():
    module = "torch.distributed._tools.mod_tracker"

    def raise_it(message: str, module: str = module) -> None:
        warnings.warn_explicit(message, UserWarning, "mod_tracker.py", 1, module=module)

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with quiet_notices():
            raise_it("Module is None. Skipping PRE_BW hook.")           # ours: dropped
            raise_it("Module is None. Skipping PRE_BW hook. (more)")    # not exact: shown
            raise_it("Module is None. Skipping PRE_BW hook.", "mypkg")  # another module: shown
        raise_it("Module is None. Skipping POST_BW hook.")              # outside: shown
    assert [(str(w.message), w.filename) for w in seen] == [
        ("Module is None. Skipping PRE_BW hook. (more)", "mod_tracker.py"),
        ("Module is None. Skipping PRE_BW hook.", "mod_tracker.py"),
        ("Module is None. Skipping POST_BW hook.", "mod_tracker.py")]
