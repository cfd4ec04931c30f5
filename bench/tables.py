"""Write the benchmark tables of the docs from the committed results files, so that no figure in
the docs is typed by hand.

    python bench/tables.py            # rewrite every generated table in place
    python bench/tables.py --check    # exit 1 when a doc's table differs from its results file

A generated table sits in a Markdown file between two markers::

    <!-- table: estimator-cpu -->
    ...
    <!-- /table -->

Each name in ``TABLES`` reads one committed file (``bench/results/...``) that its bench writes;
rerun the bench, then this script, and the docs follow. Exit status: 0, 1 for ``--check`` with a
stale table, 2 for a marker naming no table or a results file that is missing.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKER = re.compile(r"(<!-- table: (?P<name>[a-z0-9-]+) -->\n)(?P<body>.*?)(<!-- /table -->)",
                    re.S)
MiB = 2**20
GiB = 2**30


def _pct(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{100 * x:+.{digits}f}%"


def _abs_pct(x: float, digits: int = 2) -> str:
    return f"{100 * abs(x):.{digits}f}%"


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows]) + "\n"


def _worst(rows: list[dict[str, Any]]) -> dict[str, Any]:
    return max(rows, key=lambda r: abs(r["err"]))


def estimator_cpu(doc: dict[str, Any]) -> str:
    """``bench/estimator_cpu.py``: the summary, then every case."""
    rows, s = doc["rows"], doc["summary"]
    worst = _worst(rows)
    deep = [r for r in rows if r.get("extrapolated")]
    fused = [r for r in rows if "fused" in r["name"]]
    summary = [["hf_memkit `estimate_memory`", _abs_pct(s["median_abs_err"]),
                f"{_abs_pct(worst['err'])} ({worst['name']})"]]
    if fused:
        summary.append([f"the {len(fused)} `adamw_torch_fused` cases",
                        _abs_pct(statistics.median(abs(r["err"]) for r in fused)),
                        _abs_pct(_worst(fused)["err"])])
    if deep:
        summary.append([f"the {len(deep)} extrapolated (deeper than the full-trace limit)",
                        _abs_pct(statistics.median(abs(r["err"]) for r in deep)),
                        _abs_pct(_worst(deep)["err"])])
    summary += [["weights only (`accelerate estimate-memory`)",
                 _abs_pct(s["weights_only_median_abs_err"], 0), ""],
                ["18 bytes/param, nothing for activations",
                 _abs_pct(s["rule18_median_abs_err"], 0), ""]]
    skipped = doc.get("skipped") or []
    head = (f"{s['cases']} cases run, {len(skipped)} skipped"
            + (f" ({', '.join(str(k.get('name', k)) if isinstance(k, dict) else str(k) for k in skipped)})"
               if skipped else "") + _versions(doc) + ".\n\n")
    cases = [[r["name"], f"{r['measured'] / MiB:.1f}", f"{r['predicted'] / MiB:.1f}",
              _pct(r["err"]), r["phase"]] for r in rows]
    return (head + _table(["", "median abs error", "worst abs error"], summary) + "\n"
            + _table(["case", "measured MiB", "predicted MiB", "error", "peak phase"], cases))


def estimator_trl(doc: dict[str, Any]) -> str:
    """``bench/estimator_trl.py``: every case and the summary per trainer."""
    rows, s = doc["rows"], doc["summary"]
    cases = [[r["name"], r["trainer"], f"{r['measured'] / MiB:.1f}", f"{r['predicted'] / MiB:.1f}",
              _pct(r["err"]), r["phase"], _pct(r["plain_err"], 1)] for r in rows]
    per = [[k, _abs_pct(s[f"{k}_median_abs_err"]), _abs_pct(s[f"{k}_worst_abs_err"])]
           for k in ("sft", "dpo", "grpo", "rloo", "kto", "reward", "distillation") if f"{k}_median_abs_err" in s]
    per.append(["all", _abs_pct(s["median_abs_err"]), _abs_pct(s["worst_abs_err"])])
    return (f"{s['cases']} cases run{_versions(doc)}.\n\n"
            + _table(["case", "trainer", "measured MiB", "predicted MiB", "error", "peak phase",
                      "estimated as a plain Trainer"], cases) + "\n"
            + _table(["trainer", "median abs error", "worst abs error"], per))


def _versions(doc: dict[str, Any]) -> str:
    v = doc.get("versions") or doc.get("environment") or {}
    got = [f"{k} {v[k]}" for k in ("torch", "transformers", "trl") if v.get(k)]
    return f" ({', '.join(got)})" if got else ""


def _cell(m: dict[str, Any]) -> str:
    return f"{_pct(m['median'], 1)}, {_pct(m['worst'], 1)}, {m['within_10pct']}/{m['n']}"


def gpu_reestimate(doc: dict[str, Any]) -> str:
    """``bench/gpu_reestimate.py --json``: the estimate each run recorded on the GPU (for the
    holdout, the honest figure: made before any change it prompted) beside today's."""
    out = []
    for side in ("fit", "holdout"):
        if side not in doc:
            continue
        for metric in ("allocated", "reserved", "device_used"):
            then, now = doc[side]["then"][metric], doc[side]["now"][metric]
            label = "**holdout**" if side == "holdout" else "fit"
            out.append([f"{label}, {then['n']}", metric.replace("device_used", "device_used (NVML)"),
                        f"**{_cell(then)}**" if side == "holdout" else _cell(then),
                        _cell(now) + (" (a fit figure)" if side == "holdout" else "")])
    env = doc.get("reestimated_with") or {}
    note = (f"Re-estimated with torch {env['torch']}, transformers {env['transformers']}.\n\n"
            if env else "")
    return note + _table(
        ["runs", "metric", "estimated on the GPU when it ran: median, worst, within 10%",
         "re-estimated now: median, worst, within 10%"], out)


