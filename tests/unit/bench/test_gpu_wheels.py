"""The wheel folder a device call carries (``bench/gpu_wheels.sh``, ``bench/gpu_wheels.lock``) and
the documented device call (DEVELOPERS.md), against what the lent machine has
(``bench/gpu_device_stack.txt``, from the device tool's page) and what one call may carry."""

from __future__ import annotations

import re
import subprocess
import sys

import tomllib
from packaging.tags import compatible_tags, cpython_tags
from packaging.utils import canonicalize_name, parse_wheel_filename

from tests.helpers import ROOT

sys.path.insert(0, str(ROOT / "bench"))

import _gpu_cases  # noqa: E402

MiB = 2**20
CARRY_LIMIT = 64 * MiB      # the working tree plus carried paths, one device call
COMMAND_LIMIT = 2000        # characters of one device command
CALL_LIMIT_S = 600          # one command's timeout_s at most
# The lent machine: CPython 3.12 on x86-64 Linux, glibc 2.35 or newer (Ubuntu 22.04 or later)
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in range(35, 4, -1)] + ["linux_x86_64"]
MACHINE_TAGS = set(cpython_tags((3, 12), platforms=PLATFORMS)) | set(
    compatible_tags((3, 12), "cp312", platforms=PLATFORMS))
# import name -> distribution name, where they differ
DIST = {"liger_kernel": "liger-kernel"}


def _lock() -> list[dict]:
    rows = []
    for line in (ROOT / "bench" / "gpu_wheels.lock").read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        file, size, sha, requires = line.split()
        rows.append({"file": file, "bytes": int(size), "sha256": sha,
                     "requires": [] if requires == "-" else requires.split(",")})
    return rows


def _stack() -> set[str]:
    text = (ROOT / "bench" / "gpu_device_stack.txt").read_text()
    words = " ".join(ln for ln in text.splitlines() if not ln.startswith("#")).split()
    return {canonicalize_name(w) for w in words}


def _tracked_bytes() -> int:
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                           check=True).stdout.split(b"\0")
    return sum((ROOT / f.decode()).stat().st_size for f in files if f and (ROOT / f.decode())
               .is_file())


def test_every_wheel_installs_on_the_machine_and_none_replaces_its_own_packages():
    stack, rows = _stack(), _lock()
    assert {"torch", "transformers", "accelerate", "peft"} <= stack
    names = [canonicalize_name(parse_wheel_filename(r["file"])[0]) for r in rows]
    assert len(names) == len(set(names)), "two versions of one package stop the whole install"
    for r, name in zip(rows, names, strict=True):
        _, _, _, tags = parse_wheel_filename(r["file"])
        assert tags & MACHINE_TAGS, f"{r['file']} does not install on CPython 3.12 x86-64"
        assert name not in stack, f"{name} is on the machine already: carry it only to replace it"
        assert re.fullmatch(r"[0-9a-f]{64}", r["sha256"]) and r["bytes"] > 0


def test_what_the_wheels_need_is_on_the_machine_or_in_the_folder():
    rows = _lock()
    have = _stack() | {canonicalize_name(parse_wheel_filename(r["file"])[0]) for r in rows}
    for r in rows:
        missing = {canonicalize_name(n) for n in r["requires"]} - have
        assert not missing, f"{r['file']} needs {sorted(missing)}: add their wheels to the lock"


def test_every_case_s_needs_and_the_project_s_own_dependencies_are_there():
    have = _stack() | {canonicalize_name(parse_wheel_filename(r["file"])[0]) for r in _lock()}
    needs = {m for c in _gpu_cases.CASES for m in c.needs}
    assert {"bitsandbytes", "trl", "liger_kernel", "peft"} <= needs
    for module in needs:
        assert canonicalize_name(DIST.get(module, module)) in have, module
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    for dep in deps:
        name = canonicalize_name(re.split(r"[<>=!~ ;\[]", dep, maxsplit=1)[0])
        assert name in have, f"hf_memkit needs {name}, which the machine lacks"


def test_wheels_and_tree_fit_what_one_call_carries():
    wheels = sum(r["bytes"] for r in _lock())
    tree = _tracked_bytes()
    # room for the untracked files that travel too (a results file being written, notes)
    assert wheels + tree + 4 * MiB <= CARRY_LIMIT, (wheels / MiB, tree / MiB)


def test_the_documented_device_call_fits_one_command_and_carries_the_folder():
    text = (ROOT / "DEVELOPERS.md").read_text()
    block = text.split("<!-- device-call -->", 1)[1].split("```")[1].strip()
    assert len(block) <= COMMAND_LIMIT and "\n" not in block
    assert "build/gpu_wheels/*.whl" in block and "bench/gpu_truth.py" in block
    deadline = float(re.search(r"--deadline-s (\d+)", block).group(1))
    timeout = int(re.search(r"`timeout_s: (\d+)`, `carry: \[\"build/gpu_wheels\"\]`",
                            text).group(1))
    tests = int(re.search(r"timeout (\d+) python3 -m pytest -m gpu", block).group(1))
    assert "tests/integration/test_on_a_cuda_gpu.py" in block
    assert timeout <= CALL_LIMIT_S
    # installing the wheels and the probe before the first case, the estimates in flight after,
    # then the gpu-marked tests, cut at their own timeout
    assert deadline + 45 + tests <= timeout, (deadline, tests, timeout)
    script = (ROOT / "bench" / "gpu_wheels.sh").read_text()
    assert "build/gpu_wheels" in script and "bench/gpu_wheels.lock" in script
    ignored = subprocess.run(["git", "check-ignore", "-q", "build/gpu_wheels/x.whl"], cwd=ROOT)
    assert ignored.returncode == 0, "the wheel folder must be ignored by git (it is carried)"
