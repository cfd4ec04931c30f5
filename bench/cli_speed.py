"""Wall time of ``hf-memkit`` commands against ``python -c "import transformers"``, same run.

Each command runs in N fresh processes; the best (shortest) wall time counts, so that other load
on the machine weighs as little as it can. The figures are ratios to the best of
``import transformers`` measured in the same run, so they compare across machines.

Bars (docs/quality-bars.md, issue 28); the script exits 1 when one is missed:
  * ``hf-memkit --help`` within 2.5x of ``import transformers``;
  * bad input (an unknown model name, an unknown GPU) refused in under 1 s, before any import
    of torch or trace;
  * the same ``hf-memkit plan`` asked twice in fresh processes, what the first keeps on disk
    shared (an empty cache folder first): the second, answered with the first's kept answer
    (``commands/_answers``), at least 5x faster than the first. Reported, not gated: the same
    question with the kept answers removed (the traces kept on disk alone) and a neighbouring
    question (another target batch), which reuses those traces.
``devices`` (the catalog: no torch) and ``estimate`` (imports torch and transformers and traces
the model, the trace cache off) are reported, not gated. Any stderr output is reported too: our
commands print no third-party notices that our own calls trigger. Every run gets a cache folder
of its own (``HF_MEMKIT_CACHE``): the user's is never read or written.

    python bench/cli_speed.py [--repeat 5] [--estimate-repeat 3] [--no-plan] [--json PATH] [--quick]

``--quick``: one process per light command, no estimate, no plan; the bars are reported, not
gated (one run on a busy machine is not a measurement).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _quick import add_flag, guard

BAR = 2.5
BAD_INPUT_BAR_S = 1.0
REPEAT_BAR = 5.0
ESTIMATE = ["estimate", "gpt2", "--gpu", "T4", "--seq-len", "512", "--batch", "1"]
BAD_INPUT = [["plan", "Llama-3.1-9B", "--gpu", "RTX-4090", "--seq-len", "2048",
              "--target-batch", "32", "bf16=true"],
             ["estimate", "gpt2", "--gpu", "RTX-4091", "--seq-len", "512"]]
PLAN = ["plan", "Llama-3.1-8B", "--gpu", "RTX-4090", "--seq-len", "2048", "--target-batch", "32"]
NEIGHBOUR = PLAN[:-1] + ["64"]


def cli() -> list[str]:
    """The ``hf-memkit`` console script of this interpreter's environment, else ``-m``."""
    script = Path(sys.executable).with_name("hf-memkit")
    if script.exists():
        return [str(script)]
    found = shutil.which("hf-memkit")
    return [found] if found else [sys.executable, "-m", "hf_memkit.commands.main"]


def best_of(cmd: list[str], n: int, *, env: dict | None = None,
            code: int = 0) -> tuple[float, str]:
    """(shortest wall seconds of ``n`` fresh runs, stderr of the last run); raises when a run
    exits other than ``code``."""
    env = dict(env or os.environ, HF_HUB_OFFLINE="1")
    times, err = [], ""
    for _ in range(n):
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        times.append(time.perf_counter() - t0)
        if proc.returncode != code:
            raise SystemExit(f"`{' '.join(cmd)}` exited {proc.returncode}:\n{proc.stderr[-2000:]}")
        err = proc.stderr
    return min(times), err


def plan_twice(folder: str) -> list[tuple[str, float, str]]:
    """The same plan in two fresh processes sharing a trace cache that starts empty, then a
    neighbouring question."""
    env = dict(os.environ, HF_MEMKIT_CACHE=folder)
    env.pop("HF_MEMKIT_NO_CACHE", None)
    shown = " ".join(PLAN)
    first = (f"hf-memkit {shown} (empty cache)", *best_of([*cli(), *PLAN], 1, env=env))
    again = (f"hf-memkit {shown} (again: the kept answer)", *best_of([*cli(), *PLAN], 1, env=env))
    shutil.rmtree(os.path.join(folder, "answers"), ignore_errors=True)
    traces = (f"hf-memkit {shown} (again: kept traces only)",
              *best_of([*cli(), *PLAN], 1, env=env))
    near = (f"hf-memkit {' '.join(NEIGHBOUR)} (neighbour)",
            *best_of([*cli(), *NEIGHBOUR], 1, env=env))
    return [first, again, traces, near]


