"""What importing hf_memkit and running the CLI costs: no optional stack imported before it is
used, no torch for ``--help``, no third-party notices our own calls trigger. Each check runs in a
fresh interpreter (this process has long imported everything). Timing lives in
bench/cli_speed.py, not here."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import warnings

import pytest

import hf_memkit as mk
from hf_memkit import _compat

OPTIONAL = ("bitsandbytes", "peft", "pynvml", "deepspeed", "matplotlib", "trl")
HEAVY = ("torch", "transformers", *OPTIONAL)
CLI = [sys.executable, "-m", "hf_memkit.commands.main"]


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True)


def modules_after(code: str) -> set[str]:
    """The HEAVY modules loaded in a fresh interpreter after running ``code``."""
    out = run_python(f"{code}\nimport json, sys\n"
                     f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))")
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def test_import_hf_memkit_loads_no_heavy_or_optional_stack():
    assert modules_after("import hf_memkit") == set()


def test_cli_root_loads_no_torch():
    """`hf-memkit` imports every command module to register its parser: none may need torch."""
    assert modules_after("import hf_memkit.commands.main as m; m.build_parser()") == set()


def test_light_public_names_stay_light():
    """The errors and the GPU catalog need neither torch nor transformers."""
    code = ("from hf_memkit import ConfigError, HfMemkitError, get_device, list_devices\n"
            "get_device(list_devices()[0])")
    assert modules_after(code) == set()


def test_help_of_every_command_is_silent_and_loads_no_torch():
    code = ("import sys, runpy\n"
            "for argv in ARGVS:\n"
            "    sys.argv = ['hf-memkit', *argv, '--help']\n"
            "    try:\n"
            "        runpy.run_module('hf_memkit.commands.main', run_name='__main__')\n"
            "    except SystemExit as e:\n"
            "        assert e.code in (0, None), (argv, e.code)\n")
    from hf_memkit.commands.main import COMMANDS

    argvs = [[]] + [[m.__name__.rsplit(".", 1)[1]] for m in COMMANDS]
    proc = run_python(code.replace("ARGVS", repr(argvs))
                      + "import json\nprint(json.dumps([m for m in "
                      + f"{HEAVY!r} if m in sys.modules]))")
    assert proc.stderr == ""
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == []
    assert proc.stdout.count("usage: hf-memkit") == len(argvs)


def test_console_script_help_prints_nothing_on_stderr():
    proc = subprocess.run([*CLI, "--help"], capture_output=True, text=True, check=True)
    assert proc.stderr == "" and "COMMAND" in proc.stdout


def test_every_public_name_resolves_and_is_listed():
    assert set(mk._EXPORTS) | {"__version__"} == set(mk.__all__)
    for name in mk.__all__:
        assert getattr(mk, name) is not None, name
    assert set(mk.__all__) <= set(dir(mk))
    with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
        mk.not_a_name  # noqa: B018
    from hf_memkit import MemoryCallback, plan_training  # noqa: F401
    from hf_memkit.callbacks import MemoryCallback as FromCallbacks

    assert FromCallbacks is mk.MemoryCallback


def test_estimate_command_prints_no_third_party_notice():
    """A real command imports transformers (-> peft -> bitsandbytes) and traces a model: none of
    their notices (bitsandbytes' gemm_4bit_forward, transformers' loss_type) reach stderr."""
    proc = subprocess.run([*CLI, "estimate", "gpt2", "--gpu", "T4", "--seq-len", "64",
                           "--batch", "1", "--json"], capture_output=True, text=True, check=True)
    assert json.loads(proc.stdout)["device_used"] > 0
    assert "gemm_4bit" not in proc.stderr and "loss_type" not in proc.stderr
    assert proc.stderr == ""


def test_field_values_and_our_warnings_print_as_our_own_lines():
    """FIELD=VALUE parsing imports TrainingArguments (-> peft -> bitsandbytes): still no notice;
    our own warning (bf16 on a V100) is one ``hf-memkit estimate: warning:`` line."""
    proc = subprocess.run([*CLI, "estimate", "gpt2", "--gpu", "V100-16GB", "--seq-len", "64",
                           "--batch", "1", "bf16=true", "--json"], capture_output=True,
                          text=True, check=True)
    assert json.loads(proc.stdout)["device_used"] > 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hf-memkit estimate: warning: bf16=True on V100")
    assert "compute capability 8.0" in lines[0] and "fp16=True" in lines[0]


def test_quiet_notices_drops_only_its_notices_and_only_inside():
    name, prefix = _compat.NOTICES[0]
    logger = logging.getLogger(name)
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    handler = Keep()
    logger.addHandler(handler)
    try:
        with _compat.quiet_notices():
            logger.warning(prefix + " from kernels-community: no module")
            logger.warning("another warning of the same logger")
        logger.warning(prefix + " outside")
    finally:
        logger.removeHandler(handler)
    assert seen == ["another warning of the same logger", prefix + " outside"]


def test_quiet_peft_drops_only_the_deprecated_alias_warnings():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with _compat.quiet_peft():
            warnings.warn("`is_gradient_checkpointing` is deprecated and will be removed in v6.",
                          FutureWarning, stacklevel=1)
            warnings.warn("something else", FutureWarning, stacklevel=1)
    assert [str(w.message) for w in caught] == ["something else"]
