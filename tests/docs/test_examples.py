"""Every command and Python example in the README and in docs/ runs as written.

A page's ```python blocks run in order as one script (a later block uses what an earlier one
defined), and its ```bash blocks line by line, in a fresh working directory with the bundled
recipes beside it, offline, with one trace cache for the whole session. A ```yaml block whose
first line names a file (``# my_run.yaml ...``) is written there first, so a recipe the page
shows is the recipe its commands run. A command that ends in ``# exit N`` must exit with N (the
CLI's verdict codes: 1 does not fit, 3 tight); every other one with 0.

Two kinds of block do not run, each marked in its fence: ``python signature`` (api.md's
signatures, which are not statements) and ``bash install`` (the README's set-up lines, which are
what ``make test`` itself runs: their agreement with the Makefile is checked below).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(?P<lang>[a-z]*)(?P<tags>[^\n]*)\n(?P<body>.*?)^```[ \t]*$", re.M | re.S)
EXIT = re.compile(r"#\s*exit (\d+)\b")


def _blocks(page: Path, lang: str) -> list[tuple[str, str]]:
    """``(tags, body)`` of each fenced block of ``lang`` on the page, in order."""
    return [(m["tags"].strip(), m["body"]) for m in FENCE.finditer(page.read_text())
            if m["lang"] == lang]


def _runnable(page: Path, lang: str) -> str:
    skip = {"python": "signature", "bash": "install"}[lang]
    return "\n".join(body for tags, body in _blocks(page, lang) if skip not in tags.split())


def _commands(script: str) -> list[str]:
    """The script's commands: comment lines dropped, ``\\`` continuations joined."""
    out, cur = [], ""
    for line in script.splitlines():
        if not cur and (not line.strip() or line.lstrip().startswith("#")):
            continue
        cur += line.rstrip("\\").rstrip() + " " if line.endswith("\\") else line
        if not line.endswith("\\"):
            out.append(cur.strip())
            cur = ""
    return out


def _workdir(tmp: Path, page: Path) -> Path:
    (tmp / "recipes").symlink_to(ROOT / "recipes")
    for _, body in _blocks(page, "yaml"):
        name = re.match(r"#\s*(\S+\.ya?ml)\b", body)
        if name:
            (tmp / name[1]).write_text(body)
    return tmp


def _env(cache: Path) -> dict[str, str]:
    env = dict(os.environ, HF_MEMKIT_CACHE=str(cache), HF_HUB_OFFLINE="1", MPLBACKEND="Agg",
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    for var in ("HF_MEMKIT_STRICT_TESTS", "HF_MEMKIT_NO_CACHE"):  # the suite's, not a user's
        env.pop(var, None)
    return env


def _run_python(page: Path, work: Path, env: dict[str, str]) -> list[str]:
    r = subprocess.run([sys.executable, "-c", _runnable(page, "python")], cwd=work, env=env,
                       capture_output=True, text=True, timeout=1200)
    return [] if r.returncode == 0 else [f"the Python examples failed:\n{r.stderr[-6000:]}"]


def _run_bash(page: Path, work: Path, env: dict[str, str]) -> list[str]:
    for cmd in _commands(_runnable(page, "bash")):
        want = EXIT.search(cmd)
        expected = int(want[1]) if want else 0
        r = subprocess.run(["bash", "-c", cmd], cwd=work, env=env, capture_output=True,
                           text=True, timeout=900)
        if r.returncode != expected:
            return [f"`{cmd}` exited {r.returncode}, the page says {expected}:\n"
                    f"{r.stderr[-4000:]}"]
    return []


def _pages(lang: str) -> list[Path]:
    return [p for p in PAGES if _runnable(p, lang).strip()]


@pytest.fixture(scope="session")
def page_runs(tmp_path_factory) -> dict[tuple[str, str], list[str]]:
    """Every page's examples, run two at a time (the pages are independent; the trace cache is
    shared, so a model and shape two pages use is traced once): ``(lang, page) -> failures``."""
    cache = tmp_path_factory.mktemp("docs-cache")
    jobs = [(lang, page) for lang in ("python", "bash") for page in _pages(lang)]
    # the pages that plan most first, so that the two workers end together
    jobs.sort(key=lambda j: -_runnable(j[1], j[0]).count("plan"))

    def one(job: tuple[str, Path]) -> list[str]:
        lang, page = job
        work = _workdir(tmp_path_factory.mktemp(f"{lang}-{page.stem}"), page)
        return (_run_python if lang == "python" else _run_bash)(page, work, _env(cache))

    with ThreadPoolExecutor(max_workers=2) as pool:
        return {(lang, page.name): out for (lang, page), out in zip(jobs, pool.map(one, jobs),
                                                                  strict=True)}


def test_every_page_with_examples_is_collected():
    """The README and the user guide all hold examples; a page losing its fences would hide them."""
    names = {p.name for p in _pages("python")} | {p.name for p in _pages("bash")}
    assert {"README.md", "planning.md", "estimating.md", "multi-gpu.md", "trl.md",
            "callbacks.md", "cli.md"} <= names


@pytest.mark.slow
@pytest.mark.parametrize("page", _pages("python"), ids=lambda p: p.name)
def test_python_examples_run(page: Path, page_runs):
    assert not page_runs[("python", page.name)], f"{page.name}: {page_runs[('python', page.name)]}"


@pytest.mark.slow
@pytest.mark.parametrize("page", _pages("bash"), ids=lambda p: p.name)
def test_bash_examples_run(page: Path, page_runs):
    assert not page_runs[("bash", page.name)], f"{page.name}: {page_runs[('bash', page.name)]}"


def test_the_readme_install_line_is_what_make_demo_installs():
    """The README's install command and `make demo` install the same thing (CI runs the
    Makefile's path, `make test`, whose dev extra includes `all`)."""
    install = " ".join(body for tags, body in _blocks(ROOT / "README.md", "bash")
                       if "install" in tags.split())
    make = (ROOT / "Makefile").read_text()
    demo = re.search(r"^\$\(VENV\)/\.demo:.*\n\t(?P<cmd>.+)$", make, re.M)["cmd"]
    spec = shlex.split(demo)[-1]
    assert spec == '.[all]' and f'-e "{spec}"' in install and "-c constraints.txt" in install
    assert "make demo" in install and "make test" in install
