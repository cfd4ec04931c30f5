"""``hf-memkit plan`` asked the same question again answers with what it printed the first time
(``commands/_answers``), without planning again; any change to what the answer depends on plans
again, and questions whose input may change between runs are never kept."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from hf_memkit.commands.main import main

QUESTION = ["plan", "gpt2", "--gpu", "T4", "--seq-len", "256", "--target-batch", "8"]


def _run(argv, capsys) -> tuple[int, str, str]:
    rc = main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def test_the_same_question_is_answered_again_without_planning(kept, capsys):
    rc1, out1, err1 = _run(QUESTION, capsys)
    rc2, out2, err2 = _run(QUESTION, capsys)
    assert rc1 == rc2 == 0 and len(kept) == 1          # planned once
    assert out2 == out1 and "CHOSEN" in out1           # the same tables, as printed
    assert "the answer kept from" in err2 and "--no-cache" in err2
    assert "kept" not in err1
    # JSON is another question (other output), then kept as well
    _run([*QUESTION, "--json"], capsys)
    rc3, out3, _ = _run([*QUESTION, "--json"], capsys)
    assert rc3 == 0 and len(kept) == 2 and out3.lstrip().startswith("{")


def test_what_the_first_answer_said_on_stderr_is_said_again(kept, capsys):
    question = [*QUESTION, "--max-memory", "12GiB", "--headroom", "0.2"]
    _, _, err1 = _run(question, capsys)
    _, _, err2 = _run(question, capsys)
    assert "--headroom 0.2 is ignored" in err1
    assert err2.startswith(err1) and len(kept) == 1


@pytest.mark.parametrize("argv, env", [
    ([*QUESTION[:-1], "16"], {}),                                # another option's value
    ([*QUESTION, "optim=adafactor"], {}),                        # a FIELD=VALUE setting
    (QUESTION, {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}),  # allocator options
    (QUESTION, {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}),         # cuBLAS's workspaces
])
def test_any_change_to_what_the_answer_depends_on_plans_again(kept, capsys, monkeypatch,
                                                              argv, env):
    _run(QUESTION, capsys)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    _, _, err = _run(argv, capsys)
    assert len(kept) == 2 and "kept from" not in err


def test_questions_whose_input_may_change_are_never_kept(kept, capsys, tmp_path):
    # --no-cache; the GPU of this machine (no --gpu); a local model directory
    local = tmp_path / "gpt2"
    local.mkdir()
    (local / "config.json").write_text('{"model_type": "gpt2", "n_layer": 2, "n_embd": 64, '
                                       '"n_head": 2, "vocab_size": 1000, "n_positions": 512}')
    for argv in ([*QUESTION, "--no-cache"], ["plan", "gpt2", "--seq-len", "256",
                                              "--target-batch", "8"],
                 ["plan", str(local), "--gpu", "T4", "--seq-len", "256", "--target-batch", "8"]):
        for _ in range(2):
            rc, _, err = _run(argv, capsys)
            assert rc == 0 and "kept from" not in err
    assert len(kept) == 6
    assert not (tmp_path / "cache" / "answers").exists() or \
        not any((tmp_path / "cache" / "answers").iterdir())


def test_a_refused_question_is_not_kept(kept, capsys):
    question = [*QUESTION, "bf16=maybe"]           # refused once TrainingArguments types it
    rc1, _, err1 = _run(question, capsys)
    rc2, _, err2 = _run(question, capsys)
    assert rc1 == rc2 == 2 and "bf16=maybe" in err1 and err2 == err1
    assert not kept


def test_cache_clear_removes_kept_answers(kept, capsys):
    _run(QUESTION, capsys)
    rc, out, _ = _run(["cache", "clear"], capsys)
    assert rc == 0 and "removed 1 kept answer from" in out
    _, _, err = _run(QUESTION, capsys)
    assert len(kept) == 2 and "kept from" not in err


def test_a_kept_answer_is_printed_before_torch_loads(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "HF_MEMKIT_NO_CACHE"}
    env["HF_MEMKIT_CACHE"] = str(tmp_path)
    probe = ("import sys; from hf_memkit.commands.main import main; rc = main(sys.argv[1:]); "
             "print('torch loaded:', 'torch' in sys.modules, file=sys.stderr); sys.exit(rc)")
    runs = [subprocess.run([sys.executable, "-c", probe, *QUESTION], env=env,
                           capture_output=True, text=True, timeout=600) for _ in range(2)]
    assert [r.returncode for r in runs] == [0, 0]
    assert runs[1].stdout == runs[0].stdout
    assert "torch loaded: True" in runs[0].stderr
    assert "torch loaded: False" in runs[1].stderr and "kept from" in runs[1].stderr


def test_the_recording_stream_is_the_terminals_in_all_but_writing():
    """What renders (rich reads ``encoding``, ``isatty``, ``fileno``) sees the real stream."""
    import io

    from hf_memkit.commands._answers import recording

    class Terminal(io.StringIO):
        encoding = "cp1252"

        def isatty(self):
            return True

    real = Terminal()
    saved = sys.stdout
    sys.stdout = real
    try:
        with recording("a key") as rec:
            print("héllo")
            assert sys.stdout.encoding == "cp1252" and sys.stdout.isatty()
    finally:
        sys.stdout = saved
    assert real.getvalue() == rec.out.copy.getvalue() == "héllo\n"


def test_installing_a_package_the_planner_looks_for_plans_again(kept, capsys, monkeypatch,
                                                                 tmp_path):
    """Liger (a technique the plan may switch on) installed after the first answer: asked
    again, the question is planned again, not answered from what was kept without it."""
    _run(QUESTION, capsys)
    (tmp_path / "liger_kernel").mkdir()
    (tmp_path / "liger_kernel" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    _, _, err = _run(QUESTION, capsys)
    assert len(kept) == 2 and "kept from" not in err
