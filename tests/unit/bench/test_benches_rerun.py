"""Every bench runs end to end (issue 45): each ``bench/[a-z]*.py`` in its ``--quick`` mode, into
a folder of the test's own (never ``bench/results/``), exits 0 and writes a results file holding
the cases its quick mode runs, none dropped. A bench that crashes, or loses a case on the way,
fails here.

The benches are found in the folder: one without an entry in ``QUICK`` fails
(``test_every_bench_has_a_quick_entry``), so a new bench cannot escape. Each runs in this
process (``main(argv)``: torch and transformers are imported once), as the existing bench tests
import them; the benches that need processes start their own. GPU-only benches say so and write
nothing on a machine without CUDA; ``bench/gpu_truth.py`` then runs its ``--cpu-smoke`` quick
cases too (the same parent/child path, shrunk on the CPU).
"""

from __future__ import annotations

import importlib
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers import BENCH

sys.path.insert(0, str(BENCH))

pytestmark = pytest.mark.slow

OUT = "{out}"  # the results path (a file, or a folder for the benches that write several)
GPU_RESULTS = BENCH / "results" / "gpu"


@dataclass(frozen=True)
class Quick:
    """How one bench runs in quick mode and what its results must hold.

    ``args``: the command line, ``OUT`` standing for the results path; ``result``: the results
    file (a glob under ``OUT`` where ``OUT`` is a folder, else ``""``); ``cases``: the number of
    cases in the results; ``expected``: how many the quick run holds (``None``: at least one;
    the bench belongs to another change); ``no_gpu``: what a GPU-only bench prints without CUDA;
    ``smoke``: a command line that runs such a bench on the CPU all the same, and
    ``smoke_cases`` the cases it holds."""

    args: tuple[str, ...]
    cases: Callable[[Any], int]
    expected: Callable[[], int] | int | None
    result: str = ""
    no_gpu: str | None = None
    smoke: tuple[str, ...] | None = None
    smoke_cases: int = 0


def _committed_runs() -> int:
    """Runs in the committed GPU results files (band_fit reads each: a row or excluded)."""
    return sum(len(json.loads(p.read_text()).get("runs", []))
               for p in GPU_RESULTS.glob("*.json"))


def _committed_files() -> int:
    """Committed GPU results files with runs (gpu_reestimate --quick: the first ok run each)."""
    return sum(any(r.get("status") == "ok" for r in json.loads(p.read_text()).get("runs", []))
               for p in GPU_RESULTS.glob("*.json"))


def _ok_runs(doc: dict) -> int:
    return sum(r["status"] == "ok" for r in doc["runs"])


