"""Compare the estimator's CUDA predictions with published GPU measurements
(published_gpu_cases.yaml: docs/anchors.md), each against the figure it measures
(torch max_memory_allocated, max_memory_reserved, or NVML), reported separately per figure.

    python bench/estimator_gpu_anchors.py [--json PATH] [--only SUBSTR] [--no-fit] [--quick]

``--quick``: opt-350m's SDPA rows at batch 1 only (``QUICK``: both halves hold some), in seconds;
the bar is reported (``bar_met``), not gated: a quick run checks that the bench runs.

Exit status 0 only when the headline meets the bar (every holdout row, without reconstruction
terms, within 10%).

Usable cases
------------
* the ``sdpa_*`` rows (transformers model-doc SDPA training benchmarks, fxmarty's script: pure fp16
  weights, ``out = model(**inputs); out.logits.sum().backward()``, grads set to None, no
  optimizer; figure = max_memory_allocated in MB = 1e6 B), minus OOM-only rows and the two
  opt-350m sdpa rows flagged as copy errors: 63 allocated rows;
* ``hf_perf_bert_large_weights_loaded`` (NVML = context + fp32 weights placed in allocator
  segments);
* ``hf_perf_cuda_context_overhead`` (NVML) is listed but kept OUT of every statistic: its value
  defines the constant ``_cuda.CONTEXT_EAGER_LOADING``, so comparing against it is circular.
No usable anchor measures max_memory_reserved: the reserved group is empty (n = 0).
Everything else is listed with its reason for exclusion.

Fit / holdout
-------------
Every row, NVML included, goes to a half by ``_anchors.half_of``: CRC32 of the case id, even ->
fit, odd -> holdout. The fit set is (batch x seq):

* pythia-410m eager: 1x128 1x1024 2x128 4x256 4x512
* pythia-410m sdpa:  1x256 1x512 1x2048 2x256 2x512 2x1024 4x128 4x1024
* opt-350m eager:    1x256 1x512 1x2048 2x256 2x512 2x1024 4x128 4x1024 8x256 8x512 8x1024
* opt-350m sdpa:     1x128 1x1024 2x128 2x2048 4x256 4x512 8x128
* NVML: hf_perf_bert_large_weights_loaded (and the context row, which is out of the statistics)

so the fit half has 31 allocated + 2 NVML rows (one of them the context row) and the holdout
has 32 allocated rows and no NVML row. For every shape here, the eager and the sdpa row of one
model land in opposite halves (CRC32 is affine over GF(2) and the two ids differ in the same
place), so a holdout row's shape has always been seen in the fit half with the other kernel.

What is fitted, and what is not a holdout test:
* ``CudaCalibration.alloc_const`` is the one fitted constant (median residual of the fit half's
  allocated rows, with the reconstruction terms). It is 3.6 MiB against peaks of 1.5-34 GB; the
  bench prints what setting it to 0 changes.
* The reconstruction terms (``_anchors.sdpa_terms``: the script's retained ``out``, the GPT-NeoX
  4.4x branch, OPT's ``torch.max``) were DESIGNED by looking at the gap over ALL 63 rows, holdout
  included. The "with terms" figures are therefore not a holdout test of anything; only the
  "no terms" figures (the estimator's own trace + CUDA terms) are evidence, and the HOLDOUT half
  of those is the headline.
* ``rel_sigma`` for CUDA estimates (``_cuda.CudaCalibration.rel_sigma``) is the RMS of the FIT
  half's residuals relative to the part that is not model states (weights and gradients are
  exact), with the script's retained ``out`` (the workload) but no transformers-4.4x term;
  printed as "rel_sigma of the non-model-state part". The total-relative std of the no-terms
  rows is printed too.

The systematic gap (what we concluded, reading all 63 rows: hypotheses, not holdout-tested)
---------------------------------------------------------------------------------------------
Tracing transformers 5.23 code for pythia-410m fp16 sdpa bs1 s128 gives a peak of 1621.6 MB
(= weights 810.7 + grads 810.7, at the end of the backward) against 1789.95 MB published. Over
the 63 allocated rows the gap is neither constant nor proportional to the weights; it is
``const + k * (batch x seq)`` plus, for eager, a ``b * heads * s^2`` term:

* opt-350m sdpa: gap ~= 21 MB + 199 KB/token at every shape. 199 KB/token is exactly what the
  benchmark script keeps alive: ``out`` of the previous step lives until the new forward returns
  (and the current one through the backward): fp16 logits (2 V = 100.5 KB/token) and
  ``past_key_values`` (transformers 4.4x returns them in train mode since use_cache=True; fp16 k+v
  = 4 h L = 98.3 KB/token). Our trace (``loss="logits_sum"``) drops ``out`` before backward, as a
  Trainer would. The 21 MB are the two cuBLAS workspaces (2 x 8.125 MiB, ``cublas_workspace``,
  forward thread + autograd thread) plus ~4 MB (``alloc_const``: cuBLASLt workspace, rounding).
* opt-350m eager: an extra 2 B x b x heads x s^2 per layer: transformers 4.4x OPTAttention did
  ``torch.max(attn_weights + mask, finfo.min)``, which saves its fp16 input for backward.
  Transformers 5 no longer does.
* pythia-410m: const ~= 135 MB and ~540 KB/token. transformers 4.41-4.44 GPTNeoXAttention
  registered a causal-mask buffer of max_pos^2 bools per layer (24 x 4.19 MB = 100.7 MB: the
  constant), applied rotary with fp32 cos/sin caches so query/key became fp32, and returned
  present = (key fp32, value), value being a view that keeps the whole fused qkv output alive.
  Modelled: +6h per layer per token in the retained ``out`` and +4h (fp32 key) at the forward's
  end. About 4h/layer/token (~100 KB/token) remains unexplained for pythia sdpa at large batch x
  seq (predictions there are 5-7% low); we did not add a term for it.
* eager vs sdpa in the 5.23 trace: both already upcast the softmax to fp32 in eager, like 4.4x;
  the eager rows need no attention term beyond the OPT ``torch.max`` one.
So the gap is (a) the benchmark script holding outputs, (b) older model code, (c) cuBLAS
workspaces; not fragmentation (max_memory_allocated has none) and not fp32 accumulation buffers.
The anchors ran torch 2.2.1 (pythia, RTX 3080 Ti sm_86) and 2.4.0 (opt, L40S sm_89); both use the
pre-Hopper default CUBLAS_WORKSPACE_CONFIG ":4096:2:16:8".
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _anchors import DEFINES_CONSTANT, MODELS, exclusion, load_cases, predict  # noqa: E402
from _quick import add_flag, guard  # noqa: E402

from hf_memkit._cuda import runtime as _cuda  # noqa: E402

FIGURES = ("allocated", "reserved", "nvml")
QUICK = "sdpa_opt350m_sdpa_bs1_"
HALVES = ("fit", "holdout")


def fit(rows) -> _cuda.CudaCalibration:
    """alloc_const = median residual of the fit half's allocated rows (predicted with the
    reconstruction terms: the constant stands for what is left once the script's and the old
    code's tensors are accounted for)."""
    alloc = [r for r in rows if r.half == "fit" and r.figure == "allocated"]
    const = int(statistics.median(r.published - (r.predicted - r.detail["alloc_const"])
                                  for r in alloc)) if alloc else 0
    return dataclasses.replace(_cuda.CALIBRATION, alloc_const=max(0, const))


