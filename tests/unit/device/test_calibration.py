"""``hf-memkit calibrate`` and the calibration store (issue 13, item 6), on this CPU machine.

What needs a real GPU (``measure_calibration``'s readings, the ``--check`` Trainer runs in their
child processes) cannot run here; the store, the CLI's orchestration (with the child processes
replaced) and the child plumbing (a real child that fails for want of CUDA) do here;
``MemoryCallback(calibrate=True)`` (a real Trainer on CPU, with the CUDA allocator stats and NVML
faked) is in tests/integration/test_calibrating_callback.py.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
import subprocess
import sys
from datetime import datetime, timedelta, timezone

import pytest
import torch
from transformers import LlamaConfig

import hf_memkit as mk
from hf_memkit import HfMemkitError
from hf_memkit import _store as store
from hf_memkit._cuda import runtime as _cuda
from hf_memkit._device import calibration as calmod
from hf_memkit._device import measure as measure_mod
from hf_memkit._device.calibration import (
    Calibration,
    add_residual,
    calibration_dir,
    calibration_key,
    find_calibration,
    load_calibration,
    record_residual,
    save_calibration,
)
from hf_memkit._device.measure import measure_calibration, reference_config
from hf_memkit._units import GiB, MiB
from hf_memkit.commands import calibrate as calibrate_cmd
from hf_memkit.commands.main import main
from tests.helpers import A100_80

H100 = "NVIDIA H100 80GB HBM3"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_MEMKIT_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "calibration"


def make_cal(**kw) -> Calibration:
    d = dict(gpu=H100, driver="550.54.15", torch="2.5.1+cu124", cuda="12.4",
             context=520 * MiB, context_at_init=310 * MiB, cublas_workspace=2 * (32 * MiB + 128 * 1024),
             reserved_over_allocated=1.07, created="2025-01-02T03:04:05+00:00")
    d.update(kw)
    return Calibration(**d)


# ----------------------------------------------------------------------------------------------
# The CLI on a machine without CUDA
# ----------------------------------------------------------------------------------------------


def test_calibrate_without_cuda_exits_2(capsys):
    for argv in (["calibrate"], ["calibrate", "--check", "--json"], ["calibrate", "--device", "1"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "hf-memkit calibrate: error: calibration needs a CUDA GPU" in err
        assert "catalog GPU work without one" in err and "--gpu A100-80GB" in err


def test_calibrate_console_entry_exits_2_without_cuda(tmp_path):
    env = dict(os.environ, HF_MEMKIT_CACHE=str(tmp_path))
    proc = subprocess.run([sys.executable, "-m", "hf_memkit.commands.main", "calibrate"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 2
    assert "calibration needs a CUDA GPU" in proc.stderr
    assert not (tmp_path / "calibration").exists()          # nothing stored


def test_root_help_and_command_help_name_calibrate(capsys):
    with pytest.raises(SystemExit):
        main(["calibrate", "--help"])
    out = capsys.readouterr().out
    assert "--check" in out and "--device" in out and "Examples:" in out
    assert main([]) == 2
    assert "hf-memkit calibrate" in capsys.readouterr().out


def test_measure_calibration_needs_cuda():
    with pytest.raises(HfMemkitError, match="calibration needs a CUDA GPU"):
        measure_calibration(0)


def test_worker_child_reports_bad_input_as_hfmemkit_error(cache):
    """The real child process: on this machine measure_calibration fails for want of CUDA, and
    the parent raises that message (exit 2 in the CLI), not a traceback."""
    with pytest.raises(HfMemkitError, match="calibration needs a CUDA GPU"):
        calibrate_cmd.run_worker("measure", {}, 0)


@pytest.fixture
def gpu_machine(monkeypatch):
    """``gpu_machine(gpus)``: tests.fakes' machine with NVML and torch.cuda installed."""
    from tests.fakes import Machine, install_cuda, install_nvml

    for var in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.setenv(var, "")     # recorded, so that what the code under test sets
        monkeypatch.delenv(var)         # is undone after the test

    def make(gpus):
        m = Machine(gpus)
        install_nvml(m, monkeypatch)
        m.cuda = install_cuda(m, monkeypatch)
        return m

    return make