def fit_constants(_doc: Any) -> str:
    """``bench/fit_constants.py``: each constant fitted on the declared fit file."""
    import fit_constants as fc

    out = fc.compute()
    rows = []
    for name, c in out["constants"].items():
        fmt = (lambda v: f"{v / MiB:.0f} MiB") if name.isupper() else (lambda v: f"{v:.3f}")
        rows.append([f"`{name}`", fmt(c["fitted"]), fmt(c["held"]),
                     "yes" if c["agrees"] else "**no**"])
    return (f"Fit set: {', '.join(out['fit_files'])}.\n\n"
            + _table(["constant", "the rule gives", "held", "agrees"], rows))


def _spread(errs: list[float], bar: float) -> str:
    """``median |error| X, worst Y, k of n within the bar``."""
    a = [abs(e) for e in errs]
    return (f"Median abs error {_abs_pct(statistics.median(a))}, worst {_abs_pct(max(a))}, "
            f"{sum(e <= bar for e in a)} of {len(a)} within the {100 * bar:.0f}% bar.\n\n")


def parallel_cpu(doc: dict[str, Any]) -> str:
    """``bench/parallel_cpu.py --json``: each TP / SP run, its larger rank against the estimate."""
    rows = doc["rows"]
    cases = [[r["case"], r["mode"], str(r["seq_len"]), f"{r['measured'] / MiB:.1f}",
              f"{r['estimated'] / MiB:.1f}", _pct(r["error"])] for r in rows]
    missing = doc.get("missing") or []
    return (_spread([r["error"] for r in rows], 0.08)
            + (f"Not measured: {', '.join(missing)}.\n\n" if missing else "")
            + _table(["case", "mode", "seq", "measured MiB (larger rank)", "estimated MiB",
                      "error"], cases))


def parallel_published(doc: dict[str, Any]) -> str:
    """``bench/parallel_published.py --json``: each published run beside the estimate, and the
    plan for the million-token run."""
    rows = [[r["name"] + (f" (`{r['alloc_conf']}`)" if r.get("alloc_conf") else ""),
             f"{r['published_gb']} GB", f"{r['peak_allocated_gib']:.1f} GiB",
             f"{r['device_used_gib']:.1f} GiB", f"{r['ratio_if_gb']:.2f}", r["source"]]
            for r in doc["rows"]]
    ratios = [r["ratio_if_gb"] for r in doc["rows"]]
    out = (f"device_used / published GB: {min(ratios):.2f} to {max(ratios):.2f} over "
           f"{len(ratios)} runs; nothing fitted.\n\n"
           + _table(["run", "published", "allocated", "device_used",
                     "device_used / published GB", "source"], rows))
    if p := doc.get("plan"):
        out += (f"\nThe plan for a 1M-token SFT of Qwen3-8B on 8 x H100-80GB: {p['chosen']}; "
                f"{p['device_used_gib']:.1f} GiB per GPU, {p['upper_gib']:.1f} GiB with its "
                f"margin, of a {p['budget_gib']:.1f} GiB budget.\n")
    return out


