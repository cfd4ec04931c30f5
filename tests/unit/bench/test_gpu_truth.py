"""bench/gpu_truth.py, the GPU ground-truth harness.

On a CPU (CI): the command line, the matrix it lists, the no-GPU exit, result-file names, the
error table, and the CUDA-only parts (which NVML card, the pin, the processes, the measuring
window) on ``tests.fakes``: nvidia-ml-py's real module, or the harness's own ctypes calls, over a
fake ``libnvidia-ml.so.1``, and ``torch.cuda``, both reading one GPU machine. Whole runs (``--cpu-smoke`` on the
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

import pynvml
import pytest

from hf_memkit._units import GiB, MiB
from tests.helpers import ROOT

BENCH = ROOT / "bench"
SCRIPT = BENCH / "gpu_truth.py"
sys.path.insert(0, str(BENCH))

import _gpu_cases  # noqa: E402  (bench/_gpu_cases.py: the matrix the harness runs)
import _gpu_facts  # noqa: E402  (what a run records beside its peaks)
import _gpu_nvml  # noqa: E402  (CUDA device -> NVML device, processes, the pin)
import gpu_truth  # noqa: E402

from tests.fakes import (  # noqa: E402
    Gpu,
    Machine,
    a100,
    enumerate_devices,
    h100,
    install_cuda,
    install_nvml,
    mig_uuid_of,
    remove_nvml_library,
    uuid_of,
)
from tests.fakes.machine import CONTEXT  # noqa: E402

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
    assert {"qlora", "lora_8bit"} <= {r["method"] for r in bnb}
    assert {r["model"] for r in bnb if r["method"] != "full"} >= {"llama-160m", "qwen2-0.5b"}
    assert all(r["method"] in ("qlora", "lora_8bit") or r["optim"] == "adamw_bnb_8bit"
               for r in bnb)
    bert = [r for r in rows if r["family"] == "bert-cls"]
    assert all(r["task"] == "sequence-classification" and r["attn_dropout"] == "0.1"
               for r in bert)


def test_trl_and_liger_cases_are_listed_with_what_they_need():
    p = _run("--list")
    assert "need trl" in p.stdout and "need liger_kernel" in p.stdout
    rows = {r["id"]: r for r in _listed()}
    assert {"trainer", "sft", "dpo", "grpo"} == {r["trainer"] for r in rows.values()}
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
    ({"trainer": "kto"}, "trainer `kto` not in"),
    ({"trainer": "grpo"}, "completion_len is GRPO's max_completion_length"),
    ({"completion_len": 64}, "completion_len is GRPO's max_completion_length"),
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
    # within the 10% bar, its edge included: allocated +10% and +1% (not -12%)
    assert (a["within_10pct"], r["within_10pct"], d["within_10pct"]) == (2, 3, 2)
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
                              "under": 0, "within_10pct": 0}
    assert "-" in gpu_truth.render_summary(s)
    assert gpu_truth.rel_errors(_rec((1, 2), (1, 2), (1, 2), status="timeout")) == {}


def test_window_resets_after_step_1_and_samples_nvml_until_the_last_step(gpus):
    """The child's window over torch.cuda's allocator counters and NVML's device-wide figure,
    this process's context and blocks included (CUDA device 0: the H100)."""
    m = gpus()
    h100 = m.gpus[1]
    nvml = gpu_truth.open_nvml(0)
    w = gpu_truth.Window(gpu_truth.CudaStats(True), nvml, last_step=3)
    w.sampler.interval = 10.0  # only the samples at start and stop: deterministic
    m.cuda.allocate(300 * MiB)  # step 1: the peak
    m.cuda.release(200 * MiB)
    w.after_step(1)
    step1 = w.result["step1"]
    assert (step1["max_allocated"], step1["allocated"]) == (300 * MiB, 100 * MiB)
    others = h100.reserved + 2 * GiB + 64 * MiB  # the driver's and the other processes'
    at_start = others + CONTEXT + 300 * MiB  # NVML: 300 MiB still reserved
    assert nvml.used() == at_start
    m.cuda.empty_cache()  # step 2: the cache goes back to the driver, then 40 MiB more
    m.cuda.allocate(40 * MiB)
    w.after_step(2)
    assert "steady" not in w.result
    w.after_step(3)
    steady = w.result["steady"]
    assert steady["max_allocated"] == 140 * MiB  # reset after step 1: 100, then 140
    assert steady["max_reserved"] == 300 * MiB and steady["reserved"] == 140 * MiB
    assert steady["nvml_used_peak"] == at_start  # the window's largest sample, not the last
    assert steady["nvml_used_after"] == others + CONTEXT + 140 * MiB
    assert steady["steps"] == 2 and steady["nvml_samples"] == 2 and steady["nvml_errors"] == 0
    assert w.result["reserved_per_step"] == [300 * MiB, 140 * MiB, 140 * MiB]
    procs = w.result["other_processes"]
    assert procs["own_pid_listed"] is True and procs["others"] == [777, 778]


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
A100_UUID, H100_UUID = uuid_of(0), uuid_of(1)  # NVML's full form, "GPU-..."
A100_PREFIX = A100_UUID[:32]  # the shortest prefix only the A100's UUID starts with
FRONTS = ("pynvml", "ctypes")  # nvidia-ml-py installed, or only the driver's library