def counted(rows):
    """The rows that are evidence (the context row defines a constant: never counted)."""
    return [r for r in rows if r.id not in DEFINES_CONSTANT]


def stats(rows) -> dict:
    """n, median |err|, worst (signed) err, within-10% count, under-prediction count."""
    if not rows:
        return {"n": 0}
    errs = [r.err for r in rows]
    worst = max(errs, key=abs)
    return {"n": len(errs), "median_abs": statistics.median(abs(e) for e in errs),
            "worst": worst, "worst_id": rows[errs.index(worst)].id,
            "within_10": sum(abs(e) <= 0.10 for e in errs), "under": sum(e < 0 for e in errs)}


def fmt(st: dict) -> str:
    if not st["n"]:
        return "n=0 (no usable row)"
    return (f"n={st['n']:2d}  median |err| {st['median_abs'] * 100:5.1f}%  worst "
            f"{st['worst'] * 100:+6.1f}%  within 10%: {st['within_10']:2d}/{st['n']:<2d}  "
            f"under-predicted: {st['under']:2d}/{st['n']}")


VARIANTS = {
    "none": "WITHOUT reconstruction terms (the estimator's own account)",
    "script": "with the benchmark script's retained `out` only (fp16 logits + fp16 k/v, which "
              "transformers 5 would keep too), no transformers-4.4x term; designed on all rows",
    "all": "WITH all reconstruction terms (designed on all rows: not a holdout test)"}


