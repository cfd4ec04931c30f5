"""bench/gpu_truth.py, the GPU ground-truth harness.

On a CPU (CI): the command line, the matrix it lists, the no-GPU exit, result-file names, the
error table, and the measuring window's plumbing on fakes. Whole runs (``--cpu-smoke`` on the
CPU, and the ``gpu``-marked real cases on a CUDA GPU): tests/integration/test_gpu_truth_runs.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import pytest

from tests.helpers import ROOT

BENCH = ROOT / "bench"
SCRIPT = BENCH / "gpu_truth.py"
sys.path.insert(0, str(BENCH))

import _gpu_cases  # noqa: E402  (bench/_gpu_cases.py: the matrix the harness runs)
import _gpu_facts  # noqa: E402  (what a run records beside its peaks)
import _gpu_nvml  # noqa: E402  (CUDA device -> NVML device, processes, the pin)
import gpu_truth  # noqa: E402

from tests.unit.bench.nvml_fakes import (  # noqa: E402
    NO_PERMISSION,
    NOT_AVAILABLE,
    NOT_SUPPORTED,
    Card,
    FakeNvmlLib,
    Machine,
    fake_pynvml,
)

BNB = "bitsandbytes"
SFT = "llama-160m.amp_bf16.sft.adamw_torch.sdpa.b4s1024"
DPO_LORA = "llama-160m.amp_bf16.dpo.lora.adamw_torch.sdpa.b4s512"
SFT_OFFLOAD = "llama-160m.amp_bf16.sft.adamw_torch.sdpa.trl-offload.b4s1024"
LIGER = "llama-160m.amp_bf16.adamw_torch_fused.sdpa.liger.b8s1024"


def _run(*args: str, env: dict[str, str] | None = None, timeout: float = 300):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=timeout, cwd=str(ROOT), env=env)


def _listed() -> list[dict[str, str]]:
    p = _run("--list")
    assert p.returncode == 0, p.stderr
    rows = []
    for line in p.stdout.splitlines():
        if " stage=" not in line:
            continue
        case_id, _, rest = line.partition("  ")
        rows.append({"id": case_id, **dict(kv.split("=", 1) for kv in rest.split())})
    return rows


def test_help_exits_0():
    p = _run("--help")
    assert p.returncode == 0, p.stderr
    for flag in ("--out", "--only", "--timeout", "--list"):
        assert flag in p.stdout


def test_list_covers_the_required_matrix():
    rows = _listed()
    everywhere = [r for r in rows if BNB not in r["needs"]]
    assert len(everywhere) >= 30  # runs on a GPU box without bitsandbytes
    values = {k: {r[k] for r in rows} for k in rows[0]}
    assert {"llama", "qwen2", "gpt2", "bert-cls", "t5"} <= values["family"]
    assert set(_gpu_cases.PRECISIONS) <= {r["precision"] for r in everywhere}
    assert {"adamw_torch", "adamw_torch_fused", "adafactor"} <= {r["optim"] for r in everywhere}
    assert {"on", "off"} <= values["ckpt"] and {"eager", "sdpa"} <= values["attn"]
    assert any(int(r["accum"]) > 1 for r in everywhere)
    assert sum(r["stage"] == "forward_backward" for r in everywhere) >= 2
    assert any(r["stage"] == "train" for r in everywhere)
    # LoRA runs without bitsandbytes (peft only); 8-bit AdamW and QLoRA need it
    assert any(r["method"] == "lora" and r["needs"] == "peft" for r in everywhere)
    bnb = [r for r in rows if BNB in r["needs"]]
    assert {"adamw_bnb_8bit"} <= {r["optim"] for r in bnb}
    assert "qlora" in {r["method"] for r in bnb}
    assert all(r["method"] == "qlora" or r["optim"] == "adamw_bnb_8bit" for r in bnb)
    bert = [r for r in rows if r["family"] == "bert-cls"]
    assert all(r["task"] == "sequence-classification" and r["attn_dropout"] == "0.1"
               for r in bert)


def test_trl_and_liger_cases_are_listed_with_what_they_need():
    p = _run("--list")
    assert "need trl" in p.stdout and "need liger_kernel" in p.stdout
    rows = {r["id"]: r for r in _listed()}
    assert {"trainer", "sft", "dpo"} == {r["trainer"] for r in rows.values()}
    for r in rows.values():
        needs = r["needs"].split(",")
        assert ("trl" in needs) == (r["trainer"] != "trainer"), r
        assert ("liger_kernel" in needs) == (r["liger"] == "on"), r
        assert r["trl_offload"] == "off" or r["trainer"] in ("sft", "dpo"), r
        assert (f".{r['trainer']}." in r["id"]) == (r["trainer"] != "trainer"), r
        assert (".trl-offload." in r["id"]) == (r["trl_offload"] == "on"), r
        assert (".liger." in r["id"]) == (r["liger"] == "on"), r
    for case_id in (SFT, DPO_LORA, SFT_OFFLOAD, LIGER,
                    "llama-160m.amp_bf16.sft.adamw_torch.sdpa.liger.b4s1024",
                    "llama-160m.amp_bf16.dpo.adamw_torch.sdpa.trl-offload.b4s1024",
                    "qwen2-0.5b.amp_bf16.sft.adamw_torch.sdpa.liger.ckpt.b4s1024"):
        assert case_id in rows, sorted(rows)
    assert rows[DPO_LORA]["needs"] == "peft,trl" and rows[DPO_LORA]["method"] == "lora"
    # the plain Trainer cases keep the ids they had before TRL and Liger came in
    assert {*GPU_CASES, "llama-160m.amp_bf16.adamw_torch_fused.sdpa.ckpt-offload.b8s1024"} \
        <= set(rows)


@pytest.mark.parametrize("kw, message", [
    ({"trainer": "grpo"}, "trainer `grpo` not in"),
    ({"trl_offload": True}, "trl_offload is TRL's activation_offloading"),
    ({"trainer": "sft", "stage": "forward_backward", "precision": "fp32"}, "trains causal LMs"),
    ({"liger": True, "stage": "forward_backward", "precision": "fp32"}, "needs stage train"),
])
def test_case_rejects_bad_trainer_settings(kw, message):
    with pytest.raises(ValueError, match=message):
        _gpu_cases.Case(**{"model": "llama-160m", "precision": "amp_bf16", **kw})


def test_trl_cases_train_causal_lms_and_round_trip():
    with pytest.raises(ValueError, match="trains causal LMs"):
        _gpu_cases.Case("bert-base-cls", "fp32", trainer="dpo")
    ok = _gpu_cases.Case("llama-160m", "amp_bf16", trainer="dpo", trl_offload=True, liger=True)
    assert ok.needs == ("trl", "liger_kernel")
    assert _gpu_cases.Case.from_dict(ok.to_dict()) == ok


def test_memory_args_and_estimate_kwargs_of_trl_and_liger_cases():
    fields = {"activation_checkpointing", "gradient_checkpointing"}
    sft = _gpu_cases.select([SFT_OFFLOAD])[0]
    # TRL's configs default to bf16 and checkpointing on: the case states both
    assert gpu_truth.memory_args(sft, fields) == {
        "bf16": True, "activation_checkpointing": False, "per_device_train_batch_size": 4,
        "gradient_accumulation_steps": 1, "optim": "adamw_torch", "max_length": 1024,
        "activation_offloading": True}
    dpo = _gpu_cases.Case("llama-160m", "fp32", trainer="dpo", ckpt=True, seq_len=512)
    a = gpu_truth.memory_args(dpo, {"gradient_checkpointing"})
    assert a["bf16"] is False and a["gradient_checkpointing"] is True and a["max_length"] == 512
    assert "activation_offloading" not in a
    liger = gpu_truth.memory_args(_gpu_cases.select([LIGER])[0], fields)
    assert liger["use_liger_kernel"] is True and "max_length" not in liger
    assert gpu_truth.estimate_kwargs(dpo, smoke=True)["trainer"] == "dpo"
    assert "trainer" not in gpu_truth.estimate_kwargs(_gpu_cases.CASES[0], smoke=True)


def test_cpu_smoke_skips_only_gpu_only_settings():
    by_id = {c.id: c for c in _gpu_cases.CASES}
    assert gpu_truth.cpu_smoke_skip(by_id[SFT]) is None
    assert gpu_truth.cpu_smoke_skip(by_id[DPO_LORA]) is None
    assert "Triton" in gpu_truth.cpu_smoke_skip(by_id[LIGER])
    assert "accelerator" in gpu_truth.cpu_smoke_skip(by_id[SFT_OFFLOAD])
    assert [c.id for c in _gpu_cases.CASES if gpu_truth.cpu_smoke_skip(c)] == \
        [c.id for c in _gpu_cases.CASES if c.liger or c.trl_offload]
    rec = gpu_truth.skipped_record(by_id[LIGER], ["liger_kernel"])
    assert rec["status"] == "skipped" and rec["error"] == "needs liger_kernel, not importable here"


def test_case_ids_are_unique_and_select_exactly_one_case():
    ids = [c.id for c in _gpu_cases.CASES]
    assert len(set(ids)) == len(ids)
    for i in ids:  # --only <full id> picks that case alone
        assert [c.id for c in _gpu_cases.select([i])] == [i]


def test_models_are_real_sized_and_qwen_is_gqa():
    from transformers import AutoConfig

    import hf_memkit as mk

    sizes = {}
    for key, m in _gpu_cases.MODELS.items():
        d = m.config_dict()
        cfg = AutoConfig.for_model(d.pop("model_type"), **d)
        sizes[key] = mk.profile_model(cfg, task=m.task).total_params
    assert max(sizes.values()) <= 1.6e9 and sizes["qwen2-1.5b"] >= 1.4e9
    for key in ("qwen2-0.5b", "qwen2-1.5b"):
        c = _gpu_cases.MODELS[key].config
        assert c["num_key_value_heads"] < c["num_attention_heads"]


def test_harness_imports_nothing_heavy_at_top_level():
    code = ("import sys; sys.path.insert(0, 'bench'); import gpu_truth; "
            "print(sorted(m for m in ('torch', 'transformers', 'bitsandbytes', 'deepspeed', "
            "'trl', 'peft', 'hf_memkit') if m in sys.modules))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       cwd=str(ROOT), timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "[]"


def test_without_gpu_it_says_so_and_exits_0(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    p = _run("--out", str(tmp_path), env=env)
    assert p.returncode == 0, p.stderr
    assert "No CUDA GPU present" in p.stdout
    assert list(tmp_path.iterdir()) == []


def test_only_without_match_exits_2():
    p = _run("--only", "no-such-case", "--list")
    assert p.returncode == 0 and "0 cases" in p.stdout
    assert _run("--only", "no-such-case").returncode == 2


def test_result_file_name_is_sanitised(tmp_path):
    assert gpu_truth.result_filename("NVIDIA H100 80GB HBM3", "2.11.0+cu128", "2026-11-23") \
        == "NVIDIA-H100-80GB-HBM3_torch2.11.0_2026-11-23.json"
    assert gpu_truth.sanitize("Tesla V100-SXM2-16GB") == "Tesla-V100-SXM2-16GB"
    assert gpu_truth.sanitize("  A/B: C (x) ") == "A-B-C-x"
    assert gpu_truth.sanitize("NVIDIA A100-SXM4-80GB MIG 3g.40gb") == \
        "NVIDIA-A100-SXM4-80GB-MIG-3g.40gb"
    assert gpu_truth.sanitize("ü//") == "unknown"
    first = gpu_truth.unique_path(tmp_path, "x_torch2.11.0_2026-11-23.json")
    first.write_text("{}")
    assert gpu_truth.unique_path(tmp_path, first.name).name == "x_torch2.11.0_2026-11-23-2.json"


def _rec(alloc, reserved, device, *, status="ok", basis="nvml_used - nvml_used_before_cuda",
         estimate_error=None):
    """A hand-made record: each metric a (measured, predicted) pair."""
    est = ({"error": estimate_error} if estimate_error else
           {"peak_allocated": alloc[1], "peak_reserved": reserved[1], "device_used": device[1]})
    return {"status": status, "estimate": est,
            "measured": {"steady": {"max_allocated": alloc[0], "max_reserved": reserved[0]},
                         "device_used": device[0], "device_used_basis": basis}}


def test_error_table_median_worst_and_under_count(monkeypatch, capsys):
    records = [
        _rec((100, 110), (200, 190), (400, 400)),           # +10%, -5%, 0
        _rec((200, 176), (250, 275), (500, 450)),           # -12%, +10%, -10%
        _rec((400, 404), (500, 500), (600, 700), basis="raw (no baseline)"),  # +1%, 0, (none)
        _rec((1, 9), (1, 9), (1, 9), status="error"),       # failed run: not counted
        _rec((1, 9), (1, 9), (1, 9), estimate_error="TypeError: x"),  # no estimate
    ]
    s = gpu_truth.summarise(records)
    a, r, d = s["allocated"], s["reserved"], s["device_used"]
    assert (a["n"], a["under"]) == (3, 1)
    assert a["median"] == pytest.approx(0.01) and a["median_abs"] == pytest.approx(0.10)
    assert a["worst"] == pytest.approx(-0.12)
    assert (r["n"], r["under"]) == (3, 1)
    assert r["median"] == pytest.approx(0.0) and r["median_abs"] == pytest.approx(0.05)
    assert r["worst"] == pytest.approx(0.10)
    assert (d["n"], d["under"]) == (2, 1)
    assert d["median"] == pytest.approx(-0.05) and d["median_abs"] == pytest.approx(0.05)
    assert d["worst"] == pytest.approx(-0.10)
    text = gpu_truth.render_summary(s)
    assert "-12.0%" in text and "+1.0%" in text and "under-predicted" in text
    # without rich the same table is printed as plain text
    for m in ("rich", "rich.console", "rich.table"):
        monkeypatch.setitem(sys.modules, m, None)
    gpu_truth.print_summary(s)
    assert capsys.readouterr().out.strip() == text


def test_empty_table_and_rel_errors_of_a_failed_run():
    s = gpu_truth.summarise([])
    assert s["allocated"] == {"n": 0, "median": None, "median_abs": None, "worst": None,
                              "under": 0}
    assert "-" in gpu_truth.render_summary(s)
    assert gpu_truth.rel_errors(_rec((1, 2), (1, 2), (1, 2), status="timeout")) == {}


class _FakeStats:
    """The allocator counters a Window reads, scripted per call."""

    def __init__(self):
        self.peak, self.calls = 100, []

    def sync(self):
        self.calls.append("sync")

    def snapshot(self):
        return {"max_allocated": self.peak, "max_reserved": 2 * self.peak, "allocated": 1,
                "reserved": 2}

    def reset_peak(self):
        self.calls.append("reset")
        self.peak = 0

    def reserved(self):
        return 2 * self.peak


class _FakeNvml:
    source = "fake"

    def __init__(self, values):
        self.values = iter(values)

    def used(self):
        return next(self.values, 7)


def test_window_resets_after_step_1_and_samples_nvml_until_the_last_step():
    stats = _FakeStats()
    w = gpu_truth.Window(stats, _FakeNvml([5, 9, 6]), last_step=3)
    w.sampler.interval = 10.0  # only the samples at start and stop: deterministic
    w.after_step(1)
    assert stats.calls == ["sync", "reset"] and w.result["step1"]["max_allocated"] == 100
    stats.peak = 40
    w.after_step(2)
    assert "steady" not in w.result
    w.after_step(3)
    steady = w.result["steady"]
    assert steady["max_allocated"] == 40 and steady["max_reserved"] == 80
    assert steady["nvml_used_peak"] == 9 and steady["nvml_used_after"] == 6
    assert steady["steps"] == 2 and steady["nvml_samples"] == 2


def test_peak_sampler_polls_in_a_thread():
    seen = threading.Event()
    values = iter([1, 50, 3] + [2] * 10_000)

    def read():
        seen.set()
        return next(values)

    s = gpu_truth.PeakSampler(read, interval=0.001)
    s.start()
    seen.wait(1)
    time.sleep(0.05)
    out = s.stop()
    assert out["peak"] == 50 and out["samples"] >= 3 and out["errors"] == 0


def test_memory_args_use_the_installed_checkpointing_name():
    case = _gpu_cases.Case("gpt2-124m", "amp_fp16", "adafactor", accum=2, ckpt=True)
    a = gpu_truth.memory_args(case, {"activation_checkpointing", "gradient_checkpointing"})
    assert a == {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2,
                 "fp16": True, "optim": "adafactor", "activation_checkpointing": True,
                 "activation_checkpointing_kwargs": {"use_reentrant": False}}
    old = gpu_truth.memory_args(case, {"gradient_checkpointing"})
    assert old["gradient_checkpointing"] is True and "activation_checkpointing" not in old
    fb = _gpu_cases.Case("gpt2-124m", "pure_bf16", stage="forward_backward")
    assert "optim" not in gpu_truth.memory_args(fb, set())


def test_a_failing_estimate_is_recorded_not_raised(monkeypatch):
    import hf_memkit as mk

    def boom(*a, **kw):
        raise TypeError("estimate_memory() got an unexpected keyword argument 'x'")

    monkeypatch.setattr(mk, "estimate_memory", boom)
    case = _gpu_cases.select(["llama-160m.fp32.fwd-bwd."])[0]
    out = gpu_truth.estimate(case, smoke=True)
    assert out["error"].startswith("TypeError: estimate_memory()") and "traceback" in out


def test_run_case_keeps_the_measurement_when_the_child_dies_later(monkeypatch):
    case = _gpu_cases.CASES[0]
    measured = {"steady": {"max_allocated": 10, "max_reserved": 20}, "device_used": 30,
                "device_used_basis": "nvml_used - nvml_used_before_cuda"}
    monkeypatch.setattr(gpu_truth, "run_child", lambda *a, **k: (
        {"context": {}, "measured": measured}, -6, "Fatal Python error: Aborted\n", 3.0))
    rec = gpu_truth.run_case(case, timeout=10)
    assert rec["status"] == "ok" and rec["measured"] == measured
    assert "the child recorded no estimate" in rec["estimate"]["error"]
    assert rec["rel_error"] == dict.fromkeys(gpu_truth.METRICS)
    monkeypatch.setattr(gpu_truth, "run_child", lambda *a, **k: ({}, None, "", 10.0))
    rec = gpu_truth.run_case(case, timeout=10)
    assert rec["status"] == "timeout" and "10 s" in rec["error"]
    monkeypatch.setattr(gpu_truth, "run_child", lambda *a, **k: (
        {}, 1, "Traceback ...\ntorch.OutOfMemoryError: CUDA out of memory.\nexit\n", 1.0))
    rec = gpu_truth.run_case(case, timeout=10)
    assert rec["status"] == "error" and "OutOfMemoryError" in rec["error"]
    # the estimate comes first: a child that dies in the run keeps it
    est = {"peak_allocated": 5, "peak_reserved": 6, "device_used": 7}
    monkeypatch.setattr(gpu_truth, "run_child", lambda *a, **k: (
        {"context": {}, "estimate": est}, -9, "Killed\n", 1.0))
    rec = gpu_truth.run_case(case, timeout=10)
    assert rec["status"] == "error" and rec["estimate"] == est and rec["measured"] is None


# the real cases of the gpu-marked test (tests/integration/test_gpu_truth_runs.py)
GPU_CASES = ("gpt2-124m.fp32.adamw_torch.sdpa.b8s1024",
             "bert-base-cls.amp_bf16.adafactor.sdpa.ckpt.b32s512",
             "llama-160m.fp32.fwd-bwd.sdpa.b4s1024")


# ----------------------------------------------------------------------------------------------
# issue 25: one pinned device, the right NVML card, an isolated cache, OOMs, fp16 skips
# ----------------------------------------------------------------------------------------------
GiB = 2**30
A100_UUID = "a1b2c3d4-0000-4000-8000-00000000a100"
H100_UUID = "5f2a9c1e-0b6d-4e11-9a77-3c2d1e0f4a5b"
OWN = 31337


def _machine(**kw) -> Machine:
    """PCI order (NVML's): the A100 (bus 0x07), then the H100 (bus 0x3b); CUDA's, fastest
    first: the H100 is CUDA device 0, the A100 CUDA device 1."""
    a100 = Card("NVIDIA A100-SXM4-80GB", A100_UUID, 0x07, used=11 * GiB,
                compute=[(4242, 9 * GiB)], graphics=NOT_SUPPORTED)
    h100 = Card("NVIDIA H100 80GB HBM3", H100_UUID, 0x3B, used=3 * GiB,
                compute=[(777, 2 * GiB), (OWN, GiB)], graphics=[(778, NOT_AVAILABLE)])
    return Machine([a100, h100], cuda_order=[1, 0], **kw)


def _open(monkeypatch, m: Machine, front: str, **lib_kw):
    """open_nvml over ``m`` through one front end: nvidia-ml-py, or ctypes (no pynvml)."""
    if front == "pynvml":
        monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(m))
    else:
        monkeypatch.setitem(sys.modules, "pynvml", None)
        monkeypatch.setattr(_gpu_nvml, "_nvml_library", lambda: FakeNvmlLib(m, **lib_kw))
    reader = gpu_truth.open_nvml(0, get_properties=m.get_device_properties)
    assert reader.source == ("pynvml" if front == "pynvml" else "libnvidia-ml.so.1 (ctypes)"), \
        reader.failures
    return reader


@pytest.mark.parametrize("front", ["pynvml", "ctypes"])
@pytest.mark.parametrize("visible, expected", [
    (None, "H100"),         # CUDA device 0 is the fastest card; NVML's index 0 is the A100
    ("0", "H100"),          # integers index CUDA's order, not NVML's
    ("1", "A100"),
    ("GPU-a1b2", "A100"),   # a UUID prefix: CUDA takes it, NVML would not
])
def test_nvml_reads_the_card_cuda_calls_device_0(monkeypatch, front, visible, expected):
    m = _machine()
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    card = next(c for c in m.cards if expected in c.name)
    reader = _open(monkeypatch, m, front)
    assert reader.name() == card.name and reader.used() == card.used
    assert reader.uuid() == "GPU-" + card.uuid
    assert reader.mapping == {"by": "uuid", "nvml_uuid": "GPU-" + card.uuid}
    assert reader.ids["uuid"] == card.uuid and reader.driver() == "570.86.15"
    reader.close()


@pytest.mark.parametrize("front", ["pynvml", "ctypes"])
def test_without_a_torch_uuid_the_pci_address_finds_the_card(monkeypatch, front):
    m = _machine(torch_uuids=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    reader = _open(monkeypatch, m, front)
    assert reader.mapping == {"by": "pci_bus_id", "pci_bus_id": "0000:07:00.0"}
    assert reader.name() == "NVIDIA A100-SXM4-80GB" and reader.used() == 11 * GiB


@pytest.mark.parametrize("front", ["pynvml", "ctypes"])
def test_a_mig_instance_is_found_by_its_mig_uuid(monkeypatch, front):
    mig = Card("NVIDIA A100-SXM4-80GB MIG 3g.40gb", "0c7e9d11-2222-5333-8444-555566667777",
               0x07, used=5 * GiB, kind="MIG")
    m = Machine([mig], cuda_order=[0])
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    reader = _open(monkeypatch, m, front)
    assert reader.mapping["nvml_uuid"] == "MIG-" + mig.uuid and reader.used() == 5 * GiB


def test_no_nvml_device_matching_falls_back_to_torch_and_says_why(monkeypatch):
    m = _machine()
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(m))
    monkeypatch.setattr(_gpu_nvml, "_nvml_library", lambda: FakeNvmlLib(m))
    unknown = types.SimpleNamespace(name="NVIDIA H100 80GB HBM3", uuid="ffffffff-dead")
    reader = _gpu_nvml.open_nvml(0, get_properties=lambda i: unknown)
    assert reader.source.startswith("torch.cuda.mem_get_info")
    assert len(reader.failures) == 2 and all("no NVML device is CUDA device 0" in f
                                             for f in reader.failures)
    with pytest.raises(LookupError, match="neither a UUID nor a PCI address"):
        _gpu_nvml.resolve_handle({"index": 0, "name": "x", "uuid": None, "pci_bus_id": None},
                                 lambda u: 1, lambda b: 2)


@pytest.mark.parametrize("front, versions", [("pynvml", ()), ("ctypes", ("_v3",)),
                                             ("ctypes", ("_v2",)), ("ctypes", ("",))])
def test_other_processes_exclude_this_one_and_tolerate_refusals(monkeypatch, front, versions):
    m = _machine()
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    h100 = _open(monkeypatch, m, front, **({"versions": versions} if versions else {}))
    procs = _gpu_nvml.reader_processes(h100, own_pid=OWN)
    assert procs["compute"] == [{"pid": 777, "used_gpu_memory": 2 * GiB}]
    assert procs["graphics"] == [{"pid": 778, "used_gpu_memory": None}]  # WDDM/MIG: unknown
    assert procs["own_pid_listed"] is True and procs["others"] == [777, 778]
    assert procs["others_used_bytes"] == 2 * GiB
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    a100 = _open(monkeypatch, m, front, **({"versions": versions} if versions else {}))
    procs = _gpu_nvml.reader_processes(a100, own_pid=OWN)
    assert procs["compute"] == [{"pid": 4242, "used_gpu_memory": 9 * GiB}]
    assert procs["graphics"] == "unknown" and procs["graphics_error"] == "NVML_ERROR_NOT_SUPPORTED"
    assert procs["others"] == "unknown" and procs["own_pid_listed"] is False
    m.cards[0].compute = NO_PERMISSION
    procs = _gpu_nvml.reader_processes(a100, own_pid=OWN)
    assert procs["compute"] == "unknown" and procs["compute_error"] == "NVML_ERROR_NO_PERMISSION"


def test_pin_is_the_full_uuid_of_the_chosen_device(monkeypatch):
    m = _machine()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-a1b2,0")  # this process: A100, then H100
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(m))
    pin = _gpu_nvml.pin_device(1, get_properties=m.get_device_properties)
    assert pin["cuda_visible_devices"] == pin["uuid"] == "GPU-" + H100_UUID
    assert pin["name"] == "NVIDIA H100 80GB HBM3" and pin["pinned_by"].startswith("uuid (NVML")
    assert pin["parent_cuda_visible_devices"] == "GPU-a1b2,0"
    env = gpu_truth.child_env(False, pin=pin["cuda_visible_devices"], cache="/tmp/x")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", env["CUDA_VISIBLE_DEVICES"])
    assert [c.name for c in m.visible()] == ["NVIDIA H100 80GB HBM3"]  # one device, that one
    # no NVML at all: torch's UUID with the GPU- prefix; a MIG instance's with MIG-
    monkeypatch.setitem(sys.modules, "pynvml", None)
    monkeypatch.setattr(_gpu_nvml, "_nvml_library", lambda: (_ for _ in ()).throw(OSError("x")))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    pin = _gpu_nvml.pin_device(0, get_properties=m.get_device_properties)
    assert pin["cuda_visible_devices"] == "GPU-" + A100_UUID and "torch's" in pin["pinned_by"]
    mig = types.SimpleNamespace(name="NVIDIA H100 80GB HBM3 MIG 1g.10gb", uuid="1234-5678")
    assert _gpu_nvml.pin_device(0, get_properties=lambda i: mig)["cuda_visible_devices"] \
        == "MIG-1234-5678"
    bare = types.SimpleNamespace(name="AMD Instinct MI300X", uuid="")
    pin = _gpu_nvml.pin_device(0, get_properties=lambda i: bare)
    assert pin["cuda_visible_devices"] == "1" and pin["uuid"] is None  # the entry it had


def test_child_env_pins_one_device_and_a_fresh_calibration_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    monkeypatch.setenv("HF_MEMKIT_CACHE", "/home/user/.cache/hf_memkit")
    env = gpu_truth.child_env(False, pin="GPU-" + H100_UUID, cache=str(tmp_path))
    assert env["CUDA_VISIBLE_DEVICES"] == "GPU-" + H100_UUID and "," not in \
        env["CUDA_VISIBLE_DEVICES"]
    assert env["HF_MEMKIT_CACHE"] == str(tmp_path)
    assert gpu_truth.child_env(True, cache=str(tmp_path))["CUDA_VISIBLE_DEVICES"] == ""
    seen = {}

    def fake_child(flag, **kw):
        seen.update(kw)
        return {"context": {}, "estimate": {"peak_allocated": 1}}, 1, "boom\n", 1.0

    monkeypatch.setattr(gpu_truth, "run_child", fake_child)
    pin = {"cuda_visible_devices": "GPU-" + H100_UUID, "uuid": "GPU-" + H100_UUID,
           "name": "NVIDIA H100 80GB HBM3"}
    rec = gpu_truth.run_case(_gpu_cases.CASES[0], timeout=5, pin=pin)
    assert seen["pin"] == "GPU-" + H100_UUID
    assert rec["gpu"] == {"uuid": "GPU-" + H100_UUID, "name": "NVIDIA H100 80GB HBM3"}


def test_a_real_child_reads_no_calibration_the_user_stored(monkeypatch, tmp_path):
    user = tmp_path / "user-cache"
    (user / "calibration").mkdir(parents=True)
    (user / "calibration" / "nvidia-h100__cuda-12.8__x.json").write_text("{}")
    monkeypatch.setenv("HF_MEMKIT_CACHE", str(user))
    parts, rc, stderr, _ = gpu_truth.run_child(["--probe"], timeout=240, smoke=True)
    assert rc == 0, stderr
    cal = parts["env"]["context"]["calibration_cache"]
    assert cal["isolated"] is True and cal["entries_at_start"] == []
    assert cal["root"] == cal["HF_MEMKIT_CACHE"] != str(user)
    assert not Path(cal["root"]).exists()  # removed after the child


def test_check_pin_refuses_a_child_that_sees_more_or_reads_another_card():
    pin = {"cuda_visible_devices": "GPU-" + H100_UUID, "uuid": "GPU-" + H100_UUID}
    ok = {"visible_device_count": 1, "nvml_uuid": "GPU-" + H100_UUID, "nvml_mapping": {}}
    assert gpu_truth.check_pin(dict(pin), ok) is None
    assert "sees 2 CUDA devices" in gpu_truth.check_pin(dict(pin), {**ok,
                                                                    "visible_device_count": 2})
    other = gpu_truth.check_pin(dict(pin), {**ok, "nvml_uuid": "GPU-" + A100_UUID})
    assert "another card" in other
    unknown = dict(pin)  # no NVML in the child: nothing to compare, not refused
    assert gpu_truth.check_pin(unknown, {**ok, "nvml_uuid": None}) is None
    assert unknown["child_reads_pinned_device"] is None


def test_an_oom_keeps_the_estimate_and_what_was_measured(monkeypatch, capsys, tmp_path):
    """A CPU cannot run out of CUDA memory: step 2 raises torch's OutOfMemoryError in a real
    (smoke) Trainer run; the estimate, computed before, and step 1's figures survive."""
    import torch

    monkeypatch.setenv("HF_MEMKIT_CACHE", str(tmp_path))
    real = gpu_truth.Window.after_step

    def after_step(self, step, optimizer=None):
        if step == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. "
                                         "GPU 0 has a total capacity of 79.19 GiB")
        real(self, step, optimizer)

    monkeypatch.setattr(gpu_truth.Window, "after_step", after_step)
    case = _gpu_cases.select(["llama-160m.fp32.adamw_torch.sdpa.b4s1024"])[0]
    gpu_truth.run_one(case, smoke=True)
    parts = gpu_truth.parse_markers(capsys.readouterr().out)
    assert "measured" not in parts and {"context", "estimate", "oom"} <= set(parts)
    est, oom = parts["estimate"], parts["oom"]
    assert "error" not in est and est["peak_allocated"] > 0
    assert oom["oom"]["exception"] == "OutOfMemoryError"
    assert oom["oom"]["tried_to_allocate"] == "2.00 GiB" and oom["oom"]["during"] == "step 2 of 3"
    assert oom["reserved_per_step"] == [0] and "max_allocated" in oom["step1"]
    assert oom["optimizer_steps"]["first_real_step"] == 1
    assert oom["peak_so_far"]["max_allocated"] == 0 and oom["whole_run_so_far"]
    monkeypatch.setattr(gpu_truth, "run_child", lambda *a, **k: (parts, 0, "", 2.0))
    rec = gpu_truth.run_case(case, timeout=10)
    assert rec["status"] == "oom" and rec["estimate"] == est and rec["measured"] == oom
    assert rec["error"].startswith("CUDA out of memory") and rec["rel_error"] == {}
    assert gpu_truth.summarise([rec])["allocated"]["n"] == 0
    assert "oom" in gpu_truth.progress_line(1, 1, rec)


