"""bench/gpu_truth.py's whole runs. On a CPU (CI): ``--cpu-smoke``, the same parent/child path with
shrunk models trained on the CPU, with bitsandbytes, deepspeed and TRL hidden as on the GPU box
(marked ``slow``). ``gpu``-marked: real cases on a CUDA GPU, the estimate within 10% of what was
measured. The harness's command line, matrix and tables: tests/unit/bench/test_gpu_truth.py."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import BENCH
from tests.unit.bench.test_gpu_truth import (
    DPO_LORA,
    GPU_CASES,
    LIGER,
    SFT,
    SFT_OFFLOAD,
    _run,
)

PRETRAINED = "gpt2-124m.pure_bf16.fwd-bwd.sdpa.pretrained.b4s1024"

sys.path.insert(0, str(BENCH))

import gpu_truth  # noqa: E402  (bench/gpu_truth.py)

_BLOCK = "import sys\nfor _m in {mods!r}:\n    sys.modules[_m] = None  # as if not installed\n"


def _smoke(tmp_path: Path, hidden: tuple[str, ...], *only: str):
    """--cpu-smoke with ``hidden`` modules unimportable in the parent and every child."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(_BLOCK.format(mods=hidden))
    env = {**os.environ, "PYTHONPATH": str(site)}
    out = tmp_path / "out"
    args = ["--cpu-smoke", "--out", str(out), "--timeout", "300"]
    p = _run(*args, *[a for o in only for a in ("--only", o)], env=env, timeout=900)
    assert p.returncode == 0, p.stdout + p.stderr
    files = list(out.glob("*.json"))
    assert len(files) == 1, files
    return p, json.loads(files[0].read_text())


@pytest.mark.slow
def test_cpu_smoke_runs_whole_cases_without_bnb_deepspeed_trl(tmp_path):
    fb, lora = "llama-160m.fp32.fwd-bwd.", "qwen2-0.5b.amp_bf16.lora.adamw_torch.sdpa.ckpt."
    bnb8 = "llama-160m.fp32.adamw_bnb_8bit."
    p, doc = _smoke(tmp_path, ("bitsandbytes", "deepspeed", "trl"), fb, lora, bnb8, SFT,
                    PRETRAINED)
    assert doc["schema"] == 2 and doc["environment"]["pinned_gpu"] is None  # nothing to pin
    env = doc["environment"]
    assert not any(env["importable"][m] for m in ("bitsandbytes", "deepspeed", "trl"))
    assert env["importable"]["hf_memkit"] and env["importable"]["peft"]
    runs = {key: next(r for r in doc["runs"] if r["id"].startswith(key))
            for key in (fb, lora, bnb8, SFT)}
    assert runs[bnb8]["status"] == "skipped" and "bitsandbytes" in runs[bnb8]["error"]
    assert runs[SFT]["status"] == "skipped" and runs[SFT]["error"].startswith("needs trl")
    runs[PRETRAINED] = next(r for r in doc["runs"] if r["id"] == PRETRAINED)
    for key in (fb, lora, PRETRAINED):
        r = runs[key]
        assert r["status"] == "ok", r
        m = r["measured"]
        assert {"steady", "step1", "whole_run", "after_build", "device_used"} <= set(m)
        assert m["steady"]["steps"] == 2 and r["context"]["nvml_source"]
        assert "error" not in r["estimate"], r["estimate"]  # hf_memkit imports without them
        assert r["estimate"]["to_dict"]["stage"] == r["case"]["stage"]
        # each child: no device in a smoke run, its own empty calibration cache
        assert r["context"]["cuda_visible_devices"] == "" and r["gpu"] == {"uuid": None,
                                                                           "name": None}
        cal = r["context"]["calibration_cache"]
        assert cal["isolated"] and cal["entries_at_start"] == [], cal
        assert {"num_alloc_retries", "num_ooms"} <= set(m["steady"])
        assert m["other_processes"]["others"] == "unknown"  # no NVML on a CPU
        assert r["flags"] == {}
    caches = {runs[k]["context"]["calibration_cache"]["root"] for k in (fb, lora, PRETRAINED)}
    assert len(caches) == 3  # one per child
    assert runs[fb]["measured"]["loop"] == gpu_truth.FB_LOOP
    assert runs[lora]["measured"]["trainable_params"] < runs[lora]["measured"]["total_params"]
    steps = runs[lora]["measured"]["optimizer_steps"]  # bf16: no GradScaler, every step real
    assert steps["skipped_steps"] == [] and steps["window_has_optimizer_step"] is True
    assert steps["optimizer_state_at_window_end"] > 0 and steps["scales"] == [None] * 3
    load = runs[PRETRAINED]["measured"]["load"]  # saved, then loaded with device_map
    assert load["how"] == "from_pretrained(dir, device_map='cpu')"
    assert load["state_dict_bytes"] == runs[PRETRAINED]["measured"]["param_bytes"]  # tied once
    assert runs[fb]["measured"]["load"] is None
    assert doc["finished"] and "allocated" in doc["summary"]


