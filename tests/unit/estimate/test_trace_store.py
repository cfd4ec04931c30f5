"""Traces kept on disk between processes (``_store``): a hit answers exactly what a
fresh trace does, every input of a trace is part of its key (a change misses), and the store
survives what a shared folder meets (corrupt entries, FIFOs, several writers, no room, no
permission)."""

from __future__ import annotations

import collections
import dataclasses
import inspect
import json
import math
import multiprocessing
import os
import subprocess
import sys
import warnings
import zlib

import pytest
import torch
from peft import LoraConfig
from transformers import BitsAndBytesConfig, LlamaConfig

import hf_memkit as mk
from hf_memkit import _store as store
from hf_memkit._cuda.target import CudaTarget
from hf_memkit._estimate import activations
from hf_memkit._estimate.activations import disk_key, trace_excess
from hf_memkit._model.spec import resolve_model
from hf_memkit._setup.setup import normalize_args
from hf_memkit.commands.main import main

# 6 blocks: traced at 2 and 3 and extrapolated, the allocator replay deepened to full depth
DEEP = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                   num_attention_heads=2, num_key_value_heads=1, vocab_size=128,
                   max_position_embeddings=256)
ARGS = {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 4, "bf16": True}
LORA = LoraConfig(r=8, target_modules=["q_proj", "v_proj", "k_proj", "o_proj"],
                  task_type="CAUSAL_LM")


@pytest.fixture
def disk(monkeypatch, tmp_path):
    """The trace store on, in a folder of this test's own (tests/conftest.py turns it off)."""
    monkeypatch.delenv(store.NO_CACHE_ENV, raising=False)
    monkeypatch.delenv(store.SIZE_ENV, raising=False)
    monkeypatch.setenv("HF_MEMKIT_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "traces"


def _entries(folder) -> list:
    return sorted(p for p in folder.glob("*" + store.SUFFIX)) if folder.exists() else []


def _estimate(args=ARGS, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return mk.estimate_memory(DEEP, args, seq_len=64, device="T4", **kw)


def _same(a, b) -> None:
    """Two estimates agree on every figure (the trace's own wall time aside)."""
    da, db = a.to_dict(), b.to_dict()
    da.pop("trace_seconds", None)
    db.pop("trace_seconds", None)
    assert da == db


def test_a_hit_answers_what_a_fresh_trace_does(disk, monkeypatch):
    first = _estimate()
    assert len(_entries(disk)) > 1  # the trace and its allocator replay
    again = _estimate()
    assert again.trace_seconds == first.trace_seconds  # read back, not traced again
    monkeypatch.setenv(store.NO_CACHE_ENV, "1")
    fresh = _estimate()
    assert fresh.trace_seconds != first.trace_seconds
    _same(again, fresh)
    _same(first, fresh)


def _kinds(folder) -> collections.Counter:
    """How many entries are traces and how many allocator replays."""
    out: collections.Counter = collections.Counter()
    for p in _entries(folder):
        value = json.loads(zlib.decompress(p.read_bytes()))["value"]
        out["trace" if "phases" in value else "replay"] += 1
    return out


def test_another_optimizer_or_accumulation_reuses_the_trace(disk, monkeypatch):
    _estimate()
    assert _kinds(disk)["trace"] == 1
    neighbours = [dict(ARGS, gradient_accumulation_steps=8), dict(ARGS, optim="adafactor")]
    hits = [_estimate(a) for a in neighbours]
    assert _kinds(disk)["trace"] == 1  # no new trace: only replays with other states
    monkeypatch.setenv(store.NO_CACHE_ENV, "1")
    for a, hit in zip(neighbours, hits, strict=True):
        _same(hit, _estimate(a))


def test_a_lora_trace_is_read_back_by_another_process(disk):
    """The key is the same in every process (a LoRA config holds sets, whose order changes
    with the hash seed; classes are named, never ``id()``)."""
    code = ("import json, warnings; warnings.simplefilter('ignore'); import hf_memkit as mk; "
            "from peft import LoraConfig; from transformers import LlamaConfig; "
            f"c = LlamaConfig(**{DEEP.to_dict()!r}); "
            "lora = LoraConfig(r=8, target_modules=['q_proj', 'v_proj', 'k_proj', 'o_proj'], "
            "task_type='CAUSAL_LM'); "
            f"e = mk.estimate_memory(c, {ARGS!r}, seq_len=64, device='T4', peft_config=lora); "
            "print(json.dumps([e.trace_seconds, e.device_used]))")
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, check=True).stdout
    seconds, used = json.loads(out.strip().splitlines()[-1])
    e = _estimate(peft_config=LORA)
    assert (e.trace_seconds, e.device_used) == (seconds, used)


# ----------------------------------------------------------------------------------------------
# The key: every input of a trace
# ----------------------------------------------------------------------------------------------

BASE_KW = dict(seq_len=64, stage="train", target_len=None, padded=False, forward_only=False,
               target=CudaTarget.of((7, 5), "12.8"))


def _key(config=DEEP, args=None, spec_kw=None, **kw):
    spec = resolve_model(config, **(spec_kw or {}))
    setup = normalize_args(dict({"per_device_train_batch_size": 2,
                                 "gradient_accumulation_steps": 2}, **(args or {})))
    return disk_key(spec, setup, **dict(BASE_KW, **kw))


VARIANTS = {
    "config": dict(config=LlamaConfig(**{**DEEP.to_dict(), "attention_bias": True})),
    "vocabulary": dict(config=LlamaConfig(**{**DEEP.to_dict(), "vocab_size": 256})),
    "depth": dict(config=LlamaConfig(**{**DEEP.to_dict(), "num_hidden_layers": 5})),
    "task (model class)": dict(spec_kw={"task": "sequence-classification"}),
    "dtype": dict(spec_kw={"dtype": torch.bfloat16}),
    "attention": dict(spec_kw={"attn_implementation": "eager"}),
    "lora": dict(spec_kw={"peft_config": LORA}),
    "lora rank": dict(spec_kw={"peft_config": dataclasses.replace(LORA, r=16)}),
    "qlora": dict(spec_kw={"peft_config": LORA, "quantization_config": BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4",
        bnb_4bit_compute_dtype=torch.bfloat16)}),
    "amp": dict(args={"bf16": True}),
    "checkpointing": dict(args={"gradient_checkpointing": True}),
    "micro-batch": dict(args={"per_device_train_batch_size": 4}),
    "accumulation (1 vs 2 micro-steps)": dict(args={"gradient_accumulation_steps": 1}),
    "seq_len": dict(seq_len=128),
    "stage": dict(stage="forward_backward"),
    "target_len": dict(target_len=32),
    "padded": dict(padded=True),
    "forward_only": dict(forward_only=True),
    "CUDA target": dict(target=CudaTarget.of((9, 0), "13.0")),
    "CPU target": dict(target=None),
}