def test_each_child_is_pinned_to_its_device_by_full_uuid(gpu_machine, monkeypatch):
    """Issue 25, defect 3: the child sees the parent's device whatever CUDA's order; a UUID
    prefix is widened to the full UUID, a MIG instance named by its MIG- UUID."""
    from hf_memkit._device.nvml import pinned_entry
    from tests.fakes import a100, mig_uuid_of, t4, uuid_of

    m = gpu_machine([t4(0x07, 0), a100(0x41, 1), a100(0x81, 2, migs=[("3g.40gb", 40 * GiB)])])
    assert pinned_entry(0) == uuid_of(1)        # FASTEST_FIRST: the A100, not PCI's first
    assert pinned_entry(2) == uuid_of(0)
    # one list each: CUDA reads a GPU-,MIG- list as its GPU- entries only (torch's rules)
    for prefix, full in ((uuid_of(0)[:32], uuid_of(0)),
                         (mig_uuid_of(2, 0)[:24], mig_uuid_of(2, 0))):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", prefix)
        assert pinned_entry(0) == full
    assert not m.this.context                   # and no CUDA context was made to find out


def _fake_measurement(monkeypatch, machine, workspace=8 * MiB, step=(3 * GiB, 3 * GiB + 96 * MiB)):
    """What only a GPU can run, done to the fake machine: the context-making tensor, the
    workspaces' matmuls and the reference step (its peaks, and its segments left reserved)."""
    uuid = lambda: machine.cuda.target().uuid  # noqa: E731

    monkeypatch.setattr(measure_mod, "_open_context", lambda device: machine.open_context(uuid()))

    def workspaces(device, dtypes):
        machine.allocate(uuid(), workspace)
        return workspace, 0

    def reference_step(device, bf16):
        machine.allocate(uuid(), step[1])
        machine.release(uuid(), step[1])
        return step

    monkeypatch.setattr(measure_mod, "_workspaces", workspaces)
    monkeypatch.setattr(measure_mod, "_reference_step", reference_step)


@pytest.mark.parametrize("visible", ["mig-prefix", "gpu-prefix"])
def test_calibration_measures_a_mig_slice_without_root_and_a_uuid_prefix(gpu_machine,
                                                                         monkeypatch, visible):
    """Issue 25, defects 2 and 8: the slice is read through its own handle (the parent's
    memory needs root), a UUID prefix is looked up by the UUID torch reports, and the context
    is this process's own: neither the neighbour in the slice nor the driver's reservation."""
    from tests.fakes import a100, mig_uuid_of, uuid_of

    m = gpu_machine([a100(0x07, 0, migs=[("3g.40gb", 40 * GiB), ("3g.40gb", 40 * GiB)]),
                     a100(0x41, 1)])
    target = mig_uuid_of(0, 1) if visible == "mig-prefix" else uuid_of(1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", target[:24] if visible == "mig-prefix"
                       else target[:32])
    m.spawn(555, target, 6 * GiB)                         # another tenant of that device
    m.target(target).reserved = 200 * MiB
    _fake_measurement(monkeypatch, m)
    cal = measure_calibration(0)
    assert cal.context == cal.context_at_init == m.context_bytes
    assert cal.cublas_workspace == 8 * MiB
    assert cal.reserved_over_allocated == pytest.approx((3 * GiB + 96 * MiB) / (3 * GiB))
    assert cal.gpu == ("NVIDIA A100-SXM4-80GB MIG 3g.40gb" if visible == "mig-prefix"
                       else "NVIDIA A100-SXM4-80GB")


def test_calibration_refuses_clearly_when_nvml_cannot_read_the_device(gpu_machine, monkeypatch):
    import pynvml

    from tests.fakes import a100, mig_uuid_of

    m = gpu_machine([a100(0x07, 0, migs=[("3g.40gb", 40 * GiB)])])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", mig_uuid_of(0, 0))
    m.nvml_errors["nvmlDeviceGetMemoryInfo"] = pynvml.NVML_ERROR_NO_PERMISSION
    _fake_measurement(monkeypatch, m)
    with pytest.raises(HfMemkitError, match=r"NVML cannot read CUDA device 0's memory "
                                            r"\(NVMLError_NoPermission"):
        measure_calibration(0)


# ----------------------------------------------------------------------------------------------
# The CLI's orchestration on fakes: the two child processes replaced by canned results
# ----------------------------------------------------------------------------------------------


