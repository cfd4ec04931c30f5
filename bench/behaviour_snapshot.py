"""A snapshot of what hf_memkit answers, to show that a refactoring changes no answer.

Writes one JSON file holding, for a fixed set of questions, everything a user reads of the
answer: every ``bench/estimator_cpu.py`` and ``bench/estimator_trl.py`` prediction (the TRL bench's
plain-Trainer baselines too), CUDA-target estimates with their notes (single GPU, LoRA, QLoRA,
eval, a custom loop), DDP, FSDP2, ZeRO-2/3 (offload included), context, sequence and tensor
parallelism, GRPO and RLOO with and without a colocated vLLM, and plans (every candidate with
its reason, the chosen arguments, the notes, the launch lines, the accelerate config, the
ladder of what each rung saved, and ``explain()``), plus the reverse queries. A question that
raises records its error text, so a refusal is part of the answer too.

Run it on two trees and compare (the package is imported from ``PYTHONPATH`` first)::

    PYTHONPATH=/path/to/old python bench/behaviour_snapshot.py --out old.json
    python bench/behaviour_snapshot.py --out new.json --compare old.json

``--compare`` prints each question whose answer differs (the first differing path and both
values; ``free_memory``, a reading of this machine's RAM, is left out) and exits 1 if any does. Traces are kept in a fresh cache folder per run, so no answer
is read from a trace another tree made. Takes some 10 minutes on 2 cores. ``--quick`` asks
three questions (a CPU estimate, a CUDA estimate, a plan) in seconds; ``--only`` picks others.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _quick import add_flag, guard  # noqa: E402

QUICK = ("cpu: llama fp32 adamw sdpa", "estimate: gpt2 t4 fp16 custom loop", "plan: gpt2 cpu")

GRPO_VLLM = {"use_vllm": True, "vllm_mode": "colocate", "per_device_train_batch_size": 4,
             "num_generations": 8, "max_completion_length": 512, "bf16": True,
             "gradient_checkpointing": True, "vllm_gpu_memory_utilization": 0.3}
# on one process: two accumulation steps make the generation batch (4 x 2) whole groups of 8,
# as TRL requires
GRPO_VLLM_1 = {**GRPO_VLLM, "gradient_accumulation_steps": 2}
DS3 = {"zero_optimization": {"stage": 3}, "bf16": {"enabled": True}}
LORA = {"r": 16, "lora_alpha": 32, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}


def _lora() -> Any:
    import peft

    return peft.LoraConfig(**LORA)


def _qlora() -> Any:
    import torch
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                              bnb_4bit_compute_dtype=torch.bfloat16)


def estimate_questions() -> dict[str, tuple[tuple, dict]]:
    """name -> (args, kwargs) of ``estimate_memory`` on CUDA targets."""
    b = {"bf16": True, "per_device_train_batch_size": 2, "gradient_checkpointing": True}
    q: dict[str, tuple[tuple, dict]] = {
        "8b h100 bf16 ckpt": (("Llama-3.1-8B", b), dict(seq_len=2048, device="H100-80GB")),
        "8b h100 no ckpt cuda 11.2": (("Llama-3.1-8B", {**b, "gradient_checkpointing": False}),
                                      dict(seq_len=1024, device="V100-32GB",
                                           cuda_version="11.2")),
        "1b 4090 lora": (("Llama-3.2-1B", b), dict(seq_len=2048, device="RTX-4090",
                                                    peft_config="lora", dtype="bfloat16")),
        "1b 4090 qlora": (("Llama-3.2-1B", b), dict(seq_len=2048, device="RTX-4090",
                                                     peft_config="lora",
                                                     quantization_config="qlora")),
        "qwen 7b a100 eval": (("Qwen2.5-7B", {"per_device_eval_batch_size": 4}),
                              dict(seq_len=1024, device="A100-40GB", stage="eval",
                                   dtype="bfloat16")),
        "gpt2 t4 fp16 custom loop": (("gpt2", {"fp16": True, "per_device_train_batch_size": 8}),
                                     dict(seq_len=512, device="T4",
                                          stage="forward_backward")),
        "bert t4 adafactor": (("bert-base-uncased", {"optim": "adafactor",
                                                     "per_device_train_batch_size": 16}),
                              dict(seq_len=256, device="T4", task="sequence-classification")),
        "8b ddp x4": (("Llama-3.1-8B", b), dict(seq_len=1024, device="H100-80GB", num_gpus=4,
                                                 peft_config="lora", dtype="bfloat16")),
        "8b fsdp2 x8": (("Llama-3.1-8B", {**b, "fsdp": True, "fsdp_config": {"version": 2}}),
                        dict(seq_len=4096, device="A100-40GB", num_gpus=8)),
        "8b fsdp2 accum sync_each_batch": (
            ("Llama-3.1-8B", {**b, "gradient_accumulation_steps": 4, "fsdp": True,
                              "fsdp_config": {"version": 2},
                              "accelerator_config": {"gradient_accumulation_kwargs":
                                                     {"sync_each_batch": True}}}),
            dict(seq_len=2048, device="A100-80GB", num_gpus=4)),
        "8b fsdp2 offload grad-op": (
            ("Llama-3.1-8B", {**b, "fsdp": True, "fsdp_config": {
                "version": 2, "cpu_offload": True, "reshard_after_forward": False}}),
            dict(seq_len=2048, device="RTX-4090", num_gpus=2)),
        "8b zero3 x8": (("Llama-3.1-8B", {**b, "deepspeed": DS3}),
                        dict(seq_len=4096, device="H100-80GB", num_gpus=8)),
        "8b zero2 offload x2": (
            ("Llama-3.1-8B", {**b, "deepspeed": {"zero_optimization": {
                "stage": 2, "offload_optimizer": {"device": "cpu"}}}}),
            dict(seq_len=1024, device="RTX-4090", num_gpus=2)),
        "8b zero3 offload params": (
            ("Llama-3.1-8B", {**b, "deepspeed": {"zero_optimization": {
                "stage": 3, "offload_optimizer": {"device": "cpu"},
                "offload_param": {"device": "cpu"}}}}),
            dict(seq_len=1024, device="RTX-4090", num_gpus=4)),
        "qwen3 8b cp x8 sft": (
            ("Qwen3-8B", {"bf16": True, "per_device_train_batch_size": 1, "fsdp": "full_shard",
                          "fsdp_config": {"version": 2}, "activation_checkpointing": True,
                          "parallelism_config": {"cp_size": 8}, "max_length": 131072}),
            dict(trainer="sft", num_gpus=8, device="H100-80GB", dtype="bfloat16")),
        "qwen3 8b cp x4 alltoall hsdp": (
            ("Qwen3-8B", {**b, "fsdp": True, "fsdp_config": {"version": 2},
                          "parallelism_config": {"cp_size": 4, "dp_shard_size": 2,
                                                 "cp_comm_strategy": "alltoall"}}),
            dict(seq_len=32768, num_gpus=8, device="H100-80GB")),
        "8b sp x4 zero3": (
            ("Llama-3.1-8B", {**b, "deepspeed": DS3,
                              "parallelism_config": {"sp_size": 4, "sp_backend": "deepspeed"}}),
            dict(seq_len=65536, num_gpus=8, device="H100-80GB")),
        "8b tp x2": (("Llama-3.1-8B", {**b, "parallelism_config": {"tp_size": 2}}),
                     dict(seq_len=4096, num_gpus=2, device="H100-80GB")),
        "8b tp x2 fsdp x2": (("Llama-3.1-8B", {**b, "fsdp": True, "fsdp_config": {"version": 2},
                                               "parallelism_config": {"tp_size": 2,
                                                                      "dp_shard_size": 2}}),
                             dict(seq_len=4096, num_gpus=4, device="H100-80GB")),
        "1b sft packing cuda": (("Llama-3.2-1B", {**b, "packing": True, "max_length": 2048}),
                                dict(trainer="sft", device="A100-40GB")),
        "1b dpo ref copy cuda": (("Llama-3.2-1B", {**b, "max_length": 1024}),
                                 dict(trainer="dpo", device="A100-80GB")),
        "1b dpo zero3 ref": (("Llama-3.2-1B", {**b, "max_length": 1024, "deepspeed": DS3}),
                             dict(trainer="dpo", device="A100-80GB", num_gpus=4)),
        "1b grpo generate cuda": (
            ("Llama-3.2-1B", {**b, "num_generations": 4, "max_completion_length": 256,
                              "beta": 0.04, "gradient_accumulation_steps": 3,
                              "steps_per_generation": 2}),
            dict(trainer="grpo", seq_len=256, device="H100-80GB")),
        "grpo zero3 gather x4": (
            ("Llama-3.2-1B", {**b, "num_generations": 4, "max_completion_length": 256,
                              "deepspeed": DS3}),
            dict(trainer="grpo", seq_len=256, device="H100-80GB", num_gpus=4)),
        "qwen3 4b grpo vllm colocate": (("Qwen3-4B", GRPO_VLLM_1),
                                        dict(trainer="grpo", seq_len=512, device="H100-80GB",
                                             dtype="bfloat16")),
        "qwen3 4b grpo vllm sleep lora": (
            ("Qwen3-4B", {**GRPO_VLLM_1, "vllm_enable_sleep_mode": True,
                          "vllm_importance_sampling_correction": True}),
            dict(trainer="grpo", seq_len=512, device="RTX-4090", dtype="bfloat16",
                 peft_config="lora")),
        "8b grpo vllm fsdp x4": (("Llama-3.1-8B", {**GRPO_VLLM, "fsdp": True,
                                                  "fsdp_config": {"version": 2}}),
                                 dict(trainer="grpo", seq_len=512, device="H100-80GB",
                                      num_gpus=4)),
        "1b rloo vllm qlora": (("Llama-3.2-1B", {**GRPO_VLLM, "num_generations": 4}),
                               dict(trainer="rloo", seq_len=256, device="RTX-4090",
                                    peft_config="lora", quantization_config="qlora")),
    }
    return q


def plan_questions() -> dict[str, dict]:
    """name -> kwargs of ``plan_training``."""
    return {
        "8b 4090 x32": dict(model="Llama-3.1-8B", seq_len=2048, target_batch_size=32,
                            device="RTX-4090"),
        "8b 4090x2 x16": dict(model="Llama-3.1-8B", seq_len=2048, target_batch_size=16,
                              device="RTX-4090", num_gpus=2),
        "70b h100x8 x64": dict(model="Llama-3.1-70B", seq_len=4096, target_batch_size=64,
                               device="H100-80GB", num_gpus=8),
        "70b h100x8 deepspeed": dict(model="Llama-3.1-70B", seq_len=4096, target_batch_size=64,
                                     device="H100-80GB", num_gpus=8, engine="deepspeed"),
        "8b a100-40 x16 lora pinned": dict(model="Llama-3.1-8B", seq_len=1024,
                                           target_batch_size=16, device="A100-40GB",
                                           method="lora"),
        "1b sft a100": dict(model="Llama-3.2-1B", seq_len=1024, target_batch_size=16,
                            device="A100-80GB", trainer="sft"),
        "1b sft lengths": dict(model="Llama-3.2-1B", target_batch_size=16, device="A100-40GB",
                               trainer="sft", lengths=[100, 900, 2000, 300] * 64),
        "1b dpo 4090": dict(model="Llama-3.2-1B", seq_len=1024, target_batch_size=8,
                            device="RTX-4090", trainer="dpo"),
        "bert t4": dict(model="bert-base-uncased", seq_len=512, target_batch_size=64,
                        device="T4", task="sequence-classification"),
        "gpt2 cpu": dict(model="gpt2", seq_len=256, target_batch_size=8, device="cpu"),
        "qwen3 8b cp 1 seq x8": dict(model="Qwen3-8B", seq_len=262144, target_batch_size=1,
                                     device="H100-80GB", num_gpus=8, trainer="sft"),
        "8b sp deepspeed x8": dict(model="Llama-3.1-8B", seq_len=131072, target_batch_size=2,
                                   device="H100-80GB", num_gpus=8, engine="deepspeed"),
        "qwen3 4b grpo vllm": dict(model="Qwen3-4B", seq_len=512, target_batch_size=16,
                                   device="H100-80GB", trainer="grpo", use_vllm=True,
                                   vllm_mode="colocate", num_generations=8,
                                   max_completion_length=512),
        "1b grpo 4090": dict(model="Llama-3.2-1B", seq_len=256, target_batch_size=8,
                             device="RTX-4090", trainer="grpo", num_generations=4,
                             max_completion_length=256),
        "bad target": dict(model="gpt2", seq_len=256, target_batch_size=7, device="A100-80GB",
                           num_gpus=2),
    }


def _resolve(kwargs: dict) -> dict:
    out = dict(kwargs)
    if out.get("peft_config") == "lora":
        out["peft_config"] = _lora()
    if out.get("quantization_config") == "qlora":
        out["quantization_config"] = _qlora()
    if out.get("dtype") == "bfloat16":
        import torch

        out["dtype"] = torch.bfloat16
    return out


def _answer(fn) -> Any:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            out = fn()
        except Exception as exc:  # a refusal is an answer too
            out = {"error": f"{type(exc).__name__}: {exc}"}
    if isinstance(out, dict):
        out["warnings"] = sorted({str(w.message) for w in caught})
    return out


def _estimate(e: Any) -> dict:
    d = e.to_dict()
    d["explain"] = e.explain()
    return d


def _plan(p: Any) -> dict:
    d = p.to_dict(full=True)
    d["explain"] = p.explain()
    d["launch"] = p.launch_commands("train.py")
    d["accelerate_config"] = p.accelerate_config()
    d["candidate_labels"] = [(c.label(), c.reason) for c in p.candidates]
    return d


def _bench_cases() -> dict[str, Any]:
    import estimator_cpu
    import estimator_trl

    out = {}
    for c in estimator_cpu.CASES:
        out[f"cpu: {c['name']}"] = lambda c=c: _estimate(estimator_cpu.predict(c))
    for c in estimator_trl.CASES:
        out[f"trl: {c['name']}"] = lambda c=c: _estimate(estimator_trl.predict(c))
        out[f"trl as trainer: {c['name']}"] = \
            lambda c=c: _estimate(estimator_trl.predict(c, "trainer"))
    return out


def questions() -> dict[str, Any]:
    import hf_memkit as mk

    out = _bench_cases()
    for name, (args, kw) in estimate_questions().items():
        out[f"estimate: {name}"] = \
            lambda args=args, kw=kw: _estimate(mk.estimate_memory(*args, **_resolve(kw)))
    for name, kw in plan_questions().items():
        out[f"plan: {name}"] = lambda kw=kw: _plan(mk.plan_training(**kw))
    out["reverse: max_batch_size 8b h100"] = lambda: {"value": mk.max_batch_size(
        "Llama-3.1-8B", {"bf16": True, "gradient_checkpointing": True}, seq_len=2048,
        device="H100-80GB")}
    out["reverse: max_seq_len 1b 4090"] = lambda: {"value": mk.max_seq_len(
        "Llama-3.2-1B", {"bf16": True, "per_device_train_batch_size": 1}, device="RTX-4090")}
    out["reverse: max_seq_len 8b x8 split"] = lambda: {"value": mk.max_seq_len(
        "Llama-3.1-8B", {"bf16": True, "per_device_train_batch_size": 1,
                         "gradient_checkpointing": True}, device="H100-80GB", num_gpus=8,
        limit=1 << 19, multiple_of=4096)}
    return out


# readings of this machine that change from run to run (a CPU target's free RAM), not answers
VOLATILE = ("free_memory",)


def _first_difference(a: Any, b: Any, path: str = "") -> tuple[str, Any, Any] | None:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted((set(a) | set(b)) - set(VOLATILE), key=str):
            if k not in a or k not in b:
                return f"{path}.{k}", a.get(k, "<missing>"), b.get(k, "<missing>")
            found = _first_difference(a[k], b[k], f"{path}.{k}")
            if found:
                return found
        return None
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return f"{path}[len]", len(a), len(b)
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            found = _first_difference(x, y, f"{path}[{i}]")
            if found:
                return found
        return None
    return None if a == b else (path, a, b)


def compare(old: dict, new: dict) -> int:
    differ = 0
    for name in sorted(set(old) | set(new)):
        if name not in old or name not in new:
            print(f"{name}: only in {'new' if name in new else 'old'}")
            differ += 1
            continue
        found = _first_difference(old[name], new[name])
        if found:
            differ += 1
            path, a, b = found
            print(f"{name}: differs at {path}\n  old: {str(a)[:400]}\n  new: {str(b)[:400]}")
    print(f"{len(set(old) & set(new))} questions in both; {differ} differ")
    return 1 if differ else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="the JSON file to write")
    ap.add_argument("--compare", help="a snapshot of another tree to compare with")
    ap.add_argument("--only", help="ask only questions whose name contains this")
    add_flag(ap)
    a = ap.parse_args(argv)
    guard(a.quick, a.out, "--out")
    os.environ["HF_MEMKIT_CACHE"] = tempfile.mkdtemp(prefix="hfmk-snapshot-")
    import hf_memkit

    print(f"hf_memkit from {Path(hf_memkit.__file__).parent}", flush=True)
    answers = {}
    for name, fn in questions().items():
        if (a.only and a.only not in name) or (a.quick and not a.only and name not in QUICK):
            continue
        t0 = time.perf_counter()
        answers[name] = json.loads(json.dumps(_answer(fn), default=str))
        print(f"{time.perf_counter() - t0:6.1f} s  {name}"
              + ("  (raised)" if "error" in answers[name] else ""), flush=True)
    Path(a.out).write_text(json.dumps(answers, indent=1, sort_keys=True))
    if a.compare:
        return compare(json.loads(Path(a.compare).read_text()), answers)
    return 0


if __name__ == "__main__":
    sys.exit(main())