QUICK: dict[str, Quick] = {
    # the smallest case, 2 seeds
    "allocator_sensitivity.py": Quick(("--quick", "--json", OUT), len, 1),
    # three refusals before torch
    "bad_input.py": Quick(("--quick", "--out", OUT), lambda d: len(d["cases"]), 3,
                          result="bad_input.json"),
    # every committed run is a row or listed as excluded
    "band_fit.py": Quick(("--quick", "--out", OUT),
                         lambda d: len(d["rows"]) + len(d["excluded"]), _committed_runs),
    # a CPU estimate, a CUDA estimate, a plan
    "behaviour_snapshot.py": Quick(("--quick", "--out", OUT), len, 3),
    "callback_overhead.py": Quick(("--quick", "--json", OUT), lambda d: len(d["repeats"]), 1),
    # --help, devices, two bad inputs
    "cli_speed.py": Quick(("--quick", "--json", OUT), lambda d: len(d["commands"]), 4),
    # one setup that ran, one published as out of memory
    "community_configs.py": Quick(("--quick", "--json", OUT),
                                  lambda d: len(d["rows"]) - len(d["summary"]["errors"]), 2),
    # the five technique pairs of torchtune's and PEFT's tables
    "cost_model_anchors.py": Quick(("--quick", "--json", OUT),
                                   lambda d: len(d["technique_pairs"]["pairs"]), 5),
    # the plain DDP case: 2 gloo ranks
    "dist_measure.py": Quick(("--quick", "--out", OUT),
                             lambda d: sum(len(r["result"]["ranks"]) == 2 for r in d), 1),
    "estimate_speed.py": Quick(("--quick", "--json", OUT), lambda d: len(d["times"]), 1),
    # fused AdamW, and a case that declares its package (bitsandbytes)
    "estimator_cpu.py": Quick(("--quick", "--json", OUT), lambda d: d["summary"]["cases"], 2),
    # opt-350m's SDPA rows at batch 1: seq 128, 256, 512, 1024, 2048
    "estimator_gpu_anchors.py": Quick(("--quick", "--json", OUT),
                                      lambda d: len(d["rows"]["none"]), 5),
    # the packed SFT case (it crashed the bench) and a DPO one
    "estimator_trl.py": Quick(("--quick", "--json", OUT), lambda d: d["summary"]["cases"], 2),
    # the two context constants and the band's three sigmas
    "fit_constants.py": Quick(("--quick", "--json", OUT), lambda d: len(d["constants"]), 5),
    "gpu_reestimate.py": Quick(("--quick", "--json", OUT),
                               lambda d: len(d["fit"]["rows"]) + len(d["holdout"]["rows"]),
                               _committed_files),
    # one mutant (log1p off CUDA autocast's fp32 list), caught by its test in a copy
    "mutants.py": Quick(("--quick", "--json", OUT), lambda d: len(d["rows"]), 1),
    # cp=2, both exchanges, one shape
    "gpu_ring_attention.py": Quick(("--quick", "--out", OUT), lambda d: len(d["rows"]), 2,
                                   result="ring_attention_*.json",
                                   no_gpu="no CUDA GPU here: nothing measured"),
    # a full fine-tune and a LoRA one; on the CPU the first, shrunk (about 30 s)
    "gpu_truth.py": Quick(("--quick", "--out", OUT), _ok_runs, 2, result="*.json",
                          no_gpu="No CUDA GPU present",
                          smoke=("--quick", "--cpu-smoke", "--out", OUT, "--only",
                                 "llama-160m.fp32.adamw_torch.sdpa.b4s1024"), smoke_cases=1),
    # one TP and one SP case, from the committed measurements
    "parallel_cpu.py": Quick(("--quick", "--json", OUT),
                             lambda d: len(d["rows"]) if not d["missing"] else 0, 2),
    # the fp32 TP case: 2 gloo ranks
    "parallel_measure.py": Quick(("--quick", "--json", OUT),
                                 lambda d: sum(len(r["result"]["ranks"]) == 2
                                               for r in d["rows"]), 1),
    # Ulysses at 8k tokens with and without SP
    "parallel_published.py": Quick(("--quick", "--json", OUT), lambda d: len(d["rows"]), 2),
    # the generous budget: a plan, measured
    "plan_quality.py": Quick(("--quick", "--json", OUT),
                             lambda d: sum(r["plan"] is not None for r in d["rows"]), 1),
    "plan_speed.py": Quick(("--quick", "--json", OUT), lambda d: len(d["cases"]), 1),
    # 1.5B at 8 GPUs x 5 DeepSpeed setups, the paper's 4 rows, 1 run, 1 plan
    "sharding.py": Quick(("--quick", "--json", OUT),
                         lambda d: sum(len(d[k]) for k in ("deepspeed", "paper", "runs",
                                                           "planner")), 11),
}
# scripts in bench/ that run no cases and write no results file: named, so that none escapes
NOT_BENCHES = {"tables.py": "rewrites the docs' tables from the committed results files "
                            "(its --check compares them); it measures nothing"}
