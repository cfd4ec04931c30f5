"""The package stays readable: module and function size limits, and no private name imported
across modules (issue #12). ``ruff`` checks complexity (C901, max 15, pyproject.toml)."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "hf_memkit"
MAX_MODULE_LINES = 450
MAX_FUNCTION_LINES = 80


def _modules():
    return sorted(p for p in PKG.rglob("*.py") if "__pycache__" not in p.parts)


def test_modules_and_functions_stay_small():
    too_long = []
    for path in _modules():
        text = path.read_text()
        if len(text.splitlines()) > MAX_MODULE_LINES:
            too_long.append(f"{path.relative_to(PKG)}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    too_long.append(f"{path.relative_to(PKG)}:{node.lineno} {node.name}: {n}")
    assert not too_long, too_long


def test_no_private_name_is_imported_from_another_module():
    found = []
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            # `from . import _module` imports a module of the package, not a private name
            if isinstance(node, ast.ImportFrom) and node.level > 0 and node.module:
                for alias in node.names:
                    if alias.name.startswith("_") and alias.name not in ("__version__",):
                        found.append(f"{path.relative_to(PKG)}: from {'.' * node.level}"
                                     f"{node.module or ''} import {alias.name}")
    assert not found, found
