"""Where a training run may write: its output directory, and nothing beyond this machine unless
the command line says so. Checked before any heavy work (no plan, no model).

* ``output_dir`` (the recipe's, ``--output-dir``, or ``train_recipe(output_dir=...)``): a
  relative path stays inside the working directory once resolved, links included (one whose
  ``../`` or a symlinked folder leads out is refused: an absolute path says where, explicitly);
  an absolute path (``~`` included) is the user's own choice only: a recipe is a shared file,
  so its absolute ``output_dir`` is refused unless ``--output-dir`` names it; an existing
  directory that is not empty is refused
  unless ``overwrite`` (the run writes ``config.json``, the weights and its reports over files of
  the same name, another model's included); and it must be writable (a probe file in it, or in
  the nearest folder that exists, is created and removed).
* the Hub and reporting services: the trainer's config always carries ``push_to_hub`` and
  ``report_to`` as the command line set them (``--push-to-hub``, ``--report-to``; default: no
  push, ``report_to="none"``). A pin that asks for either (``push_to_hub: true``, a ``hub_*``
  field, ``report_to: [wandb]``) without the flag is refused, naming the pin and the flag: a run
  that quietly drops a push its recipe asks for is found out hours later, a refusal costs seconds.

Every problem is gathered into one ``ConfigError`` (exit 2).
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

from .._errors import ConfigError, did_you_mean, excerpt, quoted
from .._setup.fields import HUB_FIELDS

SHOWN_ENTRIES = 5   # a non-empty directory's entries named in the refusal
# the package a reporting service needs, where its name is not the service's
REPORT_PACKAGES = {"azure_ml": "azureml-core", "comet_ml": "comet-ml"}


# -- output_dir ---------------------------------------------------------------------------------

def output_dir_problems(path: str, *, key: str, overwrite: bool = False,
                        shared: bool = False) -> list[str]:
    """Why the run may not write to ``path`` (``key``: how messages name it). ``shared``: the
    path comes from a file others write (a recipe), so only a relative path inside the working
    directory is honoured; an absolute one needs the user's ``--output-dir``."""
    if not isinstance(path, str) or not path.strip():
        return [f"{key}: expected a directory path, got {quoted(path)}"]
    if "\0" in path:
        return [f"{key}: {quoted(path)} holds a NUL character; give a directory path"]
    typed, path = path, os.path.expanduser(path)
    if shared and os.path.isabs(path):
        return [f"{key}: `{excerpt(typed)}` is an absolute path; a recipe is a shared file and "
                "writes only inside the working directory: to train into that folder, say so "
                f"yourself with --output-dir {excerpt(path)} (train_recipe(..., output_dir=...)), "
                "or give a relative output_dir"]
    cwd = os.path.realpath(os.getcwd())
    full = os.path.normpath(os.path.join(cwd, path))
    real = os.path.realpath(full)
    if not os.path.isabs(path) and os.path.commonpath([cwd, real]) != cwd:
        via = "" if real == full else " through a symbolic link"
        return [f"{key}: `{excerpt(path)}` resolves{via} to {real}, outside the working directory "
                f"{cwd}; a relative output directory stays inside it: to write there, give the "
                f"absolute path ({real})"]
    full = real
    if os.path.exists(full) and not os.path.isdir(full):
        return [f"{key}: `{path}` is a file, not a directory; choose another output directory"]
    if os.path.isdir(full) and not overwrite:
        entries = sorted(os.listdir(full))
        if entries:
            return [f"{key}: `{path}` is not empty: it holds {_listing(full, entries)}; training "
                    "writes config.json, the weights and the memory report there, replacing "
                    "files of the same name (another model's too). Pass --overwrite "
                    "(train_recipe(..., overwrite=True)) to train into it anyway, or choose a "
                    "new or empty directory"]
    problem = _write_probe(full)
    return [f"{key}: cannot write to `{path}`: {problem}; choose a directory you can write "
            "to"] if problem else []


def _listing(folder: str, entries: list[str]) -> str:
    shown = [e + ("/" if os.path.isdir(os.path.join(folder, e)) else "")
             for e in entries[:SHOWN_ENTRIES]]
    more = len(entries) - len(shown)
    return ", ".join(shown) + (f" and {more} more" if more else "")


