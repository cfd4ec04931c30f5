"""How much the caching allocator's share of a step moves when the traced stream is slightly
off: the source of ``_cuda.CudaCalibration.allocator_sigma`` (issue #24).

The replay (``_estimate.allocation``) runs the allocator's own algorithm on the traced event
stream, so its error is the stream's. Two perturbations, each replayed to the smallest capacity
at which the step completes (``_estimate.device.smallest_capacity``):

* the order of storages freed together (a graph released at once calls back in an order that
  varies between runs): every run of frees shuffled;
* the sizes: every activation-sized request (> 1 MiB, after the weights) scaled by a factor drawn
  uniformly from 1 +- 5%, independently (the CUDA emulation's sizes are not exact; real errors
  are systematic, so independent jitter overstates the scatter and is an upper estimate).

For each case it prints the allocator's share at the fit (smallest capacity - peak allocated)
and the RMS of its change over the perturbed replays, relative to that share.

    python bench/allocator_sensitivity.py [--seeds 5] [--json out.json] [--quick]

``--quick``: the smallest case only, 2 seeds per perturbation.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import warnings

import torch
from _quick import add_flag, guard
from peft import LoraConfig
from transformers import BitsAndBytesConfig, LlamaConfig

import hf_memkit as mk
from hf_memkit._cuda.events import ALLOC, FREE, MARK
from hf_memkit._estimate import device as dv

GiB = 2 ** 30
LORA = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM")
NF4 = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                         bnb_4bit_compute_dtype=torch.bfloat16)
CKPT = {"per_device_train_batch_size": 1, "bf16": True, "gradient_checkpointing": True}
SMALL = LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                    num_attention_heads=8, num_key_value_heads=8, vocab_size=32000,
                    max_position_embeddings=8192)
CASES = {
    "Llama-3.1-8B LoRA bf16, seq 2048, RTX 4090": (
        "meta-llama/Llama-3.1-8B", CKPT, 2048, "RTX-4090",
        {"dtype": torch.bfloat16, "peft_config": LORA}),
    "Llama-2-7B QLoRA, seq 16384, A100-40GB": (
        "meta-llama/Llama-2-7b-hf", CKPT, 16384, "A100-40GB",
        {"dtype": torch.bfloat16, "peft_config": LORA, "quantization_config": NF4}),
    "Llama-3.1-8B bf16 full, offload, seq 16384, H100": (
        "meta-llama/Llama-3.1-8B", {**CKPT, "gradient_checkpointing_kwargs": {"offload": True}},
        16384, "H100-80GB", {"dtype": torch.bfloat16}),
    "small Llama fp32+AMP, seq 8192, A100-80GB": (SMALL, CKPT, 8192, "A100-80GB", {}),
    "small Llama fp32+AMP, offload, seq 8192, A100-80GB": (
        SMALL, {**CKPT, "gradient_checkpointing_kwargs": {"offload": True}}, 8192, "A100-80GB",
        {}),
}


def _shuffled(events, rng):
    out, run = [], []
    for e in events:
        if e[0] == FREE:
            run.append(e)
            continue
        rng.shuffle(run)
        out.extend(run)
        run = []
        out.append(e)
    rng.shuffle(run)
    return out + run


def _jittered(events, rng, rel=0.05):
    out, body = [], False
    for op, h, n in events:
        body = body or op == MARK
        if op == ALLOC and body and n > 1 << 20:
            n = max(512, int(n * (1 + rng.uniform(-rel, rel))))
        out.append((op, h, n))
    return out


QUICK = ("small Llama fp32+AMP, seq 8192, A100-80GB",)


def main(argv: list[str] | None = None) -> int:
    """Run the cases; print the table and write ``--json``.

    Args:
        argv: the command line (default ``sys.argv[1:]``).

    Returns:
        The exit status: 0.
    """
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--json")
    add_flag(ap)
    a = ap.parse_args(argv)
    guard(a.quick, a.json, "--json")
    real_fit = dv.allocator_fit
    try:
        return _run(a, real_fit)
    finally:
        dv.allocator_fit = real_fit  # the spy goes: an in-process caller keeps the real one


def _run(a: argparse.Namespace, real_fit) -> int:
    seen = {}
    seeds = min(a.seeds, 2) if a.quick else a.seeds

    def spy(ex, spec, om, ws, stage, micro_steps=1, *rest, **kw):  # allocator_fit's arguments
        seen["args"] = (ex, spec, om, ws, stage, micro_steps)
        return real_fit(ex, spec, om, ws, stage, micro_steps, *rest, **kw)

    dv.allocator_fit = spy
    rows = []
    print("| case | allocator share at the fit | free order: RMS change | sizes +-5%: RMS "
          "change |\n|---|---|---|---|")
    for name, (model, args, seq, dev, kw) in CASES.items():
        if a.quick and name not in QUICK:
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mk.estimate_memory(model, args, seq_len=seq, device=dev, cuda_version="12.8", **kw)
        ex, spec, om, ws, stage, ms = seen["args"]
        events, how = ex.replayed["events"]
        params = tuple(p.nbytes for p in spec.states()[1]) if how != "traced" else \
            max(ex.replays, key=lambda r: r[0])[2]
        trainable = sum(params) or 1
        kw2 = dict(state_ratio=om.state / trainable, transient_ratio=om.transient / trainable,
                   workspaces=ws, optimizer=True, micro_steps=ms)

        def share(ev, params=params, kw2=kw2):
            s = dv.replay_step(ev, params, **kw2)
            return dv.smallest_capacity(ev, params, s.peak_allocated, s.peak_reserved,
                                        **kw2) - s.peak_allocated

        base = share(events)
        rms = {}
        for label, perturb in (("order", _shuffled), ("sizes", _jittered)):
            d = [share(perturb(events, random.Random(seed))) - base for seed in range(seeds)]
            rms[label] = math.sqrt(sum(x * x for x in d) / len(d))
        rows.append({"case": name, "share": base, **{f"rms_{k}": v for k, v in rms.items()}})
        rel = {k: v / base if base else 0.0 for k, v in rms.items()}
        print(f"| {name} | {base / GiB:.2f} GiB | {rms['order'] / GiB:.3f} GiB "
              f"({rel['order']:.0%}) | {rms['sizes'] / GiB:.3f} GiB ({rel['sizes']:.0%}) |",
              flush=True)
    rels = [r["rms_sizes"] / r["share"] for r in rows if r["share"]]
    print(f"\nsizes +-5%: RMS change / share: median {sorted(rels)[len(rels) // 2]:.0%}, "
          f"max {max(rels):.0%}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