def cost_model_anchors(doc: dict[str, Any]) -> str:
    """``bench/cost_model_anchors.py --json``: rank correlation and scale per model, and the ratio
    error of each technique pair."""
    rows = []
    for model, m in doc["sdpa_benchmark"].items():
        r, e = m["pred_over_published"], m["eager_sdpa_ratio_error"]
        rows.append([model, str(m["rows"]), f"{m['spearman']['all']:.3f}",
                     f"{r['min']:.2f} .. {r['median']:.2f} .. {r['max']:.2f}",
                     f"{_abs_pct(e['median_abs'], 0)} ({e['n']} pairs)"])
    t = doc["technique_pairs"]
    pairs = [[p["pair"], f"{p['published']:.2f}x", f"{p['predicted']:.2f}x",
              _pct(p["ratio_error"], 0)] for p in t["pairs"]]
    return (_table(["model", "rows", "Spearman rho", "predicted / published time: min .. median "
                    ".. max", "eager/SDPA ratio error, median abs"], rows) + "\n"
            + f"Technique pairs: ratio error median {_abs_pct(t['ratio_error']['median_abs'], 0)}, "
            f"worst {_pct(max(t['ratio_error']['min'], t['ratio_error']['max'], key=abs), 0)}; "
            f"Spearman rho of the speed ratios {t['spearman']:.2f} (n = {t['ratio_error']['n']}).\n\n"
            + _table(["pair (speed of the first relative to the second)", "published",
                      "predicted", "ratio error"], pairs))


def sharding_deepspeed(doc: dict[str, Any]) -> str:
    """``bench/sharding.py --json``, part 1: model states per GPU against DeepSpeed's estimators."""
    rows = doc["deepspeed"]
    cases = [[f"{r['size']} {r['model']}", str(r["gpus"]), r["setup"], f"{r['ours'] / GiB:.2f}",
              f"{r['deepspeed'] / GiB:.2f}",
              f"{r.get('deepspeed_allocates', r['deepspeed']) / GiB:.2f}", _pct(r["error"], 4)]
             for r in rows]
    return (_spread([r["error"] for r in rows], 0.05)
            + _table(["model", "GPUs", "setup", "hf_memkit GiB", "DeepSpeed's estimator GiB",
                      "DeepSpeed allocates GiB", "error"], cases))


def sharding_paper(doc: dict[str, Any]) -> str:
    """``bench/sharding.py --json``, part 2: bytes per parameter against the ZeRO paper."""
    rows = [[r["setup"], f"{r['paper_bytes_per_param']:.2f}", f"{r['ours_bytes_per_param']:.2f}",
             _pct(r["ours_bytes_per_param"] / r["paper_bytes_per_param"] - 1, 1)]
            for r in doc["paper"]]
    return _table(["setup", "paper (7.5B, 64 GPUs)", "hf_memkit (Llama-2-7b, 64 GPUs)",
                   "difference"], rows)


def sharding_runs(doc: dict[str, Any]) -> str:
    """``bench/sharding.py --json``, part 3: 2-rank CPU runs, the larger rank's peak."""
    rows = doc["runs"]
    cases = [[r["case"] + (" (against the full-shard estimate; not counted)" if r["offload"]
                           else ""), f"{r['measured'] / MiB:.1f}", f"{r['estimated'] / MiB:.1f}",
              _pct(r["error"])] for r in rows]
    return (_spread([r["error"] for r in rows if not r["offload"]], 0.08)
            + _table(["case", "measured MiB (larger rank)", "estimated MiB", "error"], cases))


def sharding_planner(doc: dict[str, Any]) -> str:
    """``bench/sharding.py --json``, part 4: the planner's choice per hardware."""
    rows = [[r["hardware"], r["engine"], r.get("chosen") or f"no plan: {r['error']}",
             f"{r['required'] / GiB:.1f} + {r['margin'] / GiB:.1f} GiB" if "required" in r else "-",
             f"{r['host_per_node'] / GiB:.0f} GiB" if r.get("host_per_node") else "-"]
            for r in doc["planner"]]
    return _table(["hardware", "engine, host RAM", "choice", "needs + margin per GPU",
                   "host RAM per node"], rows)


