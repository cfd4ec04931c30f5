"""The planner's cost model against published throughput (issue #4, item 2).

1. transformers' SDPA training benchmark (shared/anchors sdpa_*: pythia-410m on a laptop RTX 3080
   Ti, opt-350m on an L40S; pure fp16, forward+backward, time per batch): for every (batch, seq)
   measured with both kernels, does the cost model order eager vs SDPA like the measurement, and
   how well does it rank all rows of one model (Spearman rho of predicted vs published time)?
2. torchtune's Llama-3.2-3B "optimization flags" table and PEFT's MetaMathQA runs: pairs of rows
   that differ in one knob the cost model knows (checkpointing, 8-bit AdamW, QLoRA vs LoRA, LoRA
   vs full, LoRA rank): does the predicted order agree with the published tokens/s?

    python bench/cost_model_anchors.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

from hf_memkit import get_device
from hf_memkit._model import architecture_facts, load_bundled_config
from hf_memkit._plan import Candidate
from hf_memkit._plan.cost import Shape, cost

ANCHORS = Path(__file__).resolve().parents[2] / "shared" / "anchors" / "published_gpu_cases.yaml"
MODELS = {"EleutherAI/pythia-410m-deduped": ("pythia-410m", "RTX-3080Ti-Laptop-16GB"),
          "facebook/opt-350m": ("opt-350m", "L40S")}
N = {"pythia-410m": 405_334_016, "opt-350m": 331_196_416, "Llama-3.2-3B": 3_212_749_824}


def spearman(xs, ys) -> float:
    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        for rank, i in enumerate(order):
            r[i] = rank
        return r
    rx, ry = ranks(xs), ranks(ys)
    n = len(xs)
    return 1 - 6 * sum((a - b) ** 2 for a, b in zip(rx, ry, strict=True)) / (n * (n * n - 1))


def predicted_time(model: str, gpu: str, *, batch: int, seq: int, attn: str = "sdpa",
                   method: str = "full", precision: str = "fp16", optim: str = "adamw_torch_fused",
                   ckpt: bool = False, n_trainable: int | None = None, target: int = 1) -> float:
    f = architecture_facts(load_bundled_config(model))
    c = Candidate(method, precision, optim, ckpt, batch, 1, attn, 0.0)
    n = N[model]
    shape = Shape(n, f["num_layers"], f["hidden_size"], f["num_attention_heads"], seq,
                  max(target, batch))
    return batch * cost(c, shape, n_trainable=n if n_trainable is None else n_trainable,
                        dev=get_device(gpu))


def sdpa_rows(cases):
    # the two opt-350m SDPA rows flagged in the anchors as copy errors are left out
    bad = {"sdpa_opt350m_sdpa_bs4_s2048", "sdpa_opt350m_sdpa_bs8_s2048"}
    rows = [c for c in cases if c["id"].startswith("sdpa_") and c["id"] not in bad
            and (c.get("throughput") or {}).get("time_per_batch_s")]
    out = {}
    for c in rows:
        model, gpu = MODELS[c["model"]]
        t = c["throughput"]["time_per_batch_s"]
        p = predicted_time(model, gpu, batch=c["batch_size"], seq=c["seq_len"],
                           attn=c["attention_impl"])
        out[(model, c["attention_impl"], c["batch_size"], c["seq_len"])] = (t, p)
    return out


def main() -> int:
    cases = yaml.safe_load(ANCHORS.read_text())
    rows = sdpa_rows(cases)
    print("1. eager vs SDPA (time per batch, fp16 forward+backward)")
    agree = total = 0
    for model in ("pythia-410m", "opt-350m"):
        mine = {k: v for k, v in rows.items() if k[0] == model}
        rho = spearman([v[0] for v in mine.values()], [v[1] for v in mine.values()])
        pairs = [(k[2], k[3]) for k in mine if k[1] == "eager" and (model, "sdpa", k[2], k[3]) in mine]
        a = 0
        for b, s in pairs:
            te, pe = mine[(model, "eager", b, s)]
            ts, ps = mine[(model, "sdpa", b, s)]
            a += (te > ts) == (pe > ps)
        agree, total = agree + a, total + len(pairs)
        print(f"   {model}: Spearman rho over {len(mine)} rows = {rho:.3f}; eager-vs-SDPA order "
              f"agrees on {a}/{len(pairs)} (batch, seq) pairs")
    print("2. technique pairs (tokens/s, one knob changed)")
    llama = dict(batch=2, seq=4096, precision="bf16")
    lora_qv = 2 * 28 * (64 * 3072 + 64 * 3072 + 64 * 3072 + 64 * 1024)  # r64 on q (3072) and v (1024)
    pairs = [
        ("activation checkpointing on (torchtune act_ckpt vs chunked_ce)", 7210, 9174,
         predicted_time("Llama-3.2-3B", "A100-80GB", ckpt=True, **llama),
         predicted_time("Llama-3.2-3B", "A100-80GB", **llama)),
        ("8-bit AdamW vs AdamW (torchtune adamw8bit vs act_offload)", 6960, 7301,
         predicted_time("Llama-3.2-3B", "A100-80GB", optim="adamw_bnb_8bit", ckpt=True, **llama),
         predicted_time("Llama-3.2-3B", "A100-80GB", ckpt=True, **llama)),
        ("QLoRA vs LoRA (torchtune qlora vs lora)", 8035, 8210,
         predicted_time("Llama-3.2-3B", "A100-80GB", method="qlora", ckpt=True,
                        n_trainable=lora_qv, **llama),
         predicted_time("Llama-3.2-3B", "A100-80GB", method="lora", ckpt=True,
                        n_trainable=lora_qv, **llama)),
        ("LoRA r32 vs full fine-tuning (PEFT MetaMathQA)", 7299.5, 2327.9,
         predicted_time("Llama-3.2-3B", "L40S", method="lora", batch=4, seq=768,
                        precision="pure-bf16", n_trainable=lora_qv // 2),
         predicted_time("Llama-3.2-3B", "L40S", batch=4, seq=768, precision="pure-bf16")),
        ("LoRA r64 vs r32 (PEFT MetaMathQA)", 7121.8, 7299.5,
         predicted_time("Llama-3.2-3B", "L40S", method="lora", batch=4, seq=768,
                        precision="pure-bf16", n_trainable=lora_qv),
         predicted_time("Llama-3.2-3B", "L40S", method="lora", batch=4, seq=768,
                        precision="pure-bf16", n_trainable=lora_qv // 2)),
    ]
    ok_pairs = 0
    for name, tok_a, tok_b, t_a, t_b in pairs:
        published_faster = tok_a > tok_b
        predicted_faster = t_a < t_b
        ok = published_faster == predicted_faster
        ok_pairs += ok
        print(f"   {name}: published {tok_a / tok_b:.2f}x tokens/s, predicted {t_b / t_a:.2f}x "
              f"-> {'agrees' if ok else 'DISAGREES'}")
    print(f"rank agreement: eager/SDPA pairs {agree}/{total}, technique pairs {ok_pairs}/{len(pairs)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
