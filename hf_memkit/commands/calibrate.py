"""``hf-memkit calibrate``: measure this machine's GPU so that estimates for it use what it shows.

Every measurement runs in a child process that sees only the chosen GPU (``CUDA_VISIBLE_DEVICES``):
the calibration needs a process without a CUDA context yet, and NVML's figure is device-wide, so
this process never creates a context of its own (it asks torch only ``is_available`` and
``device_count``). ``--check`` then trains the reference model for ``CHECK_STEPS`` steps through
``transformers.Trainer`` in one fresh child per setup of ``CHECKS``, predicts the same setup with
``estimate_memory(..., device=probe_device())`` in that child before any tensor exists, and
appends measured/predicted - 1 of ``device_used`` to the stored calibration.

Exit codes: 2 without CUDA or on bad input; 1 when a measuring process fails.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._device.calibration import (
    Calibration,
    add_residual,
    calibration_dir,
    find_calibration,
    save_calibration,
)
from .._errors import HfMemkitError, TrainingFailed
from .._units import format_bytes
from .estimate import device_index

if TYPE_CHECKING:
    from rich.table import Table

CHECK_STEPS = 4          # peaks of steps 2..4 (the first step's lazy allocations excluded)
WORKER_TIMEOUT = 900     # seconds per child process
NO_CUDA = ("calibration needs a CUDA GPU: it measures this machine's CUDA context, cuBLAS "
           "workspaces and allocator overhead, and torch sees no CUDA device here. Plans and "
           "estimates for a catalog GPU work without one, e.g. `hf-memkit estimate MODEL --gpu "
           "A100-80GB ...` (list: `hf-memkit devices`)")


@dataclass(frozen=True)
class CheckSetup:
    """One training setup ``--check`` runs and predicts (the reference model, batch x seq_len)."""

    name: str
    batch: int
    seq_len: int
    optim: str = "adamw_torch"
    amp: bool = False            # bf16 autocast where the GPU has bf16, else fp16
    checkpointing: bool = False


CHECKS = (
    CheckSetup("fp32, AdamW", batch=4, seq_len=512),
    CheckSetup("AMP + checkpointing, AdamW", batch=4, seq_len=512, amp=True, checkpointing=True),
    CheckSetup("AMP, Adafactor", batch=8, seq_len=256, optim="adafactor", amp=True),
)


def calibrate_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "calibrate", help="measure this GPU's context and allocator overhead (CUDA only)",
        description="Measure CUDA device N: the CUDA context (at init and after a reference "
                    "training step), cuBLAS workspaces and the allocator's reserved/allocated "
                    f"ratio; store them under {calibration_dir()} ($HF_MEMKIT_CACHE/calibration "
                    "when set) for this GPU, driver, torch and CUDA.",
        epilog="Examples:\n  hf-memkit calibrate\n  hf-memkit calibrate --device 1 --check\n"
               "  hf-memkit calibrate --json\n"
               "Needs a CUDA GPU with about 6 GiB free; plans for catalog GPUs do not.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--device", type=device_index, default=0, metavar="N",
                   help="CUDA device index")
    p.add_argument("--check", action="store_true",
                   help=f"also train {len(CHECKS)} small setups, print predicted vs measured "
                        "and store the residuals")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    return p


def run_calibration(index: int, *, check: bool = False) -> tuple[Calibration, Path,
                                                                list[dict[str, Any]]]:
    """Measure CUDA device ``index`` (a child process), store it (keeping the residuals of an
    earlier calibration of the same GPU, driver, torch and CUDA), and with ``check`` run
    ``CHECKS`` (one child each), appending each residual. (calibration, its path, check rows)."""
    _require_cuda(index)
    cal = Calibration.from_dict(run_worker("measure", {}, index)["calibration"])
    previous = find_calibration(cal.gpu, cal.cuda, driver=cal.driver, torch_version=cal.torch)
    if previous is not None:
        cal = dataclasses.replace(cal, residuals=previous.residuals)
    path = save_calibration(cal)
    rows = []
    for setup in CHECKS if check else ():
        row = run_worker("check", dataclasses.asdict(setup), index)
        measured, predicted = row["measured"]["device_used"], row["predicted"]["device_used"]
        row["residual"] = measured / predicted - 1
        cal = add_residual(cal, measured, predicted)
        path = save_calibration(cal)
        rows.append(row)
    return cal, path, rows


def calibrate_command(args: argparse.Namespace) -> int:
    from rich.console import Console

    cal, path, rows = run_calibration(args.device, check=args.check)
    if args.json:
        print(json.dumps({"calibration": cal.to_dict(), "path": str(path), "checks": rows},
                         indent=2))
    else:
        console = Console()
        console.print(calibration_table(cal))
        if rows:
            console.print(check_table(rows))
        console.print(f"stored in {path}")
    return 0


def _require_cuda(index: int) -> None:
    import torch

    try:
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # a broken driver install
        count = 0
    if count == 0:
        raise HfMemkitError(NO_CUDA)
    if not 0 <= index < count:
        raise HfMemkitError(f"--device {index} does not exist; this machine shows {count} CUDA "
                            f"device(s): 0..{count - 1}")


# ----------------------------------------------------------------------------------------------
# Child processes
# ----------------------------------------------------------------------------------------------

_CHILD = ("import sys; from hf_memkit.commands.calibrate import worker_main; "
          "sys.exit(worker_main(sys.argv[1:]))")


def run_worker(kind: str, payload: dict[str, Any], index: int) -> dict[str, Any]:
    """Run ``worker_main`` (``kind`` = "measure" or "check") in a fresh process that sees only
    CUDA device ``index``; its JSON result. Bad input there raises ``HfMemkitError`` here, any
    other failure ``TrainingFailed``."""
    from .._device.nvml import pinned_entry

    env = dict(os.environ, CUDA_VISIBLE_DEVICES=pinned_entry(index))
    env.setdefault("TRANSFORMERS_VERBOSITY", "error")
    with tempfile.TemporaryDirectory(prefix="hf_memkit_calibrate_") as tmp:
        out = os.path.join(tmp, "result.json")
        try:
            proc = subprocess.run([sys.executable, "-c", _CHILD, kind, json.dumps(payload), out],
                                  env=env, capture_output=True, text=True, timeout=WORKER_TIMEOUT)
        except subprocess.TimeoutExpired as exc:
            raise TrainingFailed(f"the {kind} process ran past {WORKER_TIMEOUT} s") from exc
        result = None
        if os.path.exists(out):
            with open(out) as f:
                result = json.load(f)
    if result is not None and "error" in result:
        raise HfMemkitError(result["error"])
    if proc.returncode != 0 or result is None:
        raise TrainingFailed(f"the {kind} process failed (exit {proc.returncode}):\n"
                             f"{proc.stderr[-3000:]}")
    return result


def worker_main(argv: list[str]) -> int:
    """The child's entry: ``KIND PAYLOAD_JSON OUT_PATH``; writes a JSON result to OUT_PATH."""
    kind, payload, out = argv[0], json.loads(argv[1]), argv[2]
    try:
        if kind == "measure":
            from .._device.measure import measure_calibration

            result, rc = {"calibration": measure_calibration(0).to_dict()}, 0
        elif kind == "check":
            result, rc = measure_check(CheckSetup(**payload)), 0
        else:
            raise HfMemkitError(f"unknown worker kind `{kind}`; known: measure, check")
    except HfMemkitError as exc:
        result, rc = {"error": str(exc)}, 2
    with open(out, "w") as f:
        json.dump(result, f)
    return rc