@pytest.fixture
def gpus(monkeypatch):
    """``gpus(front="pynvml", **cuda)``: a machine with two cards (``tests.fakes``) under NVML
    and torch.cuda. PCI order (NVML's): the A100 (bus 0x07), then the H100 (bus 0x3b); CUDA's,
    fastest first: the H100 is CUDA device 0, the A100 CUDA device 1. Pid 4242 holds 9 GiB on
    the A100; on the H100 pid 777 computes with 2 GiB and pid 778 draws with 64 MiB. This
    process holds nothing until CUDA creates its context. ``front="ctypes"``: nvidia-ml-py is
    not installed, ``libnvidia-ml.so.1`` is; ``cuda``: ``install_cuda``'s keywords."""
    for var in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER"):
        monkeypatch.setenv(var, "")  # recorded, so that what the code sets is undone
        monkeypatch.delenv(var)

    def make(front: str = "pynvml", machine: Machine | None = None, **cuda) -> Machine:
        m = machine
        if m is None:
            m = Machine([a100(0x07, 0), h100(0x3B, 1)])
            m.spawn(4242, A100_UUID, 9 * GiB)
            m.spawn(777, H100_UUID, 2 * GiB)
            m.spawn(778, H100_UUID, 64 * MiB, kind="graphics")
        m.lib = install_nvml(m, monkeypatch, nvidia_ml_py=front == "pynvml")
        m.cuda = install_cuda(m, monkeypatch, **cuda)
        return m

    return make


def _open(front: str):
    """open_nvml(0), as the harness does before CUDA is initialised, through ``front``."""
    reader = gpu_truth.open_nvml(0)
    assert reader.source == ("pynvml" if front == "pynvml" else "libnvidia-ml.so.1 (ctypes)"), \
        reader.failures
    return reader


def _used_v1(m: Machine, gpu: Gpu) -> int:
    """NVML's v1 ``used`` of ``gpu``: the driver's reservation and every process's bytes."""
    return gpu.reserved + sum(p.held(gpu.uuid) for p in m.processes)


@pytest.mark.parametrize("front", FRONTS)
@pytest.mark.parametrize("visible, expected", [
    (None, "H100"),         # CUDA device 0 is the fastest card; NVML's index 0 is the A100
    ("0", "H100"),          # integers index CUDA's order, not NVML's
    ("1", "A100"),
    (A100_PREFIX, "A100"),  # a UUID prefix: CUDA takes it, NVML would not
])
def test_nvml_reads_the_card_cuda_calls_device_0(gpus, monkeypatch, front, visible, expected):
    m = gpus(front)
    if visible is not None:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    gpu = next(g for g in m.gpus if expected in g.name)
    reader = _open(front)
    assert reader.name() == gpu.name and reader.used() == _used_v1(m, gpu)
    assert reader.used() == gpu.reserved + (9 * GiB if expected == "A100" else 2 * GiB + 64 * MiB)
    assert reader.uuid() == gpu.uuid
    assert reader.mapping == {"by": "uuid", "nvml_uuid": gpu.uuid}
    assert "GPU-" + reader.ids["uuid"] == gpu.uuid and reader.driver() == m.driver
    assert m.this.context == {}  # finding the card created no CUDA context
    reader.close()
    assert m.calls[-1] == "nvmlShutdown" and m.lib.refcount == 0