@pytest.mark.slow
def test_cpu_smoke_trains_through_trl_and_skips_gpu_only_cases(tmp_path):
    p, doc = _smoke(tmp_path, ("bitsandbytes", "deepspeed"), SFT, DPO_LORA, SFT_OFFLOAD, LIGER)
    assert doc["environment"]["importable"]["trl"] and doc["environment"]["trl"]
    runs = {r["id"]: r for r in doc["runs"]}
    assert set(runs) == {SFT, DPO_LORA, SFT_OFFLOAD, LIGER}
    for case_id, trainer, cls in ((SFT, "sft", "SFTTrainer"), (DPO_LORA, "dpo", "DPOTrainer")):
        r = runs[case_id]
        assert r["status"] == "ok", r
        m = r["measured"]
        assert m["trainer_class"] == cls and m["args_class"] == cls.replace("Trainer", "Config")
        assert m["global_step"] == 3 and m["steady"]["steps"] == 2  # the window callback ran
        est = r["estimate"]
        assert "error" not in est, est
        assert est["to_dict"]["setup"]["trainer"]["name"] == trainer
        assert est["to_dict"]["setup"]["trainer"]["options"]["max_length"] == 32  # smoke seq_len
    assert runs[DPO_LORA]["measured"]["trainable_params"] < \
        runs[DPO_LORA]["measured"]["total_params"]
    assert runs[SFT_OFFLOAD]["status"] == "skipped" and \
        "activation_offloading" in runs[SFT_OFFLOAD]["error"]
    assert runs[LIGER]["status"] == "skipped" and "Triton" in runs[LIGER]["error"]
    assert "--cpu-smoke cannot run it" in p.stdout


@pytest.mark.slow
def test_cpu_smoke_degrades_without_rich(tmp_path):
    p, doc = _smoke(tmp_path, ("rich", "bitsandbytes"), "llama-160m.fp32.fwd-bwd.")
    (run,) = doc["runs"]
    assert run["status"] == "ok" and run["measured"]["steady"]
    assert "error" not in run["estimate"], run["estimate"]  # estimate_memory needs no rich
    assert "median |err|" in p.stdout and "┃" not in p.stdout  # the plain-text table


@pytest.mark.slow
def test_cpu_smoke_bisects_a_bisect_case_through_child_processes(tmp_path):
    """A bisect case under --cpu-smoke: each probe a real child process running the shrunk
    steps, a capacity below the estimate's own failing with a fake OOM; the search finds that
    capacity to its resolution, and the record and table carry it."""
    case = "llama-160m.amp_bf16.adamw_torch_fused.sdpa.ckpt.2steps.bisect.b8s1024"
    p, doc = _smoke(tmp_path, ("bitsandbytes", "deepspeed", "trl"), case)
    (rec,) = doc["runs"]
    assert rec["status"] == "ok" and rec["kind"] == "bisect", rec
    b = rec["bisect"]
    assert b["result"] == "found" and b["monotone"] and len(b["probes"]) <= 6
    assert b["largest_failing"] < b["fake_threshold"] <= b["smallest_completing"]
    assert b["resolution"] <= b["bounds"]["upper"] - b["bounds"]["lower"]
    assert {pr["outcome"] for pr in b["probes"]} == {"completed", "oom"}
    assert all(0 < pr["fraction"] < 1 and pr["seconds"] > 0 for pr in b["probes"])
    assert b["required"] == rec["estimate"]["to_dict"]["required"]
    assert abs(b["rel_error"]) <= b["resolution"] / b["smallest_completing"] + 1e-9
    assert doc["bisect_summary"]["n"] == 1 and "smallest capacity" in p.stdout