def with_script_out(rows):
    """The no-terms rows plus the version-independent part of the script's retained ``out``."""
    return [dataclasses.replace(r, predicted=r.predicted + r.detail.get("script_out_base", 0))
            for r in rows]


def group_stats(by_variant) -> dict:
    """{variant: {figure: {half: stats}}} over the counted rows."""
    return {v: {f: {h: stats([r for r in counted(rows) if r.figure == f and r.half == h])
                    for h in HALVES} for f in FIGURES} for v, rows in by_variant.items()}


def rel_sigma(rows) -> dict:
    """Relative residuals of the FIT half's allocated rows without reconstruction terms."""
    rel = [r.err for r in counted(rows) if r.half == "fit" and r.figure == "allocated"
           and not r.reconstructed]
    if len(rel) < 2:
        return {"n": len(rel)}
    a = sorted(abs(e) for e in rel)
    return {"n": len(rel), "std": statistics.pstdev(rel), "mean": statistics.fmean(rel),
            "rms": statistics.fmean(e * e for e in rel) ** 0.5,
            "p95_abs": statistics.quantiles(a, n=20, method="inclusive")[-1]}


def nonstate_sigma(rows, half: str = "fit") -> dict:
    """RMS of (predicted - published) / (published - weights - gradients) over one half's
    allocated rows (fp16 weights and gradients: 4 B per parameter, exact from the parameter
    list; the uncertain part is the rest). Until issue #24 this was the CUDA band's one sigma;
    printed for comparison with the band built from each term."""
    from hf_memkit import profile_model

    states = {}
    rel = []
    for r in counted(rows):
        if r.half != half or r.figure != "allocated" or not r.id.startswith("sdpa_"):
            continue
        name = next(n for n in MODELS.values() if n.replace("-", "") in r.id)
        if name not in states:
            states[name] = 4 * profile_model(name).total_params
        rel.append((r.predicted - r.published) / (r.published - states[name]))
    if not rel:
        return {"n": 0}
    return {"n": len(rel), "rms": statistics.fmean(e * e for e in rel) ** 0.5, "worst": min(rel)}


def band_check(rows) -> dict:
    """Each allocated sdpa row against the estimate's band (issue #24): 2 sigma of the traced
    part (what is not fp16 weights and gradients), sigma = hypot(traced_cpu_sigma, CUDA's) of
    ``_cuda.CudaCalibration``, CUDA's being ``traced_cuda_sigma`` where the emulation acts (an
    SDPA kernel, or dropout in the model) and ``traced_cuda_floor_sigma`` where it does not (an
    eager fp16 model without dropout, no autocast), as ``_estimate.phases.emulation_acts``
    decides; per half: inside, and under-predicted beyond the band."""
    import torch

    from hf_memkit import estimate_memory, profile_model

    c = _cuda.CALIBRATION
    states, acts = {}, {}
    out = {h: {"n": 0, "inside": 0, "under_beyond": 0} for h in HALVES}
    for r in counted(rows):
        if r.figure != "allocated" or not r.id.startswith("sdpa_"):
            continue
        name = next(n for n in MODELS.values() if n.replace("-", "") in r.id)
        if name not in states:
            states[name] = 4 * profile_model(name).total_params
        attn = "eager" if "_eager_" in r.id else "sdpa"
        if (name, attn) not in acts:  # the estimator's own call, on a short step of the model
            e = estimate_memory(name, {}, seq_len=128, device="L40S", dtype=torch.float16,
                                attn_implementation=attn, stage="forward_backward")
            acts[name, attn] = not any("runs differently on CUDA" in n for n in e.notes)
        rel = math.hypot(c.traced_cpu_sigma, c.traced_cuda_sigma if acts[name, attn]
                         else c.traced_cuda_floor_sigma)
        margin = 2 * rel * max(0, r.predicted - states[name])
        o = out[r.half]
        o["n"] += 1
        o["inside"] += abs(r.predicted - r.published) <= margin
        o["under_beyond"] += r.published - r.predicted > margin
    return out