@pytest.mark.parametrize("front", FRONTS)
def test_without_a_torch_uuid_the_pci_address_finds_the_card(gpus, monkeypatch, front):
    m = gpus(front, missing_properties=("uuid",))  # a torch build without props.uuid
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    reader = _open(front)
    assert reader.mapping == {"by": "pci_bus_id", "pci_bus_id": "0000:07:00.0"}
    assert reader.name() == "NVIDIA A100-SXM4-80GB" and reader.used() == _used_v1(m, m.gpus[0])
    assert reader.uuid() == A100_UUID
    reader.close()
    pin = gpu_truth.pin_device(0)  # the pin is NVML's UUID of the card found by PCI address
    assert pin["cuda_visible_devices"] == A100_UUID
    assert pin["pinned_by"] == "uuid (NVML's, of the device found by pci_bus_id)"


@pytest.mark.parametrize("front", FRONTS)
def test_a_mig_instance_is_found_by_its_mig_uuid(gpus, front):
    """CUDA shows a GPU in MIG mode as its instance; NVML answers for the slice through the
    instance's own handle, without root (the parent's figures need it)."""
    m = Machine([a100(0x07, 0, migs=[("3g.40gb", 40 * GiB), ("3g.40gb", 40 * GiB)])])
    mig = m.gpus[0].migs[0]
    m.spawn(4242, mig.uuid, 5 * GiB)
    m.spawn(4343, m.gpus[0].migs[1].uuid, 7 * GiB)  # another tenant, in the other slice
    gpus(front, machine=m)
    reader = _open(front)
    assert reader.mapping == {"by": "uuid", "nvml_uuid": mig.uuid}
    assert reader.ids["name"] == "NVIDIA A100-SXM4-80GB MIG 3g.40gb"  # what CUDA calls it
    assert reader.name() == "NVIDIA A100-SXM4-80GB MIG 3g.40gb" and reader.used() == 5 * GiB
    procs = gpu_truth.reader_processes(reader)
    assert procs["compute"] == [{"pid": 4242, "used_gpu_memory": 5 * GiB}]
    assert procs["others"] == [4242] and procs["own_pid_listed"] is False


def test_no_nvml_device_matching_falls_back_to_torch_and_says_why(gpus):
    gpus("pynvml")  # both readers can load the library
    unknown = types.SimpleNamespace(name="NVIDIA H100 80GB HBM3", uuid="ffffffff-dead")
    reader = _gpu_nvml.open_nvml(0, get_properties=lambda i: unknown)
    assert reader.source.startswith("torch.cuda.mem_get_info")
    assert len(reader.failures) == 2 and all("no NVML device is CUDA device 0" in f
                                             for f in reader.failures)
    gpus("pynvml", missing_properties=("uuid", "pci_bus_id", "pci_device_id", "pci_domain_id"))
    reader = _gpu_nvml.open_nvml(0)  # a torch that reports neither
    assert reader.source.startswith("torch.cuda.mem_get_info")
    assert len(reader.failures) == 2 and all("neither a UUID nor a PCI address" in f
                                             for f in reader.failures)


def _listing(kind: str, absent: tuple[str, ...]) -> str:
    """The process-list call a reader makes: the newest the driver's library has."""
    base = f"nvmlDeviceGet{kind.title()}RunningProcesses"
    return next(base + v for v in ("_v3", "_v2", "") if base + v not in absent)


OLDER = tuple(f"nvmlDeviceGet{k}RunningProcesses{v}" for k in ("Compute", "Graphics")
              for v in ("_v3",))  # a driver before the _v3 calls


