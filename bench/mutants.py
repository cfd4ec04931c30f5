"""Realistic bugs ("mutants") put into the estimator one at a time: each must fail the tests named
for it (issue 45).

For each mutant: the working tree (tracked files and untracked ones git does not ignore; never
``.venv``) is copied to a temporary folder, the mutant's ``find`` text is replaced there (it must
occur exactly once: a refactor that moves the code fails this bench loudly instead of making the
mutant a no-op), and the named tests run with this interpreter from inside the copy, the copy
first on ``PYTHONPATH`` (the first run prints which ``hf_memkit`` it imports, to show it is the
copy's). A mutant is *caught* when pytest fails (exit status 1: a test failed); *missed* when the
tests pass; any other status (a collection error, an interrupted run) is an error. The
repository itself is never changed.

    python bench/mutants.py [--only NAME ...] [--json PATH] [--quick]

Exits 1 when a mutant is missed or errors. ``--quick``: the cheapest mutant only (a unit test
of about 20 s), into ``--json`` (required, never under bench/results/).
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
from dataclasses import asdict, dataclass
from pathlib import Path

from _quick import add_flag, guard

ROOT = Path(__file__).resolve().parent.parent
MEASURED = "tests/integration/test_step_peak_and_padding_measured.py"


@dataclass(frozen=True)
class Mutant:
    """One bug: in ``file``, ``find`` (exactly once) becomes ``replace``; ``tests`` (pytest node
    ids) must fail."""

    name: str
    file: str
    find: str
    replace: str
    description: str
    tests: tuple[str, ...]


MUTANTS = [
    Mutant("step-temporaries", "hf_memkit/_estimate/phases.py",
           'phases["optimizer step"] = base + G + rs.optimizer_transient',
           'phases["optimizer step"] = base + G',
           "the optimizer step's temporaries dropped from the step phase",
           (f"{MEASURED}::test_a_step_that_peaks_in_the_optimizer_step_matches_a_real_run",)),
    Mutant("pad-to-multiple-of", "hf_memkit/_trainers/base.py",
           "return -(-seq // m) * m if m else seq", "return seq",
           "TRL's pad_to_multiple_of ignored",
           (f"{MEASURED}::test_sft_pad_to_multiple_of_matches_a_real_sft_trainer_run",)),
    Mutant("grpo-ranks", "hf_memkit/_trainers/rl/rollout.py",
           '// (micro_batch * max(1, ranks)))', "// micro_batch)",
           "GRPO's steps_per_generation without the number of processes",
           ("tests/unit/trainers/test_grpo_ranks.py",)),
    Mutant("zero3-grad-buffer", "hf_memkit/_engines/deepspeed.py",
           "r.resident_gradients = True", "pass",
           "ZeRO-3's resident flat gradient buffer removed",
           ("tests/unit/engines/test_zero3_grad_buffer.py",)),
    Mutant("fsdp2-prefetch", "hf_memkit/_engines/fsdp.py",
           'in_flight = 2 if device_kind == "cuda" else 1', "in_flight = 1",
           "FSDP2's prefetched layer on CUDA dropped",
           ("tests/unit/engines/test_fsdp_prefetch.py",)),
    Mutant("autocast-log1p", "hf_memkit/_cuda/autocast.py",
           '"log1p", "reciprocal"', '"reciprocal"',
           "log1p removed from CUDA's fp32 autocast table",
           ("tests/unit/cuda/test_autocast_sweep.py",)),
    # caught before issue 45 too, kept so that they stay caught
    Mutant("fsdp-upcast", "hf_memkit/_engines/fsdp.py",
           "return 4 if sh.mixed_precision and not quantized_4bit else itemsize",
           "return itemsize", "accelerate's fp32 upcast under FSDP mixed precision dropped",
           ("tests/unit/engines/test_fsdp_precision.py",)),
    Mutant("fsdp-sync-each-batch", "hf_memkit/_engines/fsdp.py",
           "if not sh.sync_each_batch:", "if False:",
           "FSDP's unsharded gradients kept across accumulation steps dropped",
           ("tests/unit/engines/test_multi_gpu.py::"
            "test_fsdp_accumulation_without_sync_each_batch_keeps_unsharded_gradients",)),
]
QUICK = ("autocast-log1p",)


def copy_tree(dest: Path) -> None:
    """Copy the working tree (tracked and untracked-not-ignored files) to ``dest``.

    Args:
        dest: an empty folder.
    """
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT,
                         capture_output=True, check=True).stdout.decode()
    for rel in filter(None, out.split("\0")):
        src = ROOT / rel
        if rel.startswith(".venv/") or not src.is_file():   # deleted in the tree, or a link
            continue
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dest / rel)


def apply(tree: Path, m: Mutant) -> None:
    """Apply ``m`` in ``tree``.

    Args:
        tree: a copy of the repository.
        m: the mutant.

    Raises:
        SystemExit: ``m.find`` does not occur exactly once in its file.
    """
    path = tree / m.file
    text = path.read_text()
    if text.count(m.find) != 1:
        raise SystemExit(f"mutant {m.name}: {m.find!r} occurs {text.count(m.find)} times in "
                         f"{m.file} (expected exactly once): update the mutant")
    path.write_text(text.replace(m.find, m.replace))


def _env(tree: Path) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(tree)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    env.setdefault("HF_MEMKIT_STRICT_TESTS", "1")
    return env


def imported_from(tree: Path) -> str:
    """Where ``hf_memkit`` is imported from when run as the tests run in ``tree``.

    Args:
        tree: a copy of the repository.

    Returns:
        ``hf_memkit.__file__`` as that interpreter sees it.
    """
    return subprocess.run([sys.executable, "-c", "import hf_memkit; print(hf_memkit.__file__)"],
                          cwd=tree, env=_env(tree), capture_output=True, text=True,
                          check=True).stdout.strip()


def run_mutant(m: Mutant, *, show_import: bool = False) -> dict:
    """Apply ``m`` to a fresh copy of the tree and run its tests there.

    Args:
        m: the mutant.
        show_import: print where the copy's tests import ``hf_memkit`` from.

    Returns:
        ``{"name", "file", "description", "tests", "outcome" ("caught" / "missed" / "error"),
        "pytest_status", "seconds", "tail"}``.
    """
    with tempfile.TemporaryDirectory(prefix="hf_memkit-mutant-") as tmp:
        tree = Path(tmp)
        copy_tree(tree)
        apply(tree, m)
        if show_import:
            where = imported_from(tree)
            print(f"hf_memkit imported from {where}", flush=True)
            if not where.startswith(str(tree)):
                raise SystemExit(f"the copy's tests import hf_memkit from {where}, not the copy")
        t = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "--tb=line", "-p",
                               "no:cacheprovider", *m.tests], cwd=tree, env=_env(tree),
                              capture_output=True, text=True)
        seconds = time.monotonic() - t
    outcome = {1: "caught", 0: "missed"}.get(proc.returncode, "error")
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    # --tb=line: one "path:line: Error: message" line per failure, the assertion that caught it
    why = [ln for ln in lines if ln.startswith("E ") or (ln.startswith("/") and ".py:" in ln)][:1]
    tail = "\n".join(why + lines[-2:])
    row = asdict(m)
    del row["find"], row["replace"]
    return {**row, "outcome": outcome, "pytest_status": proc.returncode,
            "seconds": round(seconds, 1), "tail": tail}


def main(argv: list[str] | None = None) -> int:
    """Run the mutants; print a table; exit status 1 when one is missed or errors.

    Args:
        argv: the command line (``None``: ``sys.argv[1:]``).

    Returns:
        0 when every mutant run is caught, else 1.
    """
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", help="mutant names (default: all)")
    ap.add_argument("--json", help="write the rows there")
    add_flag(ap)
    a = ap.parse_args(argv)
    guard(a.quick, a.json, "--json")
    names = set(a.only or (QUICK if a.quick else [m.name for m in MUTANTS]))
    unknown = names - {m.name for m in MUTANTS}
    if unknown:
        raise SystemExit(f"unknown mutants: {sorted(unknown)}")
    rows = []
    for i, m in enumerate(m for m in MUTANTS if m.name in names):
        row = run_mutant(m, show_import=i == 0)
        rows.append(row)
        print(f"{m.name:22} {row['outcome']:7} {row['seconds']:7.1f} s  {m.description}",
              flush=True)
        print("    " + row["tail"].splitlines()[0][:300], flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps({"rows": rows}, indent=1) + "\n")
    bad = [r["name"] for r in rows if r["outcome"] != "caught"]
    print(f"{len(rows) - len(bad)}/{len(rows)} caught" + (f"; not caught: {bad}" if bad else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