def _fake_worker(measured: Calibration, calls: list):
    def run(kind, payload, index):
        calls.append((kind, payload.get("name"), index))
        if kind == "measure":
            return {"calibration": measured.to_dict()}
        n = len(calls)
        return {"name": payload["name"], "fields": {}, "seq_len": payload["seq_len"],
                "predicted": {"allocated": 3 * GiB, "reserved": 3 * GiB + 200 * MiB,
                              "device_used": 4 * GiB},
                "measured": {"allocated": 3 * GiB, "reserved": 3 * GiB + 100 * MiB,
                             "device_used": 4 * GiB + n * 64 * MiB}}
    return run


def test_calibrate_check_stores_measurement_and_residuals(cache, fake_cuda, monkeypatch, capsys):
    fake_cuda([A100_80, A100_80])
    measured = make_cal(gpu=A100_80.name, created="2025-03-01T00:00:00+00:00")
    # residuals of the same GPU/driver/torch/CUDA carry over; another driver's do not
    save_calibration(make_cal(gpu=A100_80.name, residuals=(0.01, -0.02),
                              created="2025-02-01T00:00:00+00:00"))
    save_calibration(make_cal(gpu=A100_80.name, driver="535.0", residuals=(0.5,)))
    calls: list = []
    monkeypatch.setattr(calibrate_cmd, "run_worker", _fake_worker(measured, calls))
    assert main(["calibrate", "--device", "1", "--check", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [c[0] for c in calls] == ["measure"] + ["check"] * len(calibrate_cmd.CHECKS)
    assert {c[2] for c in calls} == {1}
    new = [(4 * GiB + n * 64 * MiB) / (4 * GiB) - 1 for n in (2, 3, 4)]
    stored = find_calibration(A100_80.name, "12.4", driver="550.54.15")
    assert stored.residuals == pytest.approx((0.01, -0.02, *new))
    assert stored.context == measured.context and stored.created == measured.created
    assert out["path"] == str(stored.path)
    assert [r["residual"] for r in out["checks"]] == pytest.approx(new)
    assert out["calibration"]["residuals"] == pytest.approx(list(stored.residuals))


def test_calibrate_table_output(cache, fake_cuda, monkeypatch, capsys):
    fake_cuda([A100_80])
    monkeypatch.setattr(calibrate_cmd, "run_worker", _fake_worker(make_cal(gpu=A100_80.name), []))
    assert main(["calibrate"]) == 0
    out = capsys.readouterr().out
    assert "520.00 MiB" in out and "310.00 MiB" in out and "1.070" in out
    assert "stored in" in out and str(cache) in out.replace("\n", "")
    assert "Predicted / measured" not in out                  # no --check, no check table


def test_calibrate_bad_device_index_exits_2(fake_cuda, capsys):
    fake_cuda([A100_80])
    assert main(["calibrate", "--device", "3"]) == 2
    assert "--device 3 does not exist" in capsys.readouterr().err


def test_check_setups_are_valid_estimator_inputs():
    """Each --check setup reads as the setup it names, with the TrainingArguments field names of
    the installed transformers (checkpointing under its current name); the reference model is
    the 2-layer fp32 Llama the docs describe."""
    from hf_memkit._setup.setup import normalize_args

    config = reference_config()
    assert config.num_hidden_layers == 2 and config.vocab_size == 32000
    assert config.hidden_size == 2048 and config.dtype == torch.float32
    for setup in calibrate_cmd.CHECKS:
        for bf16 in (True, False):
            read = normalize_args(calibrate_cmd.check_fields(setup, bf16=bf16))
            assert read.checkpointing == setup.checkpointing
            assert read.amp == (("bf16" if bf16 else "fp16") if setup.amp else None)
            assert (read.micro_batch, read.optim) == (setup.batch, setup.optim)


def test_reference_step_fits_the_free_memory_asked_for():
    """The largest setup the GPU runs (the reference step, fp32 AdamW, batch 4 x 512) predicts
    below the free memory measure_calibration requires."""
    import hf_memkit as mk

    est = mk.estimate_memory(reference_config(), {"per_device_train_batch_size": 4,
                                                  "optim": "adamw_torch"},
                             seq_len=measure_mod.REFERENCE_SEQ_LEN, device="H100-80GB",
                             task="causal-lm")
    assert 3 * GiB < est.device_used < measure_mod.REFERENCE_MIN_FREE


# ----------------------------------------------------------------------------------------------
# The store
# ----------------------------------------------------------------------------------------------


def test_round_trip_through_the_cache(cache):
    cal = make_cal(residuals=(0.01, -0.03))
    path = save_calibration(cal)
    assert path.parent == cache and path.suffix == ".json"
    assert json.loads(path.read_text())["context"] == 520 * MiB
    found = find_calibration(H100.lower(), "12.4")            # name: case-insensitive
    assert found == cal and found.path == path
    assert load_calibration(path) == cal
    assert Calibration.from_dict(json.loads(json.dumps(cal.to_dict()))) == cal
    assert [p.name for p in cache.iterdir()] == [path.name]  # no temporary file left behind


def test_save_fills_in_created_and_overwrites_its_key(cache):
    p1 = save_calibration(make_cal(created=""))
    created = load_calibration(p1).created
    assert created and calmod._timestamp(created) is not None
    p2 = save_calibration(make_cal(context=1))
    assert p1 == p2 and load_calibration(p2).context == 1


def test_find_matches_gpu_and_cuda_and_newest_wins(cache):
    old = make_cal(driver="535.104.05", created="2024-06-01T00:00:00+00:00")
    new = make_cal(driver="550.54.15", created="2025-06-01T00:00:00+00:00")
    other_torch = make_cal(torch="2.4.0+cu121", created="2023-01-01T00:00:00+00:00")
    for c in (new, old, other_torch):
        save_calibration(c)
    assert find_calibration(H100, "12.4") == new
    assert find_calibration(H100, "12.4", driver="535.104.05") == old
    assert find_calibration(H100, "12.4", torch_version="2.4.0+cu121") == other_torch
    assert find_calibration(H100, "12.4", driver="999.0") is None
    assert find_calibration(H100, "11.8") is None                  # another CUDA
    assert find_calibration(H100, None) is None
    assert find_calibration("NVIDIA H100", "12.4") is None          # names match exactly
    assert find_calibration("NVIDIA H100 PCIe", "12.4") is None


def test_a_calibration_dated_in_the_future_never_wins(cache):
    """The newest calibration is the one used: a file dated past this machine's clock (more
    than a day of skew) would win forever, so it is refused like any other bad value."""
    now = datetime.now(timezone.utc)
    real = make_cal(created=(now - timedelta(days=1)).isoformat(timespec="seconds"))
    save_calibration(real)
    planted = save_calibration(make_cal(driver="535.104.05"))
    d = json.loads(planted.read_text())
    d["created"] = (now + timedelta(days=3650)).isoformat(timespec="seconds")
    planted.write_text(json.dumps(d))
    future = "(?s)" + re.escape(str(planted)) + ".*more than a day ahead of this machine's clock"
    with pytest.warns(UserWarning, match=future):
        assert find_calibration(H100, "12.4") == real
    skewed = (now + timedelta(hours=2)).isoformat(timespec="seconds")  # a clock a little ahead
    assert make_cal(created=skewed).created == skewed


@pytest.mark.skipif(not hasattr(os, "getuid"), reason="owners and modes are POSIX")
def test_a_calibration_folder_others_may_write_is_not_used(cache, monkeypatch):
    monkeypatch.setattr(store, "_WARNED", set())
    save_calibration(make_cal())
    assert stat.S_IMODE(cache.stat().st_mode) == stat.S_IMODE(cache.parent.stat().st_mode) \
        == 0o700                                            # created as this user's own
    cache.chmod(0o777)
    with pytest.warns(UserWarning, match=f"the cache folder {re.escape(str(cache))} is "
                                         "writable by group or others"):
        assert find_calibration(H100, "12.4") is None
    with pytest.raises(HfMemkitError, match="the calibration is not saved: .*chmod go-w"):
        save_calibration(make_cal())


def test_find_without_a_cache_dir_is_none(cache):
    assert not cache.exists()
    assert find_calibration(H100, "12.4") is None


@pytest.mark.parametrize("text, problem", [
    ("{not json", "Expecting property name"),
    ('{"gpu": "NVIDIA H100 80GB HBM3"}', "missing field(s): driver, torch, cuda, context"),
    (None, "`context` must be a non-negative integer of bytes, got 'lots'"),
    ("[1, 2]", "expected a JSON object"),
])
def test_corrupt_file_gives_a_clear_error(cache, text, problem):
    """load_calibration (a file the caller names) raises; find_calibration (what every estimate
    calls) skips the file with the same words as a warning: a broken cache file never stops an
    estimate."""
    path = save_calibration(make_cal())
    if text is None:
        d = json.loads(path.read_text())
        d["context"] = "lots"
        text = json.dumps(d)
    path.write_text(text)
    with pytest.raises(HfMemkitError) as e:
        load_calibration(path)
    with pytest.warns(UserWarning) as w:
        assert find_calibration(H100, "12.4") is None
    for msg in (str(e.value), str(w[0].message)):
        assert str(path) in msg and "re-run `hf-memkit calibrate`" in msg
        assert problem in msg
    assert "uncalibrated band" in str(w[0].message)


def test_calibration_dir_default_locations(monkeypatch, tmp_path):
    monkeypatch.delenv("HF_MEMKIT_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert calibration_dir() == tmp_path / "xdg" / "hf_memkit" / "calibration"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert calibration_dir() == tmp_path / "home" / ".cache" / "hf_memkit" / "calibration"
    monkeypatch.setenv("HF_MEMKIT_CACHE", str(tmp_path / "mine"))
    assert calibration_dir() == tmp_path / "mine" / "calibration"


def test_calibration_key_is_file_name_safe_and_distinct():
    keys = {calibration_key(H100, "550.54.15", "2.5.1+cu124", "12.4"),
            calibration_key(H100, "535.104.05", "2.5.1+cu124", "12.4"),
            calibration_key(H100, "550.54.15", "2.5.1+cu121", "12.4"),
            calibration_key(H100, "550.54.15", "2.5.1+cu124", "12.1"),
            calibration_key("NVIDIA A100-SXM4-80GB", "550.54.15", "2.5.1+cu124", "12.4"),
            calibration_key("../weird/GPU name:*?", None, "2.5.1", None)}
    assert len(keys) == 6
    assert all(re.fullmatch(r"[a-z0-9._-]+", k) and ".." not in k for k in keys)


def test_invalid_values_are_rejected_together():
    with pytest.raises(HfMemkitError) as e:
        make_cal(context=-1, reserved_over_allocated=float("nan"), gpu="")
    msg = str(e.value)
    assert "`context`" in msg and "`reserved_over_allocated`" in msg and "`gpu`" in msg


def test_add_residual_keeps_the_newest_50_and_rel_sigma():
    cal = make_cal()
    assert cal.rel_sigma is None
    cal = add_residual(cal, 110, 100)
    cal = add_residual(cal, 80, 100)
    assert cal.residuals == pytest.approx((0.1, -0.2)) and cal.rel_sigma is None
    cal3 = add_residual(cal, 105, 100)
    rms = math.sqrt((0.01 + 0.04 + 0.0025) / 3)
    assert cal3.residual_rms == pytest.approx(rms)
    assert cal3.rel_sigma == pytest.approx(rms * calmod.band_factor(3))      # 3 residuals: x3
    assert cal.residuals == pytest.approx((0.1, -0.2))                  # a new object
    for i in range(60):
        cal3 = add_residual(cal3, 1000 + i, 1000)
    assert len(cal3.residuals) == 50
    assert cal3.residuals[-1] == pytest.approx(0.059)                     # newest last
    assert cal3.residuals[0] == pytest.approx(0.010)                      # the 11th of 60
    with pytest.raises(HfMemkitError, match="predicted"):
        add_residual(cal, 100, 0)
    with pytest.raises(HfMemkitError, match="measured"):
        add_residual(cal, -5, 100)


def test_record_residual_appends_to_the_matching_file(cache):
    assert record_residual(110, 100, gpu=H100, cuda="12.4") is None     # nothing stored yet
    path = save_calibration(make_cal())
    assert record_residual(90, 100, gpu=H100, cuda="12.4", driver="550.54.15",
                           torch_version="2.5.1+cu124") == path
    assert load_calibration(path).residuals == pytest.approx((-0.1,))


# -- a calibration changes the estimate ----------------------------------------------------------


def _probed_a100():
    """A100 as probe_device would describe it (the catalog entry names a model of GPU, not a
    measured card, so only a probed device takes a calibration)."""
    return mk.get_device("A100-80GB").replace(name="NVIDIA A100-SXM4-80GB", source="nvml",
                                               driver_version="550.54.15")


def test_a_stored_calibration_changes_the_estimate(cache):
    dev = _probed_a100()
    tiny = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=4, vocab_size=1000)
    args = dict(per_device_train_batch_size=2)

    def est():
        return mk.estimate_memory(tiny, args, seq_len=64, device=dev, cuda_version="12.8")

    before = est()
    assert not any("calibration" in n for n in before.notes)
    ctx, ws = 3 * GiB, 64 * MiB
    path = save_calibration(make_cal(gpu=dev.name, driver=dev.driver_version,
                                     torch=torch.__version__, cuda="12.8", context=ctx,
                                     cublas_workspace=ws, residuals=(0.04, -0.05, 0.06)))
    after = est()
    # the measured context replaces the CUDA-version default, the measured workspaces the
    # CublasHandlePool rule; everything else is the same trace
    assert after.breakdown["context"] == ctx
    assert before.breakdown["context"] == _cuda.cuda_runtime("12.8").context
    ws_before = 2 * (_cuda.cublas_workspace(dev.compute_capability) // 2)
    assert after.peak_allocated - before.peak_allocated == ws - ws_before
    assert after.device_used - before.device_used == (
        ctx - before.breakdown["context"]) + (after.peak_reserved - before.peak_reserved)
    # the band: RMS of (0.04, -0.05, 0.06) widened to what three residuals support (the 95%
    # upper bound of sigma), where that is wider than the per-term band (issue 25: never
    # narrower)
    rms = ((0.04 ** 2 + 0.05 ** 2 + 0.06 ** 2) / 3) ** 0.5
    assert after.uncertainty >= rms * calmod.band_factor(3) * (1 - 1e-6)
    assert any("3 measured residuals" in n for n in after.notes)
    assert any(str(path) in n for n in after.notes)
    # another CUDA version or a catalog device does not take it
    assert mk.estimate_memory(tiny, args, seq_len=64, device=dev, cuda_version="13.0"
                              ).breakdown["context"] != ctx
    assert mk.estimate_memory(tiny, args, seq_len=64, device="A100-80GB", cuda_version="12.8"
                              ).breakdown["context"] != ctx


# -- what the store reads is checked (issue 28) ---------------------------------------------------


def _tampered(path, **fields):
    d = json.loads(path.read_text())
    d.update(fields)
    path.write_text(json.dumps(d))


@pytest.mark.parametrize("fields, words", [
    # 1e200 squared overflows the RMS: refused as a residual no measurement gives
    (dict(residuals=[0.01, 1e200, 0.02]), ["`residuals`", "1e+200", "[-1, 10]"]),
    (dict(residuals=[-3.0, 0.0, 0.0]), ["`residuals`", "-3.0", "[-1, 10]"]),
    (dict(residuals=[0.01] * 51), ["`residuals` holds 51", "at most 50"]),
    (dict(context=10**30), ["`context`", "1000000000000000000000000000000", "at most",
                            "1 TiB"]),
    (dict(cublas_workspace=-1), ["`cublas_workspace`", "-1", "non-negative"]),
])
def test_out_of_range_values_are_refused_and_skipped(cache, fields, words):
    path = save_calibration(make_cal(residuals=(0.01, -0.02, 0.03)))
    _tampered(path, **fields)
    with pytest.raises(HfMemkitError) as e:
        load_calibration(path)
    msg = str(e.value)
    assert str(path) in msg and "re-run `hf-memkit calibrate`" in msg
    for w in words:
        assert w in msg, (w, msg)
    with pytest.warns(UserWarning, match="uncalibrated band"):
        assert find_calibration(H100, "12.4") is None


def test_band_is_never_narrower_than_the_residuals_support():
    """[0, 0, 0] no longer removes the band: the floor (the traced step's CPU-measured sigma)
    holds; and a few residuals widen their RMS to the 95% upper bound of sigma, the factor
    within 4% above the exact chi-square bound (tabled quantiles chi2_0.05(n))."""
    zero = make_cal(residuals=(0.0, 0.0, 0.0))
    assert zero.residual_rms == 0.0 and zero.rel_sigma == calmod.SIGMA_FLOOR == 0.005
    for n, quantile in ((3, 0.3518), (10, 3.9403), (50, 34.7643)):
        exact = math.sqrt(n / quantile)
        assert exact <= calmod.band_factor(n) < 1.04 * exact
    few = make_cal(residuals=(0.02, -0.02, 0.02))
    many = make_cal(residuals=(0.02, -0.02) * 25)
    assert few.residual_rms == pytest.approx(many.residual_rms)
    assert few.rel_sigma > 2.5 * many.residual_rms > many.rel_sigma > many.residual_rms


def test_residuals_widen_the_band_and_never_narrow_it(cache):
    """Issue 25, defect 6: three in-sample residuals of the reference model (what ``calibrate
    --check`` leaves) set every estimate's band before, so a LoRA run's margin fell to a few
    percent of device_used. The per-term band now stays; residuals only widen it."""
    dev = _probed_a100()
    tiny = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=4, vocab_size=1000)

    def estimate(residuals):
        save_calibration(make_cal(gpu=dev.name, driver=dev.driver_version,
                                  torch=torch.__version__, cuda="12.8", residuals=residuals))
        return mk.estimate_memory(tiny, {"per_device_train_batch_size": 2}, seq_len=64,
                                  device=dev, cuda_version="12.8")

    plain = estimate(())
    for small in ((0.0, 0.0, 0.0), (0.01, -0.01, 0.005)):
        est = estimate(small)
        assert est.margin == plain.margin and est.device_used == plain.device_used
        assert any("never narrow" in n for n in est.notes)
    wide = estimate((0.6, -0.6, 0.6))
    assert wide.margin == pytest.approx(2 * make_cal(residuals=(0.6, -0.6, 0.6)).rel_sigma
                                        * wide.device_used, rel=1e-3)
    assert wide.margin > plain.margin
    assert any("wider than the per-term band" in n for n in wide.notes)


def _key_path(cache):
    cache.mkdir(parents=True, exist_ok=True)
    return cache / (calibration_key(H100, "550.54.15", "2.5.1+cu124", "12.4") + ".json")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["directory", "fifo", "dev-zero", "huge", "binary"])
def test_files_that_are_not_a_calibration_are_refused_without_hanging(cache, kind):
    """A directory, a FIFO (opening one for reading would wait for a writer forever),
    /dev/zero (reading it would never end), a file over the size cap and bytes that are not
    text: each refused with the file named, and skipped by find_calibration."""
    path = _key_path(cache)
    if kind == "directory":
        path.mkdir()
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "dev-zero":
        path.symlink_to("/dev/zero")
    elif kind == "huge":
        path.write_text(" " * (calmod.MAX_FILE_BYTES + 1))
    else:
        path.write_bytes(b"\xff\xfe\x00garbage")
    words = {"directory": "not a regular file", "fifo": "not a regular file",
             "dev-zero": "not a regular file", "huge": "larger than 65536 bytes",
             "binary": "not UTF-8"}[kind]
    with pytest.raises(HfMemkitError, match=words) as e:
        load_calibration(path)
    assert str(path) in str(e.value) and "re-run `hf-memkit calibrate`" in str(e.value)
    with pytest.warns(UserWarning, match=words):
        assert find_calibration(H100, "12.4") is None
    if kind == "directory":  # calibrate cannot write over it: said, not a raw OSError
        with pytest.raises(HfMemkitError, match="not a regular file; remove it"):
            save_calibration(make_cal())


def test_a_broken_cache_file_does_not_stop_an_estimate_or_the_cli(cache, capsys):
    """The CLI path: the warning names the file on stderr, the estimate is answered (exit 0)
    with the uncalibrated band."""
    dev = _probed_a100()
    path = _key_path(cache).with_name(calibration_key(dev.name, dev.driver_version,
                                                      torch.__version__, "12.8") + ".json")
    path.write_text('{"residuals": [1e200')
    tiny = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=4, vocab_size=1000)
    with pytest.warns(UserWarning, match="is corrupt"):
        est = mk.estimate_memory(tiny, {"per_device_train_batch_size": 2}, seq_len=64,
                                 device=dev, cuda_version="12.8")
    assert not any("calibration" in n for n in est.notes) and est.margin > 0