BENCHES = sorted(p.name for p in BENCH.glob("[a-z]*.py") if p.name not in NOT_BENCHES)
# dist_measure's quick run, measured once: sharding's quick run compares it (--measured), as the
# bench's docstring suggests, instead of running the same two processes again
MEASURED: dict[str, Path] = {}


def test_every_bench_has_a_quick_entry():
    """A bench added to bench/ without a quick entry here fails; so does an entry whose bench
    is gone."""
    assert len(BENCHES) >= 20  # the folder was found and read
    assert sorted(QUICK) == BENCHES
    assert all((BENCH / name).is_file() for name in NOT_BENCHES)


def _main(name: str, args: list[str], capsys) -> tuple[int, str]:
    """(exit status, stdout) of ``bench/<name>``'s ``main(args)``, in this process."""
    module = importlib.import_module(name.removesuffix(".py"))
    try:
        code = module.main(args)
    except SystemExit as exc:  # a bench that ends with sys.exit or parser.error
        code = exc.code if isinstance(exc.code, int) else 1
    out = capsys.readouterr()
    sys.stdout.write(out.out[-3000:])  # shown when the test fails
    sys.stderr.write(out.err[-3000:])
    return code, out.out


def _results(entry: Quick, out: Path) -> Any:
    if not entry.result:
        return json.loads(out.read_text())
    found = sorted(out.glob(entry.result))
    assert len(found) == 1, f"one results file {entry.result} in {out}, found {found}"
    return json.loads(found[0].read_text())


def _check(name: str, entry: Quick, args: tuple[str, ...], out: Path, capsys,
           want: int | None = None) -> None:
    code, _ = _main(name, [str(out) if a == OUT else a for a in args], capsys)
    assert code == 0, f"{name} {' '.join(args)} exited {code}"
    got = entry.cases(_results(entry, out))
    if want is None:
        want = entry.expected() if callable(entry.expected) else entry.expected
    if want is None:
        assert got >= 1, f"{name}: no case in its results"
    else:
        assert got == want, f"{name}: {got} cases in its results, the quick run holds {want}"


@pytest.mark.parametrize("name", BENCHES)
def test_bench_runs_end_to_end_in_quick_mode(name, tmp_path, capsys):
    entry = QUICK.get(name)
    if entry is None:
        pytest.fail(f"bench/{name} has no quick entry in this test's QUICK table")
    out = tmp_path / ("results" if entry.result else "results.json")
    if entry.result:
        out.mkdir()
    if entry.no_gpu and not torch.cuda.is_available():
        code, stdout = _main(name, [str(out) if a == OUT else a for a in entry.args], capsys)
        assert code == 0 and entry.no_gpu in stdout, stdout[-2000:]
        assert not any(out.iterdir()), "a bench that measured nothing wrote a results file"
        if entry.smoke:
            _check(name, entry, entry.smoke, out, capsys, entry.smoke_cases)
        return
    args = entry.args
    if name == "sharding.py" and "dist_measure.py" in MEASURED:
        args += ("--measured", str(MEASURED["dist_measure.py"]))
    _check(name, entry, args, out, capsys)
    MEASURED[name] = out


def test_a_quick_run_never_writes_the_committed_results(capsys):
    """--quick into bench/results/ (or with no path where the default is a committed file) is
    refused before anything runs."""
    from _quick import RESULTS

    before = sorted((p, p.stat().st_mtime_ns) for p in RESULTS.rglob("*") if p.is_file())
    for name, args in (("parallel_measure.py", ["--quick"]),
                       ("bad_input.py", ["--quick"]),
                       ("gpu_truth.py", ["--quick", "--cpu-smoke"]),
                       ("fit_constants.py", ["--quick", "--json",
                                             str(RESULTS / "gpu" / "x.json")])):
        code, _ = _main(name, args, capsys)
        assert code != 0, f"{name} {' '.join(args)} was not refused"
    assert sorted((p, p.stat().st_mtime_ns) for p in RESULTS.rglob("*") if p.is_file()) == before
