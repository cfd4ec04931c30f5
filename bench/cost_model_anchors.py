"""The planner's cost model against published throughput (issue #4, item 2), as correlations
and ratio errors (order counts such as "eager slower than SDPA" are true of almost any model
and cannot fail).

1. transformers' SDPA training benchmark (anchors sdpa_*, docs/anchors.md: pythia-410m on a
   laptop RTX 3080 Ti, opt-350m on an L40S; pure fp16, forward+backward of logits.sum(), NO
   optimizer step, time per batch). Predicted with ``n_trainable=0``, which drops exactly the
   optimizer-step term of ``cost`` (full fine-tuning's FLOPs do not depend on it). Reported per
   model:
   * Spearman rho of predicted vs published time over all rows, and per attention kind;
   * predicted/published time per row (the absolute scale: min, median, max);
   * the eager/SDPA time ratio of each (batch, seq) pair: predicted ratio / published ratio - 1.
2. torchtune's Llama-3.2-3B "optimization flags" table and PEFT's MetaMathQA runs: pairs of rows
   that differ in one knob the cost model knows (checkpointing, 8-bit AdamW, QLoRA vs LoRA, LoRA
   vs full, LoRA rank): the ratio error of the predicted speed ratio (predicted / published - 1),
   and Spearman rho over the five speed ratios (n = 5: a weak statistic, shown for what it is).

    python bench/cost_model_anchors.py [--json PATH] [--quick]

``--quick`` changes nothing: the whole report is arithmetic and takes about a second.

A report: it has no pass/fail bar (the project states none for the cost model), exit status 0.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _quick import add_flag, guard  # noqa: E402

from hf_memkit import get_device  # noqa: E402
from hf_memkit._model import architecture_facts, load_bundled_config  # noqa: E402
from hf_memkit._plan import Candidate  # noqa: E402
from hf_memkit._plan.cost import Shape, cost  # noqa: E402

ANCHORS = Path(__file__).resolve().parents[2] / "shared" / "anchors" / "published_gpu_cases.yaml"
MODELS = {"EleutherAI/pythia-410m-deduped": ("pythia-410m", "RTX-3080Ti-Laptop-16GB"),
          "facebook/opt-350m": ("opt-350m", "L40S")}
N = {"pythia-410m": 405_334_016, "opt-350m": 331_196_416, "Llama-3.2-3B": 3_212_749_824}


def _ranks(v) -> list[float]:
    """Ranks 0..n-1, ties sharing their average rank (published times repeat: 0.037 s x 12)."""
    order = sorted(range(len(v)), key=lambda i: v[i])
    r = [0.0] * len(v)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
            j += 1
        for k in range(i, j + 1):
            r[order[k]] = (i + j) / 2
        i = j + 1
    return r


def spearman(xs, ys) -> float:
    """Spearman's rho: Pearson correlation of the (tie-averaged) ranks. scipy is not a dependency
    (scipy.stats.spearmanr gives the same value)."""
    rx, ry = _ranks(xs), _ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    num = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    den = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return num / den if den else float("nan")


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
    """{(model, attn, batch, seq): (published s, predicted s)} of the sdpa_* rows with a time."""
    # the two opt-350m SDPA rows flagged in the anchors as copy errors are left out
    bad = {"sdpa_opt350m_sdpa_bs4_s2048", "sdpa_opt350m_sdpa_bs8_s2048"}
    rows = [c for c in cases if c["id"].startswith("sdpa_") and c["id"] not in bad
            and (c.get("throughput") or {}).get("time_per_batch_s")]
    out = {}
    for c in rows:
        model, gpu = MODELS[c["model"]]
        t = c["throughput"]["time_per_batch_s"]
        p = predicted_time(model, gpu, batch=c["batch_size"], seq=c["seq_len"],
                           attn=c["attention_impl"], n_trainable=0)  # no optimizer step
        out[(model, c["attention_impl"], c["batch_size"], c["seq_len"])] = (t, p)
    return out


def _range(v) -> dict:
    return {"n": len(v), "min": min(v), "median": statistics.median(v), "max": max(v),
            "median_abs": statistics.median(abs(x) for x in v)}


def sdpa_report(rows) -> dict:
    """Per model: Spearman rho (all rows, per attention kind), predicted/published time per row,
    eager/SDPA ratio errors."""
    rep = {}
    for model in ("pythia-410m", "opt-350m"):
        mine = {k: v for k, v in rows.items() if k[0] == model}
        rho = {a: spearman([v[0] for k, v in mine.items() if a in ("all", k[1])],
                           [v[1] for k, v in mine.items() if a in ("all", k[1])])
               for a in ("all", "eager", "sdpa")}
        scale = [p / t for t, p in mine.values()]
        ratio_err = []
        for (_, attn, b, s), (te, pe) in mine.items():
            if attn == "eager" and (model, "sdpa", b, s) in mine:
                ts, ps = mine[(model, "sdpa", b, s)]
                ratio_err.append((pe / ps) / (te / ts) - 1)
        rep[model] = {"rows": len(mine), "spearman": rho, "pred_over_published": _range(scale),
                      "eager_sdpa_ratio_error": _range(ratio_err)}
        e, sc = rep[model]["eager_sdpa_ratio_error"], rep[model]["pred_over_published"]
        print(f"   {model}: Spearman rho over {len(mine)} rows {rho['all']:.3f} (eager "
              f"{rho['eager']:.3f}, sdpa {rho['sdpa']:.3f}); predicted/published time "
              f"{sc['min']:.2f} .. {sc['median']:.2f} .. {sc['max']:.2f}")
        print(f"      eager/SDPA time ratio, {e['n']} (batch, seq) pairs: ratio error median "
              f"|{e['median_abs'] * 100:.0f}%|, range {e['min'] * 100:+.0f}% .. "
              f"{e['max'] * 100:+.0f}%")
    return rep


def technique_pairs():
    """(name, published tokens/s of a, of b, predicted s/sample of a, of b)."""
    llama = dict(batch=2, seq=4096, precision="bf16")
    lora_qv = 2 * 28 * (64 * 3072 + 64 * 3072 + 64 * 3072 + 64 * 1024)  # r64 on q (3072) and v (1024)
    return [
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


def technique_report() -> dict:
    rows = []
    for name, tok_a, tok_b, t_a, t_b in technique_pairs():
        pub, pred = tok_a / tok_b, t_b / t_a          # speed of a relative to b
        rows.append({"pair": name, "published": pub, "predicted": pred, "ratio_error": pred / pub - 1})
        print(f"   {name}: published {pub:.2f}x, predicted {pred:.2f}x, ratio error "
              f"{(pred / pub - 1) * 100:+.0f}%")
    errs = [r["ratio_error"] for r in rows]
    rho = spearman([r["published"] for r in rows], [r["predicted"] for r in rows])
    print(f"   {len(rows)} pairs: ratio error median |{statistics.median(map(abs, errs)) * 100:.0f}%|, "
          f"worst {max(errs, key=abs) * 100:+.0f}%; Spearman rho of the speed ratios {rho:.2f} (n=5)")
    return {"pairs": rows, "ratio_error": _range(errs), "spearman": rho}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, help="write the figures here")
    add_flag(ap)
    a = ap.parse_args(argv)
    guard(a.quick, a.json, "--json")
    cases = yaml.safe_load(ANCHORS.read_text())
    print("1. SDPA training benchmark (time per batch, pure fp16 forward+backward, no optimizer)")
    sdpa = sdpa_report(sdpa_rows(cases))
    print("2. technique pairs (speed of the first setup relative to the second, one knob changed)")
    tech = technique_report()
    if a.json:
        a.json.write_text(json.dumps({"sdpa_benchmark": sdpa, "technique_pairs": tech}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