@pytest.mark.parametrize("front, absent", [
    ("pynvml", ()), ("ctypes", ()),
    ("ctypes", OLDER),  # the _v2 calls
    ("ctypes", OLDER + tuple(n.replace("_v3", "_v2") for n in OLDER)),  # nvmlProcessInfo_v1_t
])
def test_other_processes_exclude_this_one_and_tolerate_refusals(gpus, monkeypatch, front,
                                                                absent):
    m = gpus(front)
    m.nvml_absent.update(absent)
    h100 = _open(front)
    m.cuda.mem_get_info(0)  # this process's context on the H100: NVML lists it too
    procs = gpu_truth.reader_processes(h100)
    assert procs["compute"] == [{"pid": 777, "used_gpu_memory": 2 * GiB}]
    assert procs["graphics"] == [{"pid": 778, "used_gpu_memory": 64 * MiB}]
    assert procs["own_pid_listed"] is True and procs["others"] == [777, 778]
    assert procs["others_used_bytes"] == 2 * GiB + 64 * MiB
    assert _listing("compute", absent) in m.calls
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    a100 = _open(front)
    m.nvml_errors[_listing("graphics", absent)] = pynvml.NVML_ERROR_NOT_SUPPORTED
    procs = gpu_truth.reader_processes(a100)
    assert procs["compute"] == [{"pid": 4242, "used_gpu_memory": 9 * GiB}]
    assert procs["graphics"] == "unknown" and procs["graphics_error"] == "NVML_ERROR_NOT_SUPPORTED"
    assert procs["others"] == "unknown" and procs["own_pid_listed"] is False
    m.nvml_errors[_listing("compute", absent)] = pynvml.NVML_ERROR_NO_PERMISSION
    procs = gpu_truth.reader_processes(a100)
    assert procs["compute"] == "unknown" and procs["compute_error"] == "NVML_ERROR_NO_PERMISSION"


@pytest.mark.parametrize("front", FRONTS)
def test_a_process_nvml_cannot_size_is_listed_with_none(gpus, front):
    """Under Windows' WDDM driver model (WSL2's libnvidia-ml.so.1 included) NVML lists processes
    without their bytes (NVML_VALUE_NOT_AVAILABLE): known to be there, not counted in the bytes
    of the others."""
    card = Gpu("NVIDIA RTX A6000", 48 * GiB, (8, 6), uuid_of(2), 0x21, wddm=True)
    m = Machine([card])
    m.spawn(23, card.uuid, 300 * MiB, kind="graphics")
    m.spawn(4242, card.uuid, 2 * GiB)
    gpus(front, machine=m)
    procs = gpu_truth.reader_processes(_open(front))
    assert procs["graphics"] == [{"pid": 23, "used_gpu_memory": None}]
    assert procs["compute"] == [{"pid": 4242, "used_gpu_memory": None}]
    assert procs["others"] == [23, 4242] and procs["others_used_bytes"] == 0


def test_pin_is_the_full_uuid_of_the_chosen_device(gpus, monkeypatch):
    m = gpus()
    parent = f"{A100_PREFIX},{H100_UUID[:32]}"  # the A100, then the H100 (one kind: UUIDs)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", parent)
    pin = _gpu_nvml.pin_device(1)
    assert pin["cuda_visible_devices"] == pin["uuid"] == H100_UUID
    assert pin["name"] == "NVIDIA H100 80GB HBM3" and pin["pinned_by"].startswith("uuid (NVML")
    assert pin["parent_cuda_visible_devices"] == parent
    env = gpu_truth.child_env(False, pin=pin["cuda_visible_devices"], cache="/tmp/x")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", env["CUDA_VISIBLE_DEVICES"])
    assert [t.name for t in enumerate_devices(m)] == ["NVIDIA H100 80GB HBM3"]  # that one only
    assert m.cuda.device_count() == 1 and m.this.context == {}
    # no NVML library at all: torch's UUID with the GPU- prefix; a MIG instance's with MIG-
    remove_nvml_library(monkeypatch)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    pin = _gpu_nvml.pin_device(0)
    assert pin["cuda_visible_devices"] == A100_UUID and "torch's" in pin["pinned_by"]
    assert pin["nvml_source"].startswith("torch.cuda.mem_get_info")
    mig = Machine([a100(0x07, 0, migs=[("1g.10gb", 10 * GiB)])])
    install_cuda(mig, monkeypatch)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert _gpu_nvml.pin_device(0)["cuda_visible_devices"] == mig_uuid_of(0, 0)
    # no UUID from torch either: the entry this process had for the device
    install_cuda(m, monkeypatch, missing_properties=("uuid",))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    pin = _gpu_nvml.pin_device(0)
    assert pin["cuda_visible_devices"] == "1" and pin["uuid"] is None


