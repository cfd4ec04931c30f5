"""``hf-memkit cache``: where traces are kept between runs, how much they hold; clear them.

Also the ``--no-cache`` option of the commands that estimate or plan (``add_cache_option``)."""

from __future__ import annotations

import argparse
import json
import os

from .._errors import HfMemkitError

NO_CACHE_HELP = ("trace the model again instead of reading traces kept on disk, and keep none "
                 "(as HF_MEMKIT_NO_CACHE=1 does; see hf-memkit cache info)")


def add_cache_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-cache", action="store_true", help=NO_CACHE_HELP)


def apply_cache_option(args: argparse.Namespace) -> None:
    """``--no-cache``: traces are neither read from nor written to disk in this process (and
    the processes it starts)."""
    if getattr(args, "no_cache", False):
        from .._store import NO_CACHE_ENV

        os.environ[NO_CACHE_ENV] = "1"


def cache_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "cache", help="show or clear the traces kept between runs",
        description="Estimates and plans keep the traces of the model code on disk, so the "
                    "same question asked again (or a neighbouring one: another optimizer, "
                    "accumulation or target batch) is answered without tracing again. They are "
                    "kept under $HF_MEMKIT_CACHE/traces (else ${XDG_CACHE_HOME:-~/.cache}/"
                    "hf_memkit/traces), at most HF_MEMKIT_TRACE_CACHE_SIZE (default 512MiB; the "
                    "least recently used go first). HF_MEMKIT_NO_CACHE=1 or --no-cache on "
                    "estimate/plan/train turns them off. `hf-memkit plan` also keeps its answer "
                    "to a question about a bundled model on a catalog GPU (under "
                    "$HF_MEMKIT_CACHE/answers), and prints it again when the same question is "
                    "asked again.",
        epilog="Examples:\n  hf-memkit cache info\n  hf-memkit cache info --json\n"
               "  hf-memkit cache clear",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    csub = p.add_subparsers(dest="cache_command", metavar="ACTION")
    info = csub.add_parser("info", help="where the traces and kept answers are, how many, their size",
                           description="The trace cache's folder, entries, size and limit, and the kept answers'.",
                           epilog="Examples:\n  hf-memkit cache info --json",
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    info.add_argument("--json", action="store_true", help="print JSON instead of a table")
    info.set_defaults(func=info_command)
    clear = csub.add_parser("clear", help="remove every kept trace and answer",
                            description="Remove every entry of the trace cache and every "
                                        "kept answer (calibrations are kept). A link in the "
                                        "place of their folder is removed itself, never "
                                        "followed.",
                            epilog="Examples:\n  hf-memkit cache clear",
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    clear.set_defaults(func=clear_command)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])
    return p


def _check_root() -> None:
    """A cache root that exists but is no folder (``HF_MEMKIT_CACHE`` naming a file): said."""
    from .._store import cache_root

    root = cache_root()
    if os.path.lexists(root) and not root.is_dir():
        raise HfMemkitError(f"the cache folder {root} is not a folder; point HF_MEMKIT_CACHE at a "
                            "folder of your own (hf_memkit creates it), or unset it")


def info_command(args: argparse.Namespace) -> int:
    from .._store import TraceStore, answers_dir

    _check_root()
    from .._units import format_bytes

    i = TraceStore().info()
    a = TraceStore(answers_dir()).info()
    d = {"path": str(i.path), "entries": i.entries, "size": i.size, "limit": i.limit,
         "enabled": i.enabled, "problem": i.problem,
         "answers": {"path": str(a.path), "entries": a.entries, "size": a.size,
                     "problem": a.problem}}
    if args.json:
        print(json.dumps(d, indent=2))
        return 0
    in_use = "no (HF_MEMKIT_NO_CACHE is set)" if not i.enabled else \
        f"no: {i.problem}" if i.problem else "yes"
    # plain lines: the path stays whole, to copy
    print(f"trace cache: {d['path']}\n"
          f"  entries: {i.entries}\n"
          f"  size:    {format_bytes(i.size)} of at most {format_bytes(i.limit)} "
          "(HF_MEMKIT_TRACE_CACHE_SIZE)\n"
          f"  in use:  {in_use}\n"
          f"kept answers (hf-memkit plan asked again): {a.path}\n"
          f"  entries: {a.entries}, {format_bytes(a.size)}"
          + (f"; not used: {a.problem}" if a.problem else "") + "\n"
          "hf-memkit cache clear empties both")
    return 0


def clear_command(args: argparse.Namespace) -> int:
    from .._store import TraceStore, answers_dir

    _check_root()

    store, answers = TraceStore(), TraceStore(answers_dir())
    n, m = store.clear(), answers.clear()
    print(f"removed {n} trace{'s' if n != 1 else ''} from {store.root}")
    print(f"removed {m} kept answer{'s' if m != 1 else ''} from {answers.root}")
    return 0


def register(sub) -> None:
    cache_parser(sub)