def print_rows(rows_t, rows_n, excluded) -> None:
    print(f"{'case':40s} {'figure':9s} {'half':7s} {'published':>10s} {'w/ terms':>10s} "
          f"{'err':>7s} {'no terms':>10s} {'err':>7s}")
    for t, n in zip(rows_t, rows_n, strict=True):
        mark = f"  (defines {DEFINES_CONSTANT[t.id]}: not counted)" if t.id in DEFINES_CONSTANT \
            else ""
        print(f"{t.id:40s} {t.figure:9s} {t.half:7s} {t.published / 1e6:8.1f}MB "
              f"{t.predicted / 1e6:8.1f}MB {t.err * 100:+6.1f}% {n.predicted / 1e6:8.1f}MB "
              f"{n.err * 100:+6.1f}%{mark}")
    print(f"\nexcluded ({len(excluded)}):")
    for cid, why in excluded:
        print(f"  {cid:55s} {why}")


def print_groups(groups, zero_groups) -> None:
    for v, label in VARIANTS.items():
        print(f"\n{label}:")
        for f in FIGURES:
            for h in HALVES:
                print(f"  {f:9s} {h:7s} {fmt(groups[v][f][h])}")
    print("\nalloc_const = 0 instead of the fitted value (the fitted constant's whole effect):")
    for v in zero_groups:
        for f in FIGURES:
            for h in HALVES:
                a, b = groups[v][f][h], zero_groups[v][f][h]
                if a["n"] and a != b:
                    print(f"  terms={v:6s} {f:9s} {h:7s} {fmt(b)}")
    print("  (groups not listed are unchanged)")


def kind_of(row) -> str:
    """model x attention kind of an sdpa_* row ("pythia410m eager"), else the figure."""
    parts = row.id.split("_")
    return f"{parts[1]} {parts[2]}" if row.id.startswith("sdpa_") else row.figure