def check_fields(setup: CheckSetup, bf16: bool) -> dict[str, Any]:
    """The TrainingArguments fields of ``setup`` (field names as the installed transformers has)."""
    from .._compat import checkpointing_field

    fields: dict[str, Any] = {"per_device_train_batch_size": setup.batch, "optim": setup.optim}
    if setup.amp:
        fields["bf16" if bf16 else "fp16"] = True
    if setup.checkpointing:
        fields[checkpointing_field()] = True
    return fields


def measure_check(setup: CheckSetup) -> dict[str, Any]:
    """In the child (CUDA device 0): predict ``setup``, then train it through the Trainer and
    read the peaks of steps 2..CHECK_STEPS and NVML used at the last step."""
    import torch
    from transformers import Trainer, TrainingArguments

    from .._compat import require
    from .._device.measure import reference_config, start_nvml
    from .._device.nvml import nvml_handle
    from .._device.probe import probe_device
    from .._estimate import estimate_memory
    from .._model.profile import model_from_config
    from .._run.synthetic import SyntheticTextDataset

    pynvml = require("pynvml", "calibrate --check (NVML used)")
    dev = probe_device(0)
    config = reference_config()
    fields = check_fields(setup, dev.supports_bf16)
    est = estimate_memory(config, fields, seq_len=setup.seq_len, device=dev, task="causal-lm")
    model = model_from_config(config, "causal-lm", device="cpu", dtype=torch.float32)
    data = SyntheticTextDataset(vocab_size=config.vocab_size, seq_len=setup.seq_len,
                                num_samples=setup.batch * CHECK_STEPS)
    start_nvml(pynvml)
    try:
        handle = nvml_handle(pynvml, 0)   # no CUDA context yet: used is the baseline
        baseline = int(pynvml.nvmlDeviceGetMemoryInfo(handle).used)
        probe = step_probe_class()(CHECK_STEPS, pynvml, handle, baseline)
        with tempfile.TemporaryDirectory(prefix="hf_memkit_check_") as out:
            args = TrainingArguments(output_dir=out, max_steps=CHECK_STEPS, report_to=[],
                                     save_strategy="no", disable_tqdm=True, learning_rate=1e-4,
                                     dataloader_num_workers=0, **fields)
            Trainer(model=model, args=args, train_dataset=data, callbacks=[probe]).train()
    finally:
        pynvml.nvmlShutdown()
    if probe.result is None:
        raise RuntimeError(f"the check run of `{setup.name}` ended before step {CHECK_STEPS}")
    return {"name": setup.name, "fields": fields, "seq_len": setup.seq_len, "measured": probe.result,
            "predicted": {"allocated": est.peak_allocated, "reserved": est.peak_reserved,
                          "device_used": est.device_used}}


