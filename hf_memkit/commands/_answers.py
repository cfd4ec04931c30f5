"""Answers kept on disk (``<cache>/answers``): the same ``hf-memkit plan`` question asked again
is answered with what the first answer printed, before torch is imported and without planning.

Only a question whose whole input is known here is kept: a bundled model config named as such
and a GPU of the catalog named as such. A live GPU's free memory changes between two runs; a
local model directory, a recipe or a lengths file may be edited. The key is everything the answer
depends on: the command line as parsed (every option and ``FIELD=VALUE`` setting), the variables
of the environment that change a plan (allocator, cuBLAS, CUDA, NCCL, torch and hf_memkit's own),
how this terminal renders (width, colours, whether it is one), and what the trace store keys on
(``_store.versions``: hf_memkit's source and the libraries' versions), with hf_memkit's data files
(the catalogs), the optional packages the planner looks for (FlashAttention, Liger, torchao,
optimum) and this machine's CPU count (the planned dataloader workers). The value is what the first run printed, stdout and stderr, replayed as it was,
with one line on stderr saying so, and its exit code: a plan that fits (0) or a tight one (3).

A kept answer is untrusted input: one that is not ``{"stdout", "stderr", "when", "code"}`` as
written here is a miss (planned again and overwritten), and what is replayed keeps only printable
text, newlines and tabs: every control character and escape sequence (a window title, a cleared
screen, a moved cursor, colours) is dropped.

``--no-cache`` or ``HF_MEMKIT_NO_CACHE=1`` neither read nor keep them; ``hf-memkit cache clear``
removes them with the traces. Entries are the trace store's (``_store.TraceStore``): JSON, never
code, written atomically, the least recently used removed past the size limit.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import os
import re
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .. import _store as store
from .._errors import printable

COMMANDS = ("plan",)
# variables whose value can change a plan (the allocator's and cuBLAS's options, the CUDA
# runtime hf_memkit targets, hf_memkit's own switches); the cache's own location is not one
ENV_PREFIXES = ("PYTORCH_", "CUBLAS_", "CUDA_", "NCCL_", "TORCH_", "HF_MEMKIT_")
NOT_KEYED = ("HF_MEMKIT_CACHE", store.SIZE_ENV)
# optional packages the planner consults beyond the trace store's libraries: FlashAttention
# (the attention kernel), Liger (a technique), torchao (optimizers), optimum (BetterTransformer)
OPTIONAL = ("flash_attn", "liger_kernel", "torchao", "optimum")
NOT_ARGS = ("func", "before_torch")
KEPT_FIELDS = {"stdout", "stderr", "when", "code"}
KEPT_CODES = (0, 3)   # the exit codes of answers kept: a plan that fits, a tight one
_WHEN = re.compile(r"\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2}[\w .:+-]{0,64}")


def answer_store() -> store.TraceStore:
    return store.TraceStore(store.answers_dir())


def question_key(args: argparse.Namespace) -> str | None:
    """The key of this command line's answer, or None where it is not kept."""
    if args.command not in COMMANDS or getattr(args, "no_cache", False) or not store.enabled():
        return None
    if getattr(args, "write_config", None) is not None:  # files to write: run it every time
        return None
    if not _known_inputs(args):
        return None
    from rich.console import Console

    console = Console()
    env = {k: v for k, v in os.environ.items()
           if k.startswith(ENV_PREFIXES) and k not in NOT_KEYED}
    parts = {"command": args.command,
             "args": {k: v for k, v in vars(args).items() if k not in NOT_ARGS},
             "env": env, "data": store.data_digest(),
             "optional": {name: _found(name) for name in OPTIONAL},
             "cpus": os.cpu_count(),   # dataloader_num_workers
             "terminal": [console.width, console.color_system, console.is_terminal,
                          console.legacy_windows, console.encoding]}
    return store.make_key(parts)


def _found(module: str) -> str | bool:
    """The installed version of ``module``'s distribution, else whether it can be imported (the
    planner looks modules up with ``find_spec``; nothing is imported here)."""
    return store.installed(module) or importlib.util.find_spec(module) is not None


def _known_inputs(args: argparse.Namespace) -> bool:
    """A bundled model config and a catalog GPU, both by name; no file read."""
    from .._device.probe import get_device
    from .._model.names import canonical_name
    from .plan import may_be_recipe

    model, gpu = getattr(args, "model", None), getattr(args, "gpu", None)
    if not isinstance(model, str) or Path(model).exists() or canonical_name(model) is None:
        return False
    if may_be_recipe(model) or getattr(args, "lengths", None) is not None or gpu is None:
        return False
    return get_device(gpu).source == "catalog"


def replay(key: str | None, command: str) -> int | None:
    """Print the kept answer of ``key`` and return its exit code; None on a miss."""
    if key is None:
        return None
    with warnings.catch_warnings(record=True) as caught:  # before the CLI shows them as lines
        warnings.simplefilter("always")
        kept = answer_store().get(key)
    for w in caught:  # the cache folder not used (``store.trusted``)
        print(f"hf-memkit {command}: warning: {w.message}", file=sys.stderr)
    if not _well_formed(kept):
        return None
    sys.stdout.write(printable(kept["stdout"]))
    sys.stdout.flush()
    sys.stderr.write(printable(kept["stderr"]))
    print(f"hf-memkit {command}: the answer kept from {kept['when']} (the same question; "
          "--no-cache plans again, hf-memkit cache clear removes kept answers)", file=sys.stderr)
    return kept["code"]


def _well_formed(kept: Any) -> bool:
    """Whether ``kept`` is what ``Recording.keep`` writes."""
    return (isinstance(kept, dict) and set(kept) == KEPT_FIELDS
            and all(isinstance(kept[k], str) for k in ("stdout", "stderr", "when"))
            and type(kept["code"]) is int and kept["code"] in KEPT_CODES
            and _WHEN.fullmatch(kept["when"]) is not None)


class _Tee:
    """A text stream that writes through to ``stream`` and keeps a copy; everything else
    (``isatty``, ``fileno``, ``encoding``) is the stream's, so what renders is unchanged."""

    def __init__(self, stream: Any) -> None:
        self.stream, self.copy = stream, io.StringIO()

    def write(self, text: str) -> int:
        self.copy.write(text)
        return self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


class Recording:
    """What a command prints while it answers; ``keep(code)`` stores it, with the exit code,
    under the question's key."""

    def __init__(self, key: str | None) -> None:
        self.key = key
        self.out: _Tee | None = None
        self.err: _Tee | None = None

    def keep(self, code: int = 0) -> None:
        if self.key is None or self.out is None or self.err is None or code not in KEPT_CODES:
            return
        when = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime())
        answer_store().put(self.key, {"stdout": self.out.copy.getvalue(),
                                      "stderr": self.err.copy.getvalue(), "when": when,
                                      "code": code})


@contextlib.contextmanager
def recording(key: str | None) -> Iterator[Recording]:
    """Tee stdout and stderr while the command runs (nothing when ``key`` is None)."""
    rec = Recording(key)
    if key is None:
        yield rec
        return
    saved = sys.stdout, sys.stderr
    rec.out, rec.err = _Tee(sys.stdout), _Tee(sys.stderr)
    sys.stdout, sys.stderr = rec.out, rec.err
    try:
        yield rec
    finally:
        sys.stdout, sys.stderr = saved