def test_a_pinned_child_measures_its_context_on_the_pinned_card(gpus, monkeypatch, tmp_path):
    """Parent: pin CUDA device 1 (the A100). Child, under the pin: NVML's used before CUDA and
    after torch.cuda.init() + synchronize (which creates the context), on the pinned card."""
    m = gpus()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    pin = _gpu_nvml.pin_device(1)
    env = gpu_truth.child_env(False, pin=pin["cuda_visible_devices"], cache=str(tmp_path))
    for var in ("CUDA_VISIBLE_DEVICES", "HF_MEMKIT_CACHE"):  # now the child's
        monkeypatch.setenv(var, env[var])
    nvml = gpu_truth.open_nvml(0)
    ctx = gpu_truth.init_cuda(nvml, smoke=False)
    assert ctx["nvml_used_before_cuda"] == m.gpus[0].reserved + 9 * GiB
    assert ctx["context_bytes"] == CONTEXT and m.this.context == {A100_UUID: CONTEXT}
    assert ctx["visible_device_count"] == 1 and ctx["nvml_uuid"] == A100_UUID
    before = ctx["other_processes_before"]
    assert before["others"] == [4242] and before["own_pid_listed"] is False
    assert ctx["calibration_cache"]["isolated"] is True
    assert gpu_truth.check_pin(pin, ctx) is None and pin["child_reads_pinned_device"] is True


def test_child_env_pins_one_device_and_a_fresh_calibration_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    monkeypatch.setenv("HF_MEMKIT_CACHE", "/home/user/.cache/hf_memkit")
    env = gpu_truth.child_env(False, pin=H100_UUID, cache=str(tmp_path))
    assert env["CUDA_VISIBLE_DEVICES"] == H100_UUID and "," not in \
        env["CUDA_VISIBLE_DEVICES"]
    assert env["HF_MEMKIT_CACHE"] == str(tmp_path)
    assert gpu_truth.child_env(True, cache=str(tmp_path))["CUDA_VISIBLE_DEVICES"] == ""
    seen = {}

    def fake_child(flag, **kw):
        seen.update(kw)
        return {"context": {}, "estimate": {"peak_allocated": 1}}, 1, "boom\n", 1.0

    monkeypatch.setattr(gpu_truth, "run_child", fake_child)
    pin = {"cuda_visible_devices": H100_UUID, "uuid": H100_UUID,
           "name": "NVIDIA H100 80GB HBM3"}
    rec = gpu_truth.run_case(_gpu_cases.CASES[0], timeout=5, pin=pin)
    assert seen["pin"] == H100_UUID
    assert rec["gpu"] == {"uuid": H100_UUID, "name": "NVIDIA H100 80GB HBM3"}


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
    pin = {"cuda_visible_devices": H100_UUID, "uuid": H100_UUID}
    ok = {"visible_device_count": 1, "nvml_uuid": H100_UUID, "nvml_mapping": {}}
    assert gpu_truth.check_pin(dict(pin), ok) is None
    assert "sees 2 CUDA devices" in gpu_truth.check_pin(dict(pin), {**ok,
                                                                    "visible_device_count": 2})
    other = gpu_truth.check_pin(dict(pin), {**ok, "nvml_uuid": A100_UUID})
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
    # what a --cpu-smoke child measures with: zeros from the allocator, no NVML
    w = gpu_truth.Window(gpu_truth.CudaStats(False), gpu_truth.open_nvml(0, smoke=True),
                         last_step=3)
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
    assert w.result["steady"]["nvml_used_peak"] is None


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