# ---------------------------------------------------------------------------- real GPU

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("case_id", GPU_CASES)
def test_estimate_within_10_percent_of_gpu_measurement(case_id, tmp_path):
    p = _run("--only", case_id, "--out", str(tmp_path), "--timeout", "300", timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    (path,) = tmp_path.glob("*.json")
    (rec,) = json.loads(path.read_text())["runs"]
    assert rec["status"] == "ok", rec.get("error") or rec.get("stderr_tail")
    est = rec["estimate"]
    assert "error" not in est, est
    meas, pred = gpu_truth.measured_values(rec), gpu_truth.predicted_values(rec)
    band_rel = est["band"][1] / est["device_used"] - 1  # the upper band, relative
    for k in gpu_truth.METRICS:
        assert meas[k], f"{k} not measured ({rec['measured'].get('device_used_basis')})"
        err = pred[k] / meas[k] - 1
        assert abs(err) <= 0.10, f"{case_id} {k}: predicted {pred[k]}, measured {meas[k]}"
        assert meas[k] <= pred[k] * (1 + band_rel), \
            f"{case_id} {k}: measured {meas[k]} above the estimate's band ({band_rel:.1%})"
    assert meas["device_used"] <= est["band"][1]
    _assert_pinned(rec, json.loads(path.read_text())["environment"])


def _assert_pinned(rec: dict, env: dict) -> None:
    """One device, by its full UUID; NVML read that card; no DataParallel; a fresh cache."""
    pin, ctx = env["pinned_gpu"], rec["context"]
    assert pin["cuda_visible_devices"].startswith(("GPU-", "MIG-")), pin
    assert ctx["cuda_visible_devices"] == pin["cuda_visible_devices"]
    assert ctx["visible_device_count"] == 1 and rec["gpu"]["uuid"] == pin["uuid"]
    if ctx["nvml_mapping"]["by"] in ("uuid", "pci_bus_id"):
        assert ctx["nvml_uuid"] == pin["uuid"], (ctx, pin)
    assert ctx["calibration_cache"]["isolated"] is True
    assert rec["measured"].get("n_gpu") in (None, 1) and "n_gpu" not in rec["flags"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_from_pretrained_with_device_map_reserves_the_warmup_block(tmp_path):
    """transformers' caching_allocator_warmup reserves a model-sized block before the weights
    arrive: after the load, reserved holds at least the state dict's bytes."""
    p = _run("--only", PRETRAINED, "--out", str(tmp_path), "--timeout", "300", timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    (path,) = tmp_path.glob("*.json")
    (rec,) = json.loads(path.read_text())["runs"]
    assert rec["status"] == "ok", rec.get("error") or rec.get("stderr_tail")
    load = rec["measured"]["load"]
    assert load["how"] == "from_pretrained(dir, device_map='cuda')"
    # the block is the state dict less what the cache held unused before (none, in a fresh child)
    block = load["state_dict_bytes"] - (load["reserved_before"] - load["allocated_before"])
    assert load["allocated_after_load"] >= 0.99 * load["state_dict_bytes"]
    assert load["max_reserved_during_load"] - load["reserved_before"] >= block
    assert load["largest_segments"][0]["total_size"] >= block
    _assert_pinned(rec, json.loads(path.read_text())["environment"])


@pytest.mark.slow
def test_estimates_made_ahead_equal_the_ones_each_case_makes(tmp_path):
    """``--estimate-workers``: the estimates are made ahead in processes that see no GPU, for the
    device the probe recorded, and each case's process reports the one made for it. They equal
    the estimates a case's own process makes (the default)."""
    case = "llama-160m.fp32.fwd-bwd."
    docs = {}
    for workers in ("0", "2"):
        out = tmp_path / workers
        p = _run("--cpu-smoke", "--out", str(out), "--only", case, "--estimate-workers", workers,
                 timeout=600)
        assert p.returncode == 0, p.stdout + p.stderr
        (f,) = out.glob("*.json")
        docs[workers] = json.loads(f.read_text())
    own, ahead = (docs[w]["runs"][0] for w in ("0", "2"))
    assert own["status"] == ahead["status"] == "ok"
    assert docs["2"]["environment"]["device"]["name"] == own["estimate"]["to_dict"]["device"][
        "name"]
    for key in ("peak_allocated", "peak_reserved", "device_used", "peak_phase"):
        assert ahead["estimate"][key] == own["estimate"][key], key


def test_a_negative_worker_count_is_refused_with_exit_2():
    p = _run("--estimate-workers", "-1", "--list")
    assert p.returncode == 2 and "--estimate-workers must be 0 or more, got -1" in p.stdout


@pytest.mark.slow
def test_a_deadline_stops_starting_cases_and_keeps_what_ran(tmp_path):
    """``--deadline-s``: six shrunk cases of several seconds each on this CPU cannot all run in
    30 s. The run starts no case it expects to end past the deadline, cuts the last one's
    timeout to the time left, and its file lists what ran, in priority order, and what it did
    not reach."""
    only = ["llama-160m.fp32.fwd-bwd.", "gpt2-124m.fp32.adamw_torch.sdpa.b8",
            "llama-160m.fp32.adamw_torch.sdpa.b4", "bert-base-cls.fp32.adamw_torch.sdpa.b32",
            "qwen2-0.5b.pure_bf16.fwd-bwd.", "llama-160m.amp_bf16.sft.adamw_torch.sdpa.b4"]
    out = tmp_path / "out"
    args = ["--cpu-smoke", "--out", str(out), "--deadline-s", "30"]
    p = _run(*args, *[a for o in only for a in ("--only", o)], timeout=600)
    assert p.returncode in (0, 1), p.stdout + p.stderr
    (f,) = out.glob("*.json")
    doc = json.loads(f.read_text())
    selected = doc["cases_selected"]
    assert len(selected) >= len(only) and doc["deadline_s"] == 30
    ran = [r["id"] for r in doc["runs"]]
    assert ran and doc["not_reached"] and ran + doc["not_reached"] == selected
    assert "cases not reached" in p.stdout
    # the TRL case is ahead of the plain ones, whatever --only's order
    assert selected[0].startswith("llama-160m.amp_bf16.sft.")
    assert doc["elapsed_s"] <= 30 + 3, doc["elapsed_s"]
    assert all(r["status"] in ("ok", "timeout") for r in doc["runs"]), \
        [(r["id"], r["status"], r.get("error")) for r in doc["runs"]]
