"""Wall time of ``hf-memkit`` commands against ``python -c "import transformers"``, same run.

Each command runs in N fresh processes; the best (shortest) wall time counts, so that other load
on the machine weighs as little as it can. The figures are ratios to the best of
``import transformers`` measured in the same run, so they compare across machines.

Bar (DESIGN.md): ``hf-memkit --help`` within 2.5x of ``import transformers``; the script exits 1
when it is not. ``devices`` (the catalog: no torch) and ``estimate`` (imports torch and
transformers and traces the model) are reported, not gated. Any stderr output is reported too:
our commands print no third-party notices that our own calls trigger.

    python bench/cli_speed.py [--repeat 5] [--estimate-repeat 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

BAR = 2.5
ESTIMATE = ["estimate", "gpt2", "--gpu", "T4", "--seq-len", "512", "--batch", "1"]


def cli() -> list[str]:
    """The ``hf-memkit`` console script of this interpreter's environment, else ``-m``."""
    script = Path(sys.executable).with_name("hf-memkit")
    if script.exists():
        return [str(script)]
    found = shutil.which("hf-memkit")
    return [found] if found else [sys.executable, "-m", "hf_memkit.commands.main"]


def best_of(cmd: list[str], n: int) -> tuple[float, str]:
    """(shortest wall seconds of ``n`` fresh runs, stderr of the last run); raises on failure."""
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    times, err = [], ""
    for _ in range(n):
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        times.append(time.perf_counter() - t0)
        if proc.returncode != 0:
            raise SystemExit(f"`{' '.join(cmd)}` exited {proc.returncode}:\n{proc.stderr[-2000:]}")
        err = proc.stderr
    return min(times), err


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5, help="fresh processes per light command")
    ap.add_argument("--estimate-repeat", type=int, default=3,
                    help="fresh processes for the estimate (0 skips it)")
    a = ap.parse_args(argv)
    base, _ = best_of([sys.executable, "-c", "import transformers"], a.repeat)
    rows = [("hf-memkit --help", *best_of([*cli(), "--help"], a.repeat)),
            ("hf-memkit devices", *best_of([*cli(), "devices"], a.repeat))]
    if a.estimate_repeat:
        rows.append((f"hf-memkit {' '.join(ESTIMATE)}", *best_of([*cli(), *ESTIMATE],
                                                                 a.estimate_repeat)))
    print(f"python -c 'import transformers': {base:.3f} s (best of {a.repeat}; the unit below)")
    width = max(len(name) for name, _, _ in rows)
    for name, seconds, err in rows:
        noise = "stderr empty" if not err.strip() else f"stderr: {err.strip().splitlines()[0]!r}"
        print(f"{name:<{width}}  {seconds:7.3f} s  {seconds / base:5.2f}x  {noise}")
    ratio = rows[0][1] / base
    ok = ratio <= BAR
    print(f"bar (--help <= {BAR}x import transformers): {'met' if ok else 'MISSED'} "
          f"({ratio:.2f}x)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
