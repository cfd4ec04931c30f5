"""``hf-memkit recipes``: list the bundled recipes, validate recipe files."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .._errors import ConfigError, HfMemkitError


def recipes_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "recipes", help="list the bundled recipes or validate recipe files",
        description="Recipes are YAML files naming a model, data, seq_len, target batch, "
                    "method, hardware and TrainingArguments pins (docs/cli.md: Recipes).",
        epilog="Examples:\n"
               "  hf-memkit recipes list\n"
               "  hf-memkit recipes validate                       # every bundled recipe\n"
               "  hf-memkit recipes validate my_recipe.yaml other.yaml --json\n"
               "Exit codes of validate: 0 all valid, 2 any invalid (every problem listed).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    rsub = p.add_subparsers(dest="recipes_command", metavar="ACTION")
    v = rsub.add_parser(
        "validate", help="validate recipe files (default: every bundled recipe)",
        description="Load each recipe with the full validation of load_recipe and print a "
                    "table; every problem of every file is listed.",
        epilog="Examples:\n  hf-memkit recipes validate\n"
               "  hf-memkit recipes validate recipes/llama-3.1/8b_qlora_rtx4090.yaml\n"
               "  hf-memkit recipes validate my_recipe.yaml --json",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    v.add_argument("paths", nargs="*", metavar="PATH", help="recipe files (default: bundled)")
    v.add_argument("--json", action="store_true", help="print JSON instead of a table")
    v.set_defaults(func=validate_command)
    ls = rsub.add_parser(
        "list", help="list the bundled recipes",
        description="The recipes shipped with hf-memkit, with the command that runs each.",
        epilog="Examples:\n  hf-memkit recipes list\n  hf-memkit recipes list --json",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    ls.add_argument("--json", action="store_true", help="print JSON instead of a table")
    ls.set_defaults(func=list_command)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])
    return p


def _bundled_name(path: Path) -> str:
    from .._recipe import bundled_recipes_dir

    root = bundled_recipes_dir()
    return "recipes/" + str(path.relative_to(root)) if root else str(path)


def _without_file(problem: str) -> str:
    head, _, rest = problem.partition(": ")
    return rest if rest and head.endswith((".yaml", ".yml")) else problem


def validate_command(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from .._recipe import bundled_recipes, load_recipe

    paths = list(args.paths) or [_bundled_name(p) for p in bundled_recipes()]
    if not paths:
        raise ConfigError(["no bundled recipes found and no PATH given"], source="recipes")
    rows = []
    for path in paths:
        try:
            r = load_recipe(path)
            rows.append({"path": path, "valid": True, "problems": [],
                         "setup": f"{r.model}{' (overridden)' if r.model_overrides else ''}, "
                                  f"{r.method}, {r.num_gpus} x {r.device or 'this machine'}, "
                                  f"seq {r.seq_len}, batch {r.target_batch_size}"})
        except HfMemkitError as exc:  # every file is checked: one bad file stops nothing
            rows.append({"path": path, "valid": False,
                         "problems": getattr(exc, "problems", None) or [str(exc)]})
    bad = [r for r in rows if not r["valid"]]
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        t = Table(title=f"recipes: {len(rows) - len(bad)} valid, {len(bad)} invalid")
        t.add_column("recipe", no_wrap=True)
        t.add_column("status")
        t.add_column("setup")
        for r in rows:
            if r["valid"]:
                t.add_row(r["path"], "[green]valid", r["setup"])
            else:
                t.add_row(r["path"], f"[red]invalid: {len(r['problems'])} problem(s)",
                          "\n".join(_without_file(p) for p in r["problems"]))
        Console().print(t)
    for r in bad:
        print(f"{r['path']}: {len(r['problems'])} problem(s):", file=sys.stderr)
        for problem in r["problems"]:
            print(f"  - {problem}", file=sys.stderr)
    return 2 if bad else 0


def list_command(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from .._recipe import bundled_recipes

    rows = []
    for p in bundled_recipes():
        first = next((ln[1:].strip() for ln in p.read_text().splitlines()
                      if ln.startswith("#")), "")
        rows.append({"recipe": _bundled_name(p), "about": first,
                     "run": f"hf-memkit train {_bundled_name(p)}"})
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        t = Table(title="bundled recipes (hf-memkit plan|train RECIPE)")
        t.add_column("recipe", no_wrap=True)
        t.add_column("about")
        for r in rows:
            t.add_row(r["recipe"], r["about"])
        Console().print(t)
    return 0


def register(sub) -> None:
    recipes_parser(sub)
