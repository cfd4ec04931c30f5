"""``hf-memkit plan`` says what it is doing on a terminal, at once and per setup, and nothing
when its output goes to a pipe or is JSON."""

from __future__ import annotations

import os
import pty
import select
import subprocess
import sys
import time
from pathlib import Path

HF_MEMKIT = str(Path(sys.executable).parent / "hf-memkit")
PLAN = ["plan", "gpt2", "--gpu", "T4", "--seq-len", "512", "--target-batch", "8", "--no-cache"]


def test_a_terminal_sees_the_status_within_a_second_and_each_setup(tmp_path):
    main, follower = pty.openpty()
    start = time.monotonic()
    proc = subprocess.Popen([HF_MEMKIT, *PLAN], stdout=subprocess.PIPE, stderr=follower,
                            stdin=subprocess.DEVNULL, cwd=tmp_path)
    os.close(follower)
    seen, first = b"", None
    while True:
        ready, _, _ = select.select([main], [], [], 0.05)
        if ready:
            try:
                chunk = os.read(main, 65536)
            except OSError:   # the terminal closed: the command ended
                break
            if not chunk:
                break
            seen += chunk
            if first is None and b"hf-memkit plan:" in seen:
                first = time.monotonic() - start
        elif proc.poll() is not None:
            break
    out = proc.communicate(timeout=600)[0]
    os.close(main)
    assert proc.returncode == 0
    assert first is not None and first < 3.0, first   # ~0.5 s on an idle 2-core machine
    text = seen.decode(errors="replace")
    assert "tracing GPT2LMHeadModel" in text and "estimating " in text and "setup(s) so far" in text
    assert b"hf-memkit plan" in out        # the plan itself, on stdout


def test_a_pipe_or_json_gets_no_status(tmp_path):
    for extra in ([], ["--json"]):
        r = subprocess.run([HF_MEMKIT, *PLAN, *extra], capture_output=True, text=True,
                           cwd=tmp_path, timeout=600)
        assert r.returncode == 0, r.stderr[-2000:]
        assert "estimating" not in r.stderr and "tracing" not in r.stderr