def test_each_input_of_a_trace_changes_its_key(disk):
    base = _key()
    assert base is not None and _key() == base
    keys = {name: _key(**v) for name, v in VARIANTS.items()}
    for name, k in keys.items():
        assert k is not None and k != base, name
    assert len(set(keys.values())) == len(keys)


def test_the_trainer_and_a_technique_change_the_key(disk):
    spec = resolve_model(DEEP)
    plain = normalize_args({"per_device_train_batch_size": 2})
    sft = normalize_args({"per_device_train_batch_size": 2}, trainer="sft")
    liger = normalize_args({"per_device_train_batch_size": 2, "use_liger_kernel": True})
    keys = {disk_key(spec, s, **BASE_KW) for s in (plain, sft, liger)}
    assert len(keys) == 3


def test_every_argument_of_trace_excess_is_in_the_key():
    """A new argument of ``trace_excess`` must join ``disk_key``'s: ``trace_excess`` hands its
    keyword arguments to it whole."""
    params = set(inspect.signature(trace_excess).parameters) - {"spec", "setup"}
    assert params == set(BASE_KW)
    src = inspect.getsource(trace_excess)
    assert "disk_key(spec, shape, **kw)" in src and "_trace_excess(spec, shape, **kw)" in src


@pytest.mark.parametrize("library", ["hf_memkit", *store.LIBRARIES])
def test_another_library_version_misses(disk, monkeypatch, library):
    _estimate()
    n = len(_entries(disk))
    versions = dict(store.versions())
    versions[library] = "0.0.0-other"
    monkeypatch.setattr(store, "versions", lambda: versions)
    e = _estimate()
    assert len(_entries(disk)) > n  # traced and stored again under the new key
    assert e.trace_seconds > 0