def main(argv: list[str] | None = None) -> int:
    """Time the commands; print the table and the bars, and write ``--json``.

    Args:
        argv: the command line (default ``sys.argv[1:]``).

    Returns:
        The exit status: 1 where a bar is missed (not under ``--quick``), else 0.
    """
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5, help="fresh processes per light command")
    ap.add_argument("--estimate-repeat", type=int, default=3,
                    help="fresh processes for the estimate (0 skips it)")
    ap.add_argument("--no-plan", action="store_true",
                    help="skip the repeated plan (about a minute on 2 cores)")
    ap.add_argument("--json", help="write every command's time and the bars here")
    add_flag(ap)
    a = ap.parse_args(argv)
    guard(a.quick, a.json, "--json")
    if a.quick:
        a.repeat, a.estimate_repeat, a.no_plan = 1, 0, True
    folder = tempfile.mkdtemp(prefix="hf_memkit-cli-speed-")
    try:
        return _run(a, folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _run(a: argparse.Namespace, folder: str) -> int:
    quiet = dict(os.environ, HF_MEMKIT_CACHE=os.path.join(folder, "off"), HF_MEMKIT_NO_CACHE="1")
    base, _ = best_of([sys.executable, "-c", "import transformers"], a.repeat)
    rows = [("hf-memkit --help", *best_of([*cli(), "--help"], a.repeat, env=quiet)),
            ("hf-memkit devices", *best_of([*cli(), "devices"], a.repeat, env=quiet))]
    bad = [(f"hf-memkit {' '.join(cmd)} (bad input)",
            *best_of([*cli(), *cmd], a.repeat, env=quiet, code=2)) for cmd in BAD_INPUT]
    rows += bad
    if a.estimate_repeat:
        rows.append((f"hf-memkit {' '.join(ESTIMATE)}",
                     *best_of([*cli(), *ESTIMATE], a.estimate_repeat, env=quiet)))
    plans = [] if a.no_plan else plan_twice(os.path.join(folder, "plan"))
    rows += plans
    print(f"python -c 'import transformers': {base:.3f} s (best of {a.repeat}; the unit below)")
    width = max(len(name) for name, _, _ in rows)
    for name, seconds, err in rows:
        noise = "stderr empty" if not err.strip() else f"stderr: {err.strip().splitlines()[0]!r}"
        print(f"{name:<{width}}  {seconds:7.3f} s  {seconds / base:5.2f}x  "
              f"{noise[:100]}")
    ratio = rows[0][1] / base
    ok = ratio <= BAR
    print(f"bar (--help <= {BAR}x import transformers): {'met' if ok else 'MISSED'} "
          f"({ratio:.2f}x)")
    worst = max(seconds for _, seconds, _ in bad)
    ok &= worst < BAD_INPUT_BAR_S
    print(f"bar (bad input refused in < {BAD_INPUT_BAR_S:g} s): "
          f"{'met' if worst < BAD_INPUT_BAR_S else 'MISSED'} (slowest {worst:.3f} s)")
    if plans:
        (_, first, _), (_, again, _), (_, traces, _), (_, near, _) = plans
        met = first / again >= REPEAT_BAR
        ok &= met
        print(f"bar (the same plan again >= {REPEAT_BAR:g}x faster, the answer kept on disk): "
              f"{'met' if met else 'MISSED'} ({first:.1f} s / {again:.2f} s = "
              f"{first / again:.1f}x); with the kept traces alone: {traces:.1f} s, "
              f"{first / traces:.1f}x; a neighbouring question (target batch 64): "
              f"{near:.1f} s, {first / near:.1f}x faster than the first")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"quick": a.quick, "import_transformers_s": base,
                       "commands": [{"command": name, "seconds": sec, "ratio": sec / base,
                                     "stderr": err} for name, sec, err in rows],
                       "bars_met": ok}, f, indent=1)
    return 0 if ok or a.quick else 1


if __name__ == "__main__":
    sys.exit(main())