def community_configs(doc: dict[str, Any]) -> str:
    """``bench/community_configs.py --json``: the bar's counts, then every row linked to its
    source, with the verdict, the error of the published measure and the plan."""
    import community_configs as cc

    names = {f.name for f in dataclasses.fields(cc.Result)}
    results = [cc.Result(**{k: v for k, v in r.items() if k in names}) for r in doc["rows"]]
    s, urls = cc.summarize(results), {r["id"]: r["source"]["url"] for r in cc.load_rows()}
    longest = list(s["longest"].values())
    worst = "" if s["worst_err"] is None else f", worst {_pct(s['worst_err'], 1)}"
    med = "-" if s["median_abs_err"] is None else _abs_pct(s["median_abs_err"], 1)
    head = [f"Known-working setups called `does not fit`: {len(s['refused'])} / {s['ran']} "
            "(bar: at most 1); known OOMs called `fits`: "
            f"{len(s['accepted'])} / {s['oom']} (bar: none).",
            f"Median abs error of the estimate's figure of the published measure: {med} over "
            f"{s['n_err']} rows{worst}; published above the estimate by more than its margin: "
            f"{len(s['under_beyond_band'])} / {s['n_err']}.",
            f"Longest published context, centre / card: {min(longest):.2f} to {max(longest):.2f} "
            f"({s['longest_within_10pct']} / {len(longest)} within 10% of the card)."
            if longest else "",
            "`tight` (needs within the budget, its margin not): " + (", ".join(
                f"{k} ({v['outcome']}, margin {v['margin'] / GiB:.2f} GiB)"
                for k, v in s["tight"].items()) or "none") + ".",
            f"A plan for {s['planned']} / {s['ran']} known-working setups."]
    rows = []
    for r in results:
        pub = "" if r.published is None else (
            f"{r.published / GiB:.1f} GiB {r.measure}" + ("" if r.measure_stated else "*"))
        rows.append([f"[{r.id}]({urls[r.id]})" + (" [longest]" if r.longest else "")
                     + ("" if r.counted else " (not counted)"), r.gpu, r.outcome, pub,
                     f"{r.device_used / GiB:.1f} / {r.required / GiB:.1f} / "
                     f"{r.upper / GiB:.1f}", cc.verdict_text(r),
                     "" if r.rel_err is None else _pct(r.rel_err, 1),
                     r.error or r.plan.get("text", "")])
    return ("".join(f"- {h}\n" for h in head if h) + "\n"
            + _table(["row (source)", "GPU", "ran / OOM", "published",
                      "centre / needs / needs + margin GiB", "verdict", "error", "plan"], rows)
            + "\n`*` the source does not say which peak it shows (compared with "
            "`peak_reserved`).\n")


def allocator_sensitivity(doc: list[dict[str, Any]]) -> str:
    """``bench/allocator_sensitivity.py --json``: the allocator's share and how far it moves."""
    rows = [[r["case"], f"{r['share'] / GiB:.2f} GiB",
             f"{r['rms_order'] / GiB:.3f} GiB ({_abs_pct(r['rms_order'] / r['share'], 0)})",
             f"{r['rms_sizes'] / GiB:.3f} GiB ({_abs_pct(r['rms_sizes'] / r['share'], 0)})"]
            for r in doc if r["share"]]
    rel = [r["rms_sizes"] / r["share"] for r in doc if r["share"]]
    return (f"Sizes +-5%: RMS change / share, median {_abs_pct(statistics.median(rel), 0)}, "
            f"worst {_abs_pct(max(rel), 0)}.\n\n"
            + _table(["case", "allocator share at the fit", "free order shuffled: RMS change",
                      "sizes +-5%: RMS change"], rows))


ANCHOR_VARIANTS = {"none": "estimator as is (no reconstruction terms)",
                   "script": "+ the script's retained `out`",
                   "all": "+ every transformers-4.4x term (designed on all rows)"}


