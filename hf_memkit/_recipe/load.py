"""Reading a recipe file: ``load_recipe`` (``yaml.safe_load``, no ``!!python/...`` tags), the
bundled recipes and how a recipe reference resolves to a file."""

from __future__ import annotations

import os
from functools import cache
from importlib import resources
from pathlib import Path

import yaml

from .._errors import ConfigError, did_you_mean
from .schema import Recipe
from .validate import validate


def load_recipe(path: str | os.PathLike) -> Recipe:
    """Read and validate a recipe file (or a bundled recipe's name); raise one ``ConfigError``
    listing every problem, each as ``FILE: KEY: what is wrong, what is allowed``."""
    file = resolve_recipe_path(path)
    where = _display(file)
    try:
        text = file.read_text()
    except OSError as exc:
        raise ConfigError([f"{where}: cannot read: {exc.strerror}"], source=where) from None
    try:
        raw = yaml.safe_load(text)
    except yaml.constructor.ConstructorError as exc:
        tag = _tag_of(exc)
        raise ConfigError([
            f"{where}: line {exc.problem_mark.line + 1 if exc.problem_mark else '?'}: tag "
            f"`{tag}` is not allowed: recipes are plain data read with yaml.safe_load (no "
            "executable tags, no imports); write the value as a plain string, number, list or "
            "mapping"], source=where) from None
    except yaml.YAMLError as exc:
        raise ConfigError([f"{where}: not valid YAML: {exc}"], source=where) from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError([f"{where}: the top level must be a mapping of keys (model, data, "
                           f"training, hardware, pins, callbacks, output_dir), got "
                           f"{type(raw).__name__}"], source=where)
    return validate(raw, file, where)


def resolve_recipe_path(path: str | os.PathLike) -> Path:
    """A recipe file as given, else a bundled recipe: ``llama-3.1/8b_qlora_rtx4090``,
    ``recipes/llama-3.1/8b_qlora_rtx4090.yaml`` (from any directory, installed or not)."""
    p = Path(path)
    if p.is_file():
        return p
    rel = Path(*p.parts[1:]) if p.parts[:1] == ("recipes",) else p
    root = bundled_recipes_dir()
    if root is not None:
        for cand in (root / rel, root / rel.with_suffix(".yaml")):
            if cand.is_file():
                return cand
    known = [str(r.relative_to(root).with_suffix("")) for r in bundled_recipes()] if root else []
    raise ConfigError([f"{path}: no such file{did_you_mean(str(rel.with_suffix('')), known)}; "
                       "give a recipe path or a bundled recipe "
                       f"({', '.join(known) or 'none found'}; hf-memkit recipes list)"],
                      source=str(path))


@cache
def bundled_recipes_dir() -> Path | None:
    """The bundled ``recipes/``: package data of an installed hf-memkit (``hf_memkit/recipes``,
    a link to the repository's ``recipes/`` in a checkout), else the checkout's ``recipes/``."""
    cands = []
    try:
        cands.append(Path(str(resources.files("hf_memkit") / "recipes")))
    except (ModuleNotFoundError, TypeError):
        pass
    # this file is hf_memkit/_recipe/load.py: the checkout's root is three levels up
    cands.append(Path(__file__).resolve().parents[2] / "recipes")
    for c in cands:
        if c.is_dir():
            return c
    return None


def bundled_recipes() -> list[Path]:
    root = bundled_recipes_dir()
    return sorted(root.rglob("*.yaml")) if root else []


# -- display helpers --------------------------------------------------------------------------

def _display(file: Path) -> str:
    try:
        rel = file.resolve().relative_to(Path.cwd().resolve())
        return str(rel)
    except ValueError:
        root = bundled_recipes_dir()
        if root is not None:
            try:
                return "recipes/" + str(file.resolve().relative_to(root.resolve()))
            except ValueError:
                pass
        return str(file)


def _tag_of(exc: yaml.constructor.ConstructorError) -> str:
    text = str(exc.problem or "")
    if "tag '" in text:
        return text.split("tag '", 1)[1].split("'", 1)[0].replace("tag:yaml.org,2002:", "!!")
    return text