def step_probe_class() -> type:
    """``StepProbe``, a ``transformers.TrainerCallback`` defined on first use: importing this
    module (the CLI root registers every command's parser) must not import transformers."""
    import torch
    from transformers import TrainerCallback

    from .._device.nvml import own_used

    class StepProbe(TrainerCallback):
        """Resets the CUDA peaks after step 1; at step ``steps`` (after ``synchronize``) reads
        max allocated, max reserved and what this process holds (``nvml.own_used``: its NVML
        entry, else used less ``baseline``), plus reserved bytes freed since the peak."""

        def __init__(self, steps: int, pynvml: Any, handle: Any, baseline: int):
            self.steps, self.pynvml, self.handle, self.baseline = steps, pynvml, handle, baseline
            self.result: dict[str, int] | None = None

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 1:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            elif state.global_step == self.steps:
                torch.cuda.synchronize()
                reserved = int(torch.cuda.max_memory_reserved())
                used = own_used(self.pynvml, self.handle, self.baseline)
                freed = max(0, reserved - int(torch.cuda.memory_reserved()))
                self.result = {"allocated": int(torch.cuda.max_memory_allocated()),
                               "reserved": reserved, "device_used": used + freed}

    return StepProbe


# ----------------------------------------------------------------------------------------------
# Rendering
# ----------------------------------------------------------------------------------------------


def calibration_table(cal: Calibration) -> Table:
    from rich.table import Table

    t = Table(title=f"Calibration of {cal.gpu}", show_header=False)
    t.add_column("field", style="bold")
    t.add_column("value")
    rms, sigma = cal.residual_rms, cal.rel_sigma
    for k, v in (("driver / torch / CUDA", f"{cal.driver or '-'} / {cal.torch} / {cal.cuda or '-'}"),
                 ("context at CUDA init", format_bytes(cal.context_at_init)),
                 ("context after a training step", format_bytes(cal.context)),
                 ("cuBLAS workspaces", format_bytes(cal.cublas_workspace)),
                 ("reserved / allocated", f"{cal.reserved_over_allocated:.3f}"),
                 ("residuals of device_used", f"{len(cal.residuals)}"
                  + (f", RMS {rms:.1%}; band 1-sigma {sigma:.1%} (what "
                     f"{len(cal.residuals)} residuals support)" if sigma is not None else "")),
                 ("measured", cal.created)):
        t.add_row(k, v)
    return t


def check_table(rows: list[dict[str, Any]]) -> Table:
    from rich.table import Table

    t = Table(title=f"Predicted / measured, steps 2..{CHECK_STEPS} (reference model)")
    for col in ("setup", "allocated", "reserved", "NVML used", "NVML error"):
        t.add_column(col, no_wrap=col == "setup")
    for r in rows:
        p, m = r["predicted"], r["measured"]
        t.add_row(r["name"], *(f"{format_bytes(p[k])} / {format_bytes(m[k])}"
                               for k in ("allocated", "reserved", "device_used")),
                  f"{r['residual']:+.1%}")
    return t


def register(sub) -> None:
    calibrate_parser(sub).set_defaults(func=calibrate_command)