def estimator_gpu_anchors(doc: dict[str, Any]) -> str:
    """``bench/estimator_gpu_anchors.py --json``: the allocated rows per variant and half (the
    headline in bold), and how many fall inside the estimate's band."""
    rows, band_rows = [], []
    for v, label in ANCHOR_VARIANTS.items():
        for half in ("holdout", "fit"):
            st = doc["groups"][v]["allocated"][half]
            if not st["n"] or (v == "all" and half == "fit"):
                continue
            cells = [label, half, str(st["n"]), _abs_pct(st["median_abs"], 1),
                     _pct(st["worst"], 1), f"{st['within_10']}/{st['n']}",
                     f"{st['under']}/{st['n']}"]
            rows.append([f"**{c}**" for c in cells] if (v, half) == ("none", "holdout")
                        else cells)
            b = doc["band"].get(v, {}).get(half)
            if b and b["n"]:
                band_rows.append([label, half, str(b["n"]), str(b["inside"]),
                                  str(b["under_beyond"])])
    st = doc["groups_alloc_const_0"]["none"]["allocated"]["holdout"]
    if st["n"]:
        rows.insert(1, ["estimator as is, `alloc_const` = 0", "holdout", str(st["n"]),
                        _abs_pct(st["median_abs"], 1), _pct(st["worst"], 1),
                        f"{st['within_10']}/{st['n']}", f"{st['under']}/{st['n']}"])
    nvml = doc["groups"]["none"]["nvml"]
    note = ", ".join(f"{h} {nvml[h]['n']}" for h in ("fit", "holdout"))
    return (f"{len(doc['rows']['none'])} rows estimated, {len(doc['excluded'])} excluded "
            f"(reasons in the results file); counted NVML rows: {note}; `alloc_const` "
            f"{doc['calibration']['alloc_const'] / MiB:.1f} MiB. The bar (every holdout row of "
            f"the estimator as is within 10%) is {'met' if doc['bar_met'] else 'missed'}.\n\n"
            + _table(["max_memory_allocated rows", "half", "n", "median abs error", "worst",
                      "within 10%", "under-predicted"], rows) + "\n"
            + _table(["allocated rows against the estimate's band", "half", "n", "inside the band",
                      "under-predicted beyond it"], band_rows))


TABLES: dict[str, tuple[Path | None, Callable[[Any], str]]] = {
    "estimator-cpu": (RESULTS / "estimator_cpu.json", estimator_cpu),
    "estimator-trl": (RESULTS / "estimator_trl.json", estimator_trl),
    "gpu-reestimate": (RESULTS / "gpu" / "reestimate.json", gpu_reestimate),
    "fit-constants": (None, fit_constants),
    "parallel-cpu": (RESULTS / "parallel_cpu.json", parallel_cpu),
    "parallel-published": (RESULTS / "parallel_published.json", parallel_published),
    "cost-model-anchors": (RESULTS / "cost_model_anchors.json", cost_model_anchors),
    "sharding-deepspeed": (RESULTS / "sharding.json", sharding_deepspeed),
    "sharding-paper": (RESULTS / "sharding.json", sharding_paper),
    "sharding-runs": (RESULTS / "sharding.json", sharding_runs),
    "sharding-planner": (RESULTS / "sharding.json", sharding_planner),
    "estimator-gpu-anchors": (RESULTS / "estimator_gpu_anchors.json", estimator_gpu_anchors),
    "community-configs": (RESULTS / "community_configs.json", community_configs),
    "allocator-sensitivity": (RESULTS / "allocator_sensitivity.json", allocator_sensitivity),
}


def render(name: str) -> str:
    """The Markdown body of one generated table.

    Args:
        name: a key of ``TABLES``.

    Returns:
        The table (and its one-line heading), ending with a newline.

    Raises:
        KeyError: no such table.
        FileNotFoundError: its results file is missing.
    """
    path, fn = TABLES[name]
    doc = json.loads(path.read_text()) if path is not None else None
    rel = f"`{path.relative_to(ROOT)}`" if path is not None else "`bench/results/gpu` (FIT_SET)"
    return fn(doc) + f"\n(Generated by `python bench/tables.py` from {rel}.)\n"


def update(text: str) -> tuple[str, list[str]]:
    """``text`` with every generated table re-rendered, and the names it holds."""
    names: list[str] = []

    def one(m: re.Match[str]) -> str:
        names.append(m["name"])
        return m.group(1) + render(m["name"]) + m.group(4)

    return MARKER.sub(one, text), names


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true",
                    help="change nothing; exit 1 when a table differs from its results file")
    a = ap.parse_args(argv)
    stale, seen = [], set()
    for doc in DOCS:
        text = doc.read_text()
        try:
            new, names = update(text)
        except KeyError as e:
            print(f"{doc}: no table named {e}; known: {', '.join(TABLES)}", file=sys.stderr)
            return 2
        except FileNotFoundError as e:
            print(f"{doc}: results file missing: {e.filename}; run its bench", file=sys.stderr)
            return 2
        seen.update(names)
        if new != text:
            stale.append(str(doc.relative_to(ROOT)))
            if not a.check:
                doc.write_text(new)
    unused = sorted(set(TABLES) - seen)
    if unused:
        print(f"no doc shows: {', '.join(unused)}", file=sys.stderr)
    if stale:
        print(("stale (run `python bench/tables.py`): " if a.check else "rewrote: ")
              + ", ".join(stale))
    return 1 if (a.check and stale) or unused else 0


if __name__ == "__main__":
    sys.exit(main())
