"""Reading a recipe file: ``load_recipe`` (``yaml.safe_load``, no ``!!python/...`` tags), the
bundled recipes and how a recipe reference resolves to a file."""

from __future__ import annotations

import os
from functools import cache
from importlib import resources
from pathlib import Path

import yaml

from .._errors import ConfigError, HfMemkitError, did_you_mean, not_a_file, read_user_file
from .schema import Recipe
from .validate import validate


def load_recipe(path: str | os.PathLike) -> Recipe:
    """Read and validate a YAML recipe file, or a bundled recipe by name.

    Args:
        path (`str` or `os.PathLike`):
            A recipe file, or a bundled recipe's name (`llama-3.1/8b_qlora_rtx4090`;
            `hf-memkit recipes list`).

    Returns:
        `Recipe`: the validated recipe.

    Raises:
        ConfigError: One error listing every problem, each as
            `FILE: KEY: what is wrong, what is allowed` (a file that is missing, unreadable,
            not UTF-8 or not plain YAML included).
    """
    if not isinstance(path, (str, os.PathLike)):
        raise ConfigError([f"load_recipe takes the path of a recipe .yaml file (str or "
                           f"os.PathLike) or a bundled recipe's name (hf-memkit recipes list), "
                           f"got {type(path).__name__} {path!r}"], source="load_recipe")
    file = resolve_recipe_path(path)
    where = _display(file)
    try:
        data = read_user_file(file, what="a recipe .yaml file", cap=RECIPE_CAP, name=where)
    except HfMemkitError as exc:
        raise ConfigError([str(exc)], source=where) from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[:exc.start].count(b"\n") + 1
        raise ConfigError([f"{where}: line {line}: not UTF-8 text (byte "
                           f"0x{data[exc.start]:02x} at offset {exc.start}); recipes are UTF-8 "
                           "YAML: save the file as UTF-8"], source=where) from None
    try:
        raw = _safe_load(text)
    except _RecipeYAMLError as exc:
        raise ConfigError([f"{where}: {exc}"], source=where) from None
    except RecursionError:
        raise ConfigError([f"{where}: the YAML is nested too deeply to read; a recipe is a few "
                           "levels of plain keys, lists and values"], source=where) from None
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


# -- YAML: yaml.safe_load, with a budget on aliases and no duplicate keys ---------------------

# A recipe is a few dozen values. Anchors and aliases (`&a` / `*a`) are shared when parsed but
# expanded by everything that walks the data afterwards (validation, error messages, the plan):
# a few lines of nested aliases ("billion laughs") expand to billions of values. Recipes whose
# values expand beyond these budgets are rejected before anything walks them.
MAX_ALIASES = 100
MAX_VALUES = 10_000
RECIPE_CAP = 2**20   # bytes: a recipe is a few dozen lines (the bundled ones under 2 KiB)


class _RecipeYAMLError(yaml.YAMLError):
    """A recipe file that is valid YAML but not an acceptable recipe (message: line, why, fix)."""


class _RecipeLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that rejects duplicate mapping keys (YAML keeps the last one silently)
    and counts alias uses."""

    aliases = 0

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            self.aliases += 1
            if self.aliases > MAX_ALIASES:
                mark = self.peek_event().start_mark
                raise _RecipeYAMLError(
                    f"line {mark.line + 1}: more than {MAX_ALIASES} YAML aliases (`*name`); a "
                    "recipe is plain data: write the values out instead of repeating anchors")
        return super().compose_node(parent, index)

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.get(key)
                except TypeError:  # an unhashable key: SafeLoader's own error says so
                    continue
                line = key_node.start_mark.line + 1
                if first is not None:
                    raise _RecipeYAMLError(
                        f"line {line}: duplicate key `{key}` (first on line {first}); YAML "
                        "would silently keep only the last value: keep one of them")
                seen[key] = line
        return super().construct_mapping(node, deep=deep)


def _expanded_size(node, sizes: dict[int, int | None]) -> int:
    """How many values ``node`` stands for once aliases are expanded (memoised per node, so a
    shared node is counted in linear time however often it is used)."""
    if id(node) in sizes:
        if sizes[id(node)] is None:
            raise _RecipeYAMLError(
                f"line {node.start_mark.line + 1}: a YAML anchor contains an alias to itself (a "
                "recursive value); a recipe is plain data: write the values out")
        return sizes[id(node)]
    sizes[id(node)] = None  # being counted: meeting it again below is a cycle
    if isinstance(node, yaml.SequenceNode):
        total = 1 + sum(_expanded_size(n, sizes) for n in node.value)
    elif isinstance(node, yaml.MappingNode):
        total = 1 + sum(_expanded_size(k, sizes) + _expanded_size(v, sizes)
                        for k, v in node.value)
    else:
        total = 1
    sizes[id(node)] = total = min(total, MAX_VALUES + 1)
    return total


def _safe_load(text: str):
    """``yaml.safe_load`` of a recipe within the alias budget, without duplicate keys."""
    loader = _RecipeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        if loader.aliases and _expanded_size(node, {}) > MAX_VALUES:
            raise _RecipeYAMLError(
                f"the YAML expands to more than {MAX_VALUES} values through its {loader.aliases} "
                "alias(es) (`*name`, nested anchors: a 'billion laughs' file); a recipe is a few "
                "dozen plain values: write them out instead of nesting aliases")
        return loader.construct_document(node)
    finally:
        loader.dispose()


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
    if os.path.lexists(p):  # a directory, a FIFO, a device: there, but not a recipe file
        what = not_a_file(p.stat().st_mode) if p.exists() else "a broken symbolic link"
        raise ConfigError([f"{path}: is {what}; give a recipe .yaml file (or a bundled recipe: "
                           "hf-memkit recipes list)"], source=str(path))
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
