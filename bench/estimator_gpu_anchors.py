"""Compare the estimator's CUDA predictions with published GPU measurements
(shared/anchors/published_gpu_cases.yaml), each against the figure it measures
(torch max_memory_allocated, max_memory_reserved, or NVML).

    python bench/estimator_gpu_anchors.py [--json PATH] [--only SUBSTR]

Usable cases
------------
* the ``sdpa_*`` rows (transformers model-doc SDPA training benchmarks, fxmarty's script: pure fp16
  weights, ``out = model(**inputs); out.logits.sum().backward()``, grads set to None, no
  optimizer; figure = max_memory_allocated in MB = 1e6 B), minus OOM-only rows and the two
  opt-350m sdpa rows flagged as copy errors;
* ``hf_perf_cuda_context_overhead`` (NVML, defines ``_cuda.CONTEXT_EAGER_LOADING``; fit half) and
  ``hf_perf_bert_large_weights_loaded`` (NVML = that context + fp32 weights placed in allocator
  segments; holdout).
Everything else is listed with its reason for exclusion.

Fit / holdout
-------------
Split by CRC32 of the case id (even: fit, odd: holdout): deterministic, and it mixes both models,
both attention kinds and all shapes into each half (the file order alternates eager/sdpa, so id
parity by position would not). Only ``CudaCalibration.alloc_const`` is fitted (median residual
of the fit half) and ``rel_sigma`` (std of the fit half's relative residuals); nothing is keyed on
model_type in ``_cuda.py``. No usable anchor measures max_memory_reserved or NVML during
training, so ``frag_ratio``, ``frag_const`` and ``context`` (lazy module loading) stay unfitted.

The systematic gap (what we concluded)
--------------------------------------
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
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _anchors import exclusion, load_cases, predict  # noqa: E402

from hf_memkit import _cuda  # noqa: E402


def fit(rows) -> _cuda.CudaCalibration:
    """alloc_const = median residual of the fit half's allocated rows; rel_sigma = std of the fit
    half's relative residuals after that."""
    alloc = [r for r in rows if r.half == "fit" and r.figure == "allocated"]
    const = int(statistics.median(r.published - (r.predicted - r.detail["alloc_const"])
                                  for r in alloc)) if alloc else 0
    cal = dataclasses.replace(_cuda.CALIBRATION, alloc_const=max(0, const))
    rel = [((r.predicted - r.detail["alloc_const"] + cal.alloc_const) - r.published) / r.published
           for r in alloc]
    rel_sigma = statistics.pstdev(rel) if len(rel) > 1 else cal.rel_sigma
    return dataclasses.replace(cal, rel_sigma=round(rel_sigma, 4))


def summarize(rows, half):
    errs = [abs(r.err) for r in rows if r.half == half]
    if not errs:
        return "n/a"
    return (f"{len(errs)} cases, median |err| {statistics.median(errs) * 100:.1f}%, worst "
            f"{max(errs) * 100:.1f}%, within 10%: {sum(e <= 0.10 for e in errs)}/{len(errs)}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--only", help="only cases whose id contains this")
    ap.add_argument("--no-fit", action="store_true",
                    help="use the CudaCalibration in _cuda.py as is (no refit)")
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    cases = load_cases()
    usable, excluded = [], []
    for c in cases:
        if a.only and a.only not in c["id"]:
            continue
        why = exclusion(c)
        (excluded.append((c["id"], why)) if why else usable.append(c))
    rows = [predict(c) for c in usable]
    cal = _cuda.CALIBRATION if a.no_fit else fit(rows)
    rows = [predict(c, cal) for c in usable]

    print(f"{'case':40s} {'figure':9s} {'published':>12s} {'predicted':>12s} {'err%':>7s}  half")
    for r in rows:
        print(f"{r.id:40s} {r.figure:9s} {r.published / 1e6:10.1f}MB {r.predicted / 1e6:10.1f}MB "
              f"{r.err * 100:+6.1f}%  {r.half}")
    print(f"\nexcluded ({len(excluded)}):")
    for cid, why in excluded:
        print(f"  {cid:55s} {why}")
    within = sum(abs(r.err) <= 0.10 for r in rows)
    print(f"\ncalibration ({'_cuda.py as is' if a.no_fit else 'refit on the fit half'}): alloc_const={cal.alloc_const} B ({cal.alloc_const / 2**20:.2f} MiB), "
          f"rel_sigma={cal.rel_sigma}; fixed: cublas_workspace(sm_86/89)="
          f"{_cuda.cublas_workspace((8, 6))} B, CONTEXT_EAGER_LOADING="
          f"{_cuda.CONTEXT_EAGER_LOADING // 2**20} MiB")
    print(f"fit half:     {summarize(rows, 'fit')}")
    print(f"holdout half: {summarize(rows, 'holdout')}")
    print(f"all usable:   {within}/{len(rows)} within 10%  ({time.perf_counter() - t0:.0f} s)")
    # Transparency: the sdpa_* rows ran transformers 4.4x model code; the terms that reconstruct
    # that old code (keyed on the architecture, in bench/_anchors.py) are not part of the
    # estimator. Show how far the estimator's own trace of transformers 5 code lands without them.
    raw = []
    for r in rows:
        if "old_code" in r.detail:
            legacy = r.detail["old_code"] + r.detail["old_code_static"]
            raw.append(abs((r.predicted - legacy - r.published) / r.published))
    if raw:
        print(f"without the transformers-4.4x reconstruction terms: {len(raw)} sdpa rows, median "
              f"|err| {statistics.median(raw) * 100:.1f}%, worst {max(raw) * 100:.1f}%, within "
              f"10%: {sum(e <= 0.10 for e in raw)}/{len(raw)}")
    if a.json:
        a.json.write_text(json.dumps({
            "rows": [r.to_dict() for r in rows],
            "excluded": [{"id": i, "reason": w} for i, w in excluded],
            "calibration": dataclasses.asdict(cal)}, indent=1))
    return 0 if within == len(rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