def print_by_kind(rows, half: str = "holdout") -> dict:
    """Per model x attention kind, one half: median |err| and the signed range, per variant."""
    out = {}
    print(f"\n{half} half per model x attention kind (median |err|, min .. max err):")
    kinds = sorted({kind_of(r) for r in counted(rows["none"]) if r.half == half})
    for k in kinds:
        line = []
        for v in VARIANTS:
            e = [r.err for r in counted(rows[v]) if r.half == half and kind_of(r) == k]
            out.setdefault(v, {})[k] = {"n": len(e), "median_abs": statistics.median(map(abs, e)),
                                        "min": min(e), "max": max(e)}
            line.append(f"{v} {statistics.median(map(abs, e)) * 100:4.1f}% "
                        f"({min(e) * 100:+5.1f}..{max(e) * 100:+5.1f})")
        print(f"  {k:18s} n={len(e):2d}  " + "   ".join(line))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, help="write all rows and figures here")
    ap.add_argument("--only", help="only cases whose id contains this")
    ap.add_argument("--no-fit", action="store_true",
                    help="use the CudaCalibration in _cuda/runtime.py as is (no refit of alloc_const)")
    add_flag(ap)
    a = ap.parse_args(argv)
    guard(a.quick, a.json, "--json")
    a.only = a.only or (QUICK if a.quick else None)
    t0 = time.perf_counter()
    usable, excluded = [], []
    for c in load_cases():
        if a.only and a.only not in c["id"]:
            continue
        why = exclusion(c)
        (excluded.append((c["id"], why)) if why else usable.append(c))
    cal = _cuda.CALIBRATION if a.no_fit else fit([predict(c) for c in usable])
    cal0 = dataclasses.replace(cal, alloc_const=0)
    rows = {v: [predict(c, cal, reconstruct=v == "all") for c in usable] for v in ("none", "all")}
    rows["script"] = with_script_out(rows["none"])
    rows0 = {v: [predict(c, cal0, reconstruct=v == "all") for c in usable] for v in ("none", "all")}
    groups, zero_groups = group_stats(rows), group_stats(rows0)

    print_rows(rows["all"], rows["none"], excluded)
    print(f"\ncalibration ({'_cuda/runtime.py as is' if a.no_fit else 'alloc_const refit on the fit half'}"
          f"): alloc_const={cal.alloc_const} B ({cal.alloc_const / 2**20:.2f} MiB; _cuda/runtime.py has "
          f"{_cuda.CALIBRATION.alloc_const} B); fixed: cublas_workspace(sm_86/89)="
          f"{_cuda.cublas_workspace((8, 6))} B, CONTEXT_EAGER_LOADING="
          f"{_cuda.CONTEXT_EAGER_LOADING // 2**20} MiB")
    print_groups(groups, zero_groups)
    sig = rel_sigma(rows["none"])
    if sig["n"] >= 2:
        print(f"\nrel_sigma (fit half, no terms): {sig['std']:.4f}")
        print(f"  n={sig['n']} allocated rows; 95th percentile of |err| {sig['p95_abs']:.4f}; "
              f"mean err {sig['mean']:+.4f}, rms {sig['rms']:.4f} (a std around a biased mean "
              "understates the band when the mean is far from 0)")
    ns = {h: nonstate_sigma(rows["script"], h) for h in HALVES}
    if ns["fit"]["n"]:
        print(f"\nrel_sigma of the non-model-state part ('script' variant; the CUDA band's sigma "
              f"before issue #24): fit {ns['fit']['rms']:.3f} (n={ns['fit']['n']}), holdout "
              f"{ns['holdout']['rms']:.3f} (worst {ns['holdout']['worst']:+.3f})")
    bands = {v: band_check(rows[v]) for v in ("none", "script")}
    cal = _cuda.CALIBRATION
    print(f"\nthe band (issue #24: 2 sigma of the traced part, sigma = hypot("
          f"{cal.traced_cpu_sigma}, {cal.traced_cuda_sigma}), or hypot({cal.traced_cpu_sigma}, "
          f"{cal.traced_cuda_floor_sigma}) where the CUDA emulation does not act), allocated "
          "rows:")
    for v, b in bands.items():
        for h in HALVES:
            print(f"  {v:6s} {h:7s} n={b[h]['n']:2d}  inside the band {b[h]['inside']:2d}  "
                  f"under-predicted beyond it {b[h]['under_beyond']:2d}")
    by_kind = print_by_kind(rows)
    head = {f: groups["none"][f]["holdout"] for f in FIGURES}
    print("\nHEADLINE (holdout half, no reconstruction terms):")
    for f in FIGURES:
        print(f"  {f:9s} {fmt(head[f])}")
    print(f"({time.perf_counter() - t0:.0f} s)")
    if a.json:
        a.json.write_text(json.dumps({
            "rows": {v: [r.to_dict() for r in rs] for v, rs in rows.items()},
            "rows_alloc_const_0": {v: [r.to_dict() for r in rs] for v, rs in rows0.items()},
            "groups": groups, "groups_alloc_const_0": zero_groups,
            "variants": VARIANTS,
            "rel_sigma_fit_no_terms": sig, "headline_holdout_no_terms": head,
            "rel_sigma_nonstate_script": ns, "band": bands,
            "holdout_by_kind": by_kind,
            "excluded": [{"id": i, "reason": w} for i, w in excluded],
            "calibration": dataclasses.asdict(cal),
            "bar_met": all(st["n"] == st.get("within_10", 0) for st in head.values())},
            indent=1))
    met = all(st["n"] == st.get("within_10", 0) for st in head.values())
    print(f"bar (every holdout row within 10%): {'met' if met else 'MISSED'}"
          + (" (not gated under --quick)" if a.quick else ""))
    return 0 if met or a.quick else 1


if __name__ == "__main__":
    raise SystemExit(main())