def test_an_oom_while_building_is_recorded_too(monkeypatch):
    import torch

    def build(*a, **kw):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 512.00 MiB.")

    monkeypatch.setattr(gpu_truth, "build_model", build)
    case = _gpu_cases.select(["llama-160m.fp32.fwd-bwd."])[0]
    nvml = _gpu_nvml.open_nvml(0, smoke=True)
    with pytest.raises(gpu_truth.CaseOOM) as caught:
        gpu_truth.measure(case, nvml, {"nvml_used_before_cuda": None}, smoke=True)
    rec = caught.value.record
    assert rec["oom"]["during"] == "building the model"
    assert rec["oom"]["tried_to_allocate"] == "512.00 MiB" and "step1" not in rec
    # other errors are not OOMs: they propagate as before
    monkeypatch.setattr(gpu_truth, "build_model", lambda *a, **k: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        gpu_truth.measure(case, nvml, {"nvml_used_before_cuda": None}, smoke=True)


@pytest.mark.parametrize("scales, skipped, first_real, in_window", [
    ([65536.0, 65536.0, 65536.0], [], 1, True),
    ([32768.0, 32768.0, 32768.0], [1], 2, True),
    ([32768.0, 16384.0, 16384.0], [1, 2], 3, True),
    ([32768.0, 16384.0, 8192.0], [1, 2, 3], None, False),
    ([65536.0, 131072.0, 131072.0], [], 1, True),  # growth after good steps: no skip
])
def test_fp16_skipped_steps_from_the_scales(scales, skipped, first_real, in_window):
    log = [{"step": i, "scale": s, "step_was_skipped": None, "optimizer_state_entries": None}
           for i, s in enumerate(scales, 1)]
    f = _gpu_facts.optimizer_step_facts(log, 65536.0)
    assert (f["skipped_steps"], f["first_real_step"]) == (skipped, first_real)
    assert f["fp16_skipped_steps"] == len(skipped) and f["window_has_optimizer_step"] is in_window
    flags = _gpu_facts.case_flags({"optimizer_steps": f})
    assert flags.get("fp16_skipped_steps", 0) == len(skipped)
    assert flags.get("window_without_optimizer_step", False) is (not in_window)


@pytest.mark.parametrize("overflow, skipped, entries, in_window", [
    ({1}, [1], [0, 2, 2], True),
    ({1, 2, 3}, [1, 2, 3], [0, 0, 0], False),
])
def test_a_real_grad_scaler_s_skipped_steps_are_logged(overflow, skipped, entries, in_window):
    """torch's GradScaler on the CPU: an overflowing step lowers the scale and leaves the
    optimizer without state; the window's log says so."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters())
    scaler = torch.amp.GradScaler("cpu")
    w = gpu_truth.Window(_FakeStats(), _FakeNvml([]), last_step=3)
    w.sampler.interval = 10.0
    w.scale = lambda: float(scaler.get_scale())
    w.scale_before = w.scale()
    for step in (1, 2, 3):
        opt.zero_grad()
        loss = model(torch.ones(1, 4)).sum() * (float("inf") if step in overflow else 1.0)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        w.after_step(step, opt)
    f = w.result["optimizer_steps"]
    assert f["skipped_steps"] == skipped and f["optimizer_state_entries"] == entries
    assert f["window_has_optimizer_step"] is in_window
    assert f["scale_before"] == 65536.0 and f["scales"][-1] == 65536.0 / 2 ** len(skipped)
    assert w.result["other_processes"]["others"] == "unknown"  # a reader without a listing


def test_error_table_leaves_out_a_window_without_an_optimizer_step():
    good = _rec((100, 110), (200, 220), (300, 330))
    bad = {**_rec((50, 110), (60, 220), (70, 330)),
           "flags": {"fp16_skipped_steps": 3, "window_without_optimizer_step": True}}
    s = gpu_truth.summarise([good, bad])
    assert s["allocated"]["n"] == 1 and s["allocated"]["median"] == pytest.approx(0.10)
    assert _gpu_facts.case_flags({"n_gpu": 2, "steady": {"num_alloc_retries": 3}}) == \
        {"num_alloc_retries": 3, "n_gpu": 2}


def test_warmup_block_is_the_state_dict_bytes_transformers_counts():
    """``caching_allocator_warmup`` reserves ``get_total_byte_count`` bytes on a fresh device;
    the harness records the same figure, tied weights counted once (gpt2) or not tied (llama)."""
    import torch
    import transformers
    from transformers.modeling_utils import get_total_byte_count

    for model_type, kw in (("gpt2", {"n_embd": 64, "n_layer": 2, "n_head": 4}),
                           ("llama", {"hidden_size": 64, "intermediate_size": 128,
                                      "num_hidden_layers": 2, "num_attention_heads": 4,
                                      "tie_word_embeddings": False})):
        cfg = transformers.AutoConfig.for_model(model_type, vocab_size=512, **kw)
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        on_gpu = {k: torch.device("cuda") for k in model.state_dict()}
        (warmup,) = get_total_byte_count(model, on_gpu, None).values()
        assert _gpu_facts.state_dict_bytes(model) == warmup, model_type
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert warmup >= params  # llama: untied, every parameter once (and its buffers, if saved)


def test_list_shows_the_from_pretrained_cases():
    rows = [r for r in _listed() if r["load"] == "pretrained"]
    assert {r["stage"] for r in rows} == {"train", "forward_backward"}
    assert all(".pretrained." in r["id"] and r["needs"] == "-" for r in rows)
    with pytest.raises(ValueError, match="loads with from_pretrained already"):
        _gpu_cases.Case("llama-160m", "amp_bf16", method="qlora", load="pretrained")
    with pytest.raises(ValueError, match="load `hub` not in"):
        _gpu_cases.Case("llama-160m", "amp_bf16", load="hub")