def _write_probe(full: str) -> str | None:
    """Why nothing can be written at ``full`` (a folder that may not exist yet), or None: a probe
    file is created and removed in it, or in the nearest of its parents that exists."""
    base = full
    while not os.path.exists(base):
        base = os.path.dirname(base)
    if not os.path.isdir(base):
        return f"{base} is a file, not a directory"
    try:
        fd, probe = tempfile.mkstemp(dir=base, prefix=".hf_memkit_write_probe_")
    except OSError as exc:
        return f"{exc.strerror or exc} ({base})"
    os.close(fd)
    os.unlink(probe)
    return None


# -- the Hub and reporting services -------------------------------------------------------------

def report_services(value: Any) -> list[str] | None:
    """``report_to`` as a list of service names (``[]``: none), or None when it is no name or
    list of names."""
    if value is None:
        return []
    if isinstance(value, str):
        value = [s.strip() for s in value.split(",") if s.strip()]
    if not isinstance(value, (list, tuple)) or not all(isinstance(s, str) for s in value):
        return None
    return [s for s in value if s != "none"]


def check_report_flag(value: Any, *, key: str = "--report-to") -> list[str]:
    """The services ``--report-to`` names (``all``: every installed integration; ``none``: no
    service), each one transformers knows; ``ConfigError`` otherwise."""
    from transformers.integrations.integration_utils import (
        INTEGRATION_TO_CALLBACK,
        get_available_reporting_integrations,
    )

    services = report_services(value)
    known = [*INTEGRATION_TO_CALLBACK, "all", "none"]
    if services is None:
        raise ConfigError([f"{key}: expected service names separated by commas (e.g. wandb or "
                           f"wandb,tensorboard), got {quoted(value)}"], source="command line")
    bad = [s for s in services if s not in known]
    if bad:
        raise ConfigError([f"{key}: unknown service {quoted(s)}{did_you_mean(s, known)}; "
                           f"allowed: {', '.join(known)}" for s in bad], source="command line")
    here = get_available_reporting_integrations()
    missing = [s for s in services if s not in ("all", *here)]
    if missing:   # transformers' callback raises only when the trainer is built, after the plan
        raise ConfigError([f"{key}: {s} is not installed here, and transformers reports to it "
                           f"through its package: pip install {REPORT_PACKAGES.get(s, s)}, or "
                           f"leave it out (installed: {', '.join(here) or 'none'})"
                           for s in missing], source="command line")
    return services


def outbound_problems(pins: dict[str, Any], *, where: str, push_to_hub: bool,
                      report_to: list[str]) -> list[str]:
    """The pins that push to the Hub or report to a service the command line did not allow."""
    problems = []
    if not push_to_hub:
        for k in HUB_FIELDS:
            v = pins.get(k)
            if v is None or v is False:
                continue
            shown = "set" if k == "hub_token" else quoted(v)  # a token is never shown
            what = ("pushes the model to the Hugging Face Hub" if k == "push_to_hub" else
                    "configures a push to the Hugging Face Hub")
            problems.append(f"{where}: pins.{k}: {shown} {what}; `hf-memkit train` pushes only "
                            "when told: add --push-to-hub (train_recipe(..., push_to_hub=True)), "
                            "or drop the pin")
    asked = report_services(pins.get("report_to"))
    if asked is None:
        problems.append(f"{where}: pins.report_to: expected a service name or a list of them "
                        f"(e.g. [wandb]), got {quoted(pins.get('report_to'))}")
    elif "all" not in report_to:
        missing = [s for s in asked if s not in report_to]
        if missing:
            services = "every installed integration" if "all" in missing else ", ".join(missing)
            problems.append(
                f"{where}: pins.report_to: {quoted(pins['report_to'])} reports the run to "
                f"{services}; `hf-memkit train` reports to no service unless told: add --report-to "
                f"{','.join([*report_to, *missing])} (train_recipe(..., report_to=[...])), or "
                "drop the pin")
    return problems


def outbound_args(*, push_to_hub: bool, report_to: list[str]) -> dict[str, Any]:
    """The trainer config's ``push_to_hub`` and ``report_to``, exactly as the command line set
    them (the default: no push, ``report_to="none"``)."""
    return {"push_to_hub": bool(push_to_hub), "report_to": list(report_to) or "none"}