def test_versions_cover_the_libraries_a_trace_runs():
    v = store.versions()
    assert {"hf_memkit", "torch", "transformers", "peft", "trl", "bitsandbytes",
            "accelerate"} <= set(v)
    assert v["torch"] is not None and v["torch"].split("+")[0] in torch.__version__
    assert v["hf_memkit"][0] == mk.__version__ and len(v["hf_memkit"][1]) == 16


def test_a_part_without_a_stable_form_is_not_cached():
    class Local:
        pass

    assert store.make_key({"x": object()}) is None
    assert store.make_key({"x": "<thing at 0x7f00deadbeef>"}) is None
    assert store.make_key({"x": {1, 2}}) == store.make_key({"x": {2, 1}})
    assert store.make_key({"cls": Local}) is not None  # defined in this file: its source


# ----------------------------------------------------------------------------------------------
# The store
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("damage", ["garbage", "truncated", "another key", "fifo", "empty"])
def test_a_damaged_entry_is_a_miss_and_goes(disk, damage):
    first = _estimate()
    target = max(_entries(disk), key=lambda p: p.stat().st_size)  # the trace
    data = target.read_bytes()
    target.unlink()
    if damage == "fifo":
        os.mkfifo(target)
    elif damage == "another key":
        entry = json.loads(zlib.decompress(data))
        entry["key"] += " "  # what a hash collision would look like
        target.write_bytes(zlib.compress(json.dumps(entry).encode()))
    else:
        target.write_bytes({"garbage": b"\x00not zlib", "truncated": data[:len(data) // 2],
                            "empty": b""}[damage])
    again = _estimate()  # traced again, never a hang or a crash
    assert again.trace_seconds != first.trace_seconds
    _same(again, first)
    assert target.is_file() and not target.is_symlink()  # rewritten as a regular entry


def _tampered(value: dict, where: str, number) -> dict:
    """A trace (or allocator replay) entry's value with ``number`` written at ``where``."""
    if where == "phases":
        value["phases"] = {k: number for k in value["phases"]}
    elif where == "events":  # the first allocation's bytes in the allocator's event log
        value["replays"][0][1]["events"][1][2] = number
    elif where == "replay":
        value.update(peak_allocated=number, peak_reserved=number, on_device=number)
    else:
        value[where] = number
    return value


@pytest.mark.parametrize("where, number", [
    ("phases", -10**15), ("phases", 2**60), ("phases", "-4096"), ("inputs", 1.5),
    ("seconds", float("nan")), ("events", -10**15), ("replay", -10**15),
    ("how", "\x1b]0;pwned\x07"),
])
def test_an_entry_holding_what_no_trace_holds_is_a_miss(disk, where, number):
    """Negative, huge or non-integer byte counts (a planted entry) are never trusted: the step is
    traced (or replayed) again, the answer is a fresh one's and the entry is overwritten."""
    first = _estimate()
    kind = "replay" if where in ("replay", "how") else "trace"
    for p in _entries(disk):
        entry = json.loads(zlib.decompress(p.read_bytes()))
        if ("phases" in entry["value"]) == (kind == "trace"):
            entry["value"] = _tampered(entry["value"], where, number)
            p.write_bytes(zlib.compress(json.dumps(entry).encode()))
    again = _estimate()
    _same(again, first)
    if kind == "trace":
        assert math.isfinite(again.trace_seconds) and again.trace_seconds != first.trace_seconds
    for p in _entries(disk):  # rewritten with what the step holds
        value = json.loads(zlib.decompress(p.read_bytes()))["value"]
        assert all(isinstance(v, int) and v >= 0 for v in value.get("phases", {}).values())
        assert value.get("how", "traced") in ("traced", "extended", "deepened")


def test_least_recently_used_entries_go_first(tmp_path):
    s = store.TraceStore(tmp_path, limit=10**9)
    payload = "x" * 2000
    for i, k in enumerate("abc"):
        s.put(k, f"{k}{payload}{os.urandom(1500).hex()}")
        os.utime(s.path(k), (1000 + i, 1000 + i))  # a older than b older than c
    assert s.get("a") is not None  # a is used again: now the newest
    size = sum(p.stat().st_size for p in tmp_path.iterdir())
    s.limit = size - 1
    assert s.evict() == 1
    assert s.get("b") is None and s.get("a") is not None and s.get("c") is not None


def _writer(root: str, n: int) -> None:
    s = store.TraceStore(root, limit=10**9)
    for _ in range(n):
        s.put("shared", {"value": list(range(5000))})


def test_several_processes_share_the_folder(tmp_path):
    ctx = multiprocessing.get_context("fork")  # the writers run no torch op
    procs = [ctx.Process(target=_writer, args=(str(tmp_path), 20)) for _ in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    s = store.TraceStore(tmp_path, limit=10**9)
    assert s.get("shared") == {"value": list(range(5000))}
    assert [p.name for p in tmp_path.iterdir()] == [s.path("shared").name]  # no leftovers


def test_an_unwritable_cache_warns_once_and_estimates(monkeypatch, tmp_path):
    monkeypatch.delenv(store.NO_CACHE_ENV, raising=False)
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("HF_MEMKIT_CACHE", str(blocker))
    with pytest.warns(UserWarning, match="traces are not kept on disk"):
        e = mk.estimate_memory(DEEP, ARGS, seq_len=64, device="cpu")
    assert e.peak_allocated > 0


def test_the_size_limit_is_read_from_the_environment(disk, monkeypatch):
    monkeypatch.setenv(store.SIZE_ENV, "1KiB")
    assert store.size_limit() == 1024
    _estimate()
    assert sum(p.stat().st_size for p in _entries(disk)) <= 1024
    monkeypatch.setenv(store.SIZE_ENV, "lots")
    with pytest.raises(mk.HfMemkitError, match=f"{store.SIZE_ENV}='lots'.*20GiB"):
        store.size_limit()


def test_entries_hold_data_never_code(disk):
    _estimate()
    for p in _entries(disk):
        entry = json.loads(zlib.decompress(p.read_bytes()))  # plain JSON: nothing to execute
        assert entry["format"] == store.FORMAT and isinstance(entry["key"], str)


def test_excess_round_trips_through_json():
    spec = resolve_model(DEEP)
    setup = normalize_args({"per_device_train_batch_size": 2, "gradient_accumulation_steps": 2})
    e = activations._trace_excess(spec, setup, **BASE_KW)
    back = activations.Excess.from_dict(json.loads(json.dumps(e.to_dict())))
    assert dataclasses.replace(back, replays=()) == dataclasses.replace(e, replays=())
    for (n1, log1, t1), (n2, log2, t2) in zip(e.replays, back.replays, strict=True):
        assert (n1, t1) == (n2, t2)
        assert (log1.events, log1.where, log1.owner, log1.blocks) == \
            (log2.events, log2.where, log2.owner, log2.blocks)


# ----------------------------------------------------------------------------------------------
# The command line
# ----------------------------------------------------------------------------------------------


def test_cli_cache_info_clear_and_no_cache(disk, tmp_path, capsys):
    LlamaConfig(**DEEP.to_dict()).save_pretrained(tmp_path / "deep")
    est = ["estimate", str(tmp_path / "deep"), "--gpu", "T4", "--seq-len", "64", "--batch", "2"]
    assert main(est + ["--no-cache"]) == 0
    capsys.readouterr()
    assert main(["cache", "info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    # --no-cache kept nothing and turned the store off for this process (and its children)
    assert info["path"] == str(disk) and info["entries"] == 0 and not info["enabled"]
    os.environ.pop(store.NO_CACHE_ENV, None)
    assert main(est) == 0
    capsys.readouterr()
    assert main(["cache", "info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["entries"] == len(_entries(disk)) > 0
    assert info["size"] == sum(p.stat().st_size for p in _entries(disk))
    assert main(["cache", "info"]) == 0
    assert str(disk) in capsys.readouterr().out
    assert main(["cache", "clear"]) == 0
    assert f"removed {info['entries']} traces" in capsys.readouterr().out
    assert _entries(disk) == []
