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

import pytest

from tests.helpers import ROOT

BENCH = ROOT / "bench"
SCRIPT = BENCH / "gpu_truth.py"
sys.path.insert(0, str(BENCH))

import _gpu_cases  # noqa: E402  (bench/_gpu_cases.py: the matrix the harness runs)
import gpu_truth  # noqa: E402

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


def test_nvml_handle_follows_cuda_visible_devices(monkeypatch):
    def h(i):
        return ("index", i)

    def u(x):
        return ("uuid", x)

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert gpu_truth._nvml_handle(h, u, 0) == ("index", 0)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    assert gpu_truth._nvml_handle(h, u, 1) == ("index", 1) and \
        gpu_truth._nvml_handle(h, u, 0) == ("index", 3)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-1234-abcd")
    assert gpu_truth._nvml_handle(h, u, 0) == ("uuid", "GPU-1234-abcd")


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
    assert "child ended during the estimate" in rec["estimate"]["error"]
    assert rec["rel_error"] == dict.fromkeys(gpu_truth.METRICS)
    monkeypatch.setattr(gpu_truth, "run_child", lambda *a, **k: ({}, None, "", 10.0))
    rec = gpu_truth.run_case(case, timeout=10)
    assert rec["status"] == "timeout" and "10 s" in rec["error"]
    monkeypatch.setattr(gpu_truth, "run_child", lambda *a, **k: (
        {}, 1, "Traceback ...\ntorch.OutOfMemoryError: CUDA out of memory.\nexit\n", 1.0))
    rec = gpu_truth.run_case(case, timeout=10)
    assert rec["status"] == "error" and "OutOfMemoryError" in rec["error"]


# the real cases of the gpu-marked test (tests/integration/test_gpu_truth_runs.py)
GPU_CASES = ("gpt2-124m.fp32.adamw_torch.sdpa.b8s1024",
             "bert-base-cls.amp_bf16.adafactor.sdpa.ckpt.b32s512",
             "llama-160m.fp32.fwd-bwd.sdpa.b4s1024")
