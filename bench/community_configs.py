"""hf_memkit's verdicts and plans for published single-GPU training setups (ran or OOM).

The setups (bench/community_configs.yaml) are ones people publish as having run on one GPU, and
a few published as running out of memory: source, exact setup, published memory, and what each
row assumes where the source is silent.

For every row:
  * ``mk.estimate_memory`` of that exact setup on the row's catalog GPU with the default
    headroom: the centre (``device_used``), ``upper`` (centre + margin), ``budget`` and the
    verdict ``fits``. Known-working rows the verdict refuses, and known-OOM rows it accepts, are
    the headline.
  * where the source publishes a figure: the estimate's figure of the same measure
    (allocated / active -> ``peak_allocated``, reserved -> ``peak_reserved``, NVML ->
    ``device_used``) and its relative error; rows published as the longest context that fits
    (``longest``): centre / card total.
  * the question a user of that setup would ask the planner: ``mk.plan_training`` for the same
    model, GPU and sequence length, the effective batch (micro-batch x accumulation) as
    ``target_batch_size``, and the row's method (a user who publishes QLoRA asks for a QLoRA
    plan; ``method="auto"`` would answer a different question), with the row's task, trainer
    and CUDA version. Reported: the chosen method, micro-batch x accumulation, optimizer,
    precision and techniques, or "no plan" with the planner's reason. Rows without an optimizer
    step (``stage: forward_backward``) have no plan question.

    python bench/community_configs.py [--json out.json] [--markdown out.md] [--only SUBSTR]
                                      [--no-plan] [--quick]

Exit status 0 only when the bar of issue #24 is met: at most 1 counted known-working row
refused and no known-OOM row accepted, and every row was estimated (a row the estimator cannot
express is reported, and fails the run). ``--quick``: two rows (one that ran, one published as
out of memory), in seconds; there the bar is reported, not gated (two rows are not the bar's). Progress goes to stderr; one process, the trace cache on
disk is reused across rows (and runs).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _quick import add_flag, guard  # noqa: E402

QUICK = ("hfdocs_bert_large_fp16_v100", "peft_bloomz_7b1_full_a100")
DATA = Path(__file__).resolve().with_name("community_configs.yaml")
UNITS = {"B": 1, "MB": 10**6, "MiB": 2**20, "GB": 10**9, "GiB": 2**30}
# the estimate's figure that a published measure corresponds to
MEASURE_FIELD = {"allocated": "peak_allocated", "active": "peak_allocated",
                 "reserved": "peak_reserved", "nvml": "device_used"}
TASK_TYPES = {"causal-lm": "CAUSAL_LM", "seq2seq-lm": "SEQ_2_SEQ_LM",
              "sequence-classification": "SEQ_CLS"}
GIB = 2**30


def load_rows(path: Path = DATA) -> list[dict[str, Any]]:
    with open(path) as f:
        return yaml.safe_load(f)


# ---------------------------------------------------------------------------------------------
# a row's setup -> estimate_memory / plan_training arguments
# ---------------------------------------------------------------------------------------------

def build_model(row: dict[str, Any]) -> Any:
    """A catalog name, or a config built from the row's published ``config.json`` values (or a
    catalog config with ``config_overrides``); nothing is downloaded."""
    from transformers import AutoConfig

    if "config" in row:
        values = dict(row["config"])
        return AutoConfig.for_model(values.pop("model_type"), **values)
    if row.get("config_overrides"):
        from hf_memkit._model.catalog import load_bundled_config

        config = load_bundled_config(row["model"])
        for key, value in row["config_overrides"].items():
            setattr(config, key, value)
        return config
    return row["model"]


def build_peft(row: dict[str, Any]) -> Any:
    if row["method"] == "full":
        return None
    from peft import LoraConfig

    lo = row["lora"]
    return LoraConfig(r=lo["r"], lora_alpha=lo["alpha"], lora_dropout=lo.get("dropout", 0.0),
                      target_modules=list(lo["target_modules"]),
                      task_type=TASK_TYPES[row["task"]])


def build_quant(row: dict[str, Any]) -> Any:
    if row["method"] != "qlora":
        return None
    import torch
    from transformers import BitsAndBytesConfig

    q = row["quantization"]
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=q["quant_type"],
                              bnb_4bit_compute_dtype=getattr(torch, q["compute_dtype"]),
                              bnb_4bit_use_double_quant=q["double_quant"])


def _dtype(row: dict[str, Any]) -> Any:
    import torch

    return getattr(torch, row["dtype"]) if row.get("dtype") else None


def with_trained_adapters(row: dict[str, Any], model: Any) -> Any:
    """The model as the row's trainer handed it to training, where the row says its trainer cast
    the adapters (``adapter_dtype``: TRL 0.7.10-0.8.x's ``peft_module_casting_to_bf16`` casts a
    4-bit model's LoRA layers to bf16): a peft model on the meta device with its adapters in
    that dtype, which ``estimate_memory`` reads from the model. Otherwise ``model`` itself."""
    if not row.get("adapter_dtype"):
        return model
    import peft
    import torch

    from hf_memkit._model.adapters import cast_adapters
    from hf_memkit._model.catalog import load_bundled_config
    from hf_memkit._model.tasks import auto_class

    config = model if not isinstance(model, str) else load_bundled_config(model)
    with torch.device("meta"):
        meta = auto_class(row["task"]).from_config(config, dtype=_dtype(row) or torch.float32)
        meta = peft.get_peft_model(meta, build_peft(row))
    cast_adapters(meta, getattr(torch, row["adapter_dtype"]))
    return meta


def estimate(row: dict[str, Any], model: Any) -> Any:
    import hf_memkit as mk

    return mk.estimate_memory(
        with_trained_adapters(row, model), dict(row["args"]), seq_len=row["seq_len"],
        device=row["gpu"],
        stage=row.get("stage", "train"), task=row["task"], target_len=row.get("target_len"),
        dtype=_dtype(row), attn_implementation=row.get("attn_implementation"),
        peft_config=build_peft(row), quantization_config=build_quant(row),
        cuda_version=row.get("cuda_version"), trainer=row.get("trainer"))


def effective_batch(row: dict[str, Any]) -> int:
    a = row["args"]
    return int(a.get("per_device_train_batch_size", 8)) * int(a.get("gradient_accumulation_steps", 1))


def plan(row: dict[str, Any], model: Any) -> dict[str, Any]:
    """The planner's answer to "plan <method> for this model on this GPU at this length and
    effective batch" (see the module docstring)."""
    import hf_memkit as mk

    if row.get("stage", "train") != "train":
        return {"status": "n/a", "text": "n/a (no optimizer step)"}
    trainer = row.get("trainer")
    try:
        p = mk.plan_training(model, seq_len=row["seq_len"], target_batch_size=effective_batch(row),
                             device=row["gpu"], method=row["method"], task=row["task"],
                             cuda_version=row.get("cuda_version"),
                             trainer=trainer if trainer != "trainer" else None)
    except mk.HfMemkitError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return {"status": "none", "text": f"no plan: {first[:160]}"}
    c = p.chosen
    techniques = [t for t in c.techniques if t != "activation_checkpointing"]
    text = (f"{c.method}, {c.precision}, {c.optim}, {c.micro_batch} x {c.grad_accum}"
            + (", checkpointing" if c.checkpointing else "")
            + "".join(f", {t}" for t in techniques))
    return {"status": "plan", "text": text, "method": c.method, "precision": c.precision,
            "optim": c.optim, "micro_batch": c.micro_batch, "grad_accum": c.grad_accum,
            "checkpointing": c.checkpointing, "techniques": list(c.techniques),
            "device_used": c.device_used}


# ---------------------------------------------------------------------------------------------
# one row's result
# ---------------------------------------------------------------------------------------------

@dataclass
class Result:
    id: str
    outcome: str
    gpu: str
    card: int
    counted: bool
    longest: bool
    device_used: int = 0
    required: int = 0
    upper: int = 0
    budget: int = 0
    fits: bool | None = None
    breakdown: dict[str, int] = field(default_factory=dict)
    margin: int = 0
    published: int | None = None
    measure: str | None = None
    measure_stated: bool = True
    estimated_measure: int | None = None
    error: str | None = None
    plan: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def verdict(self) -> str | None:
        """hf_memkit's verdict word (``MemoryEstimate.verdict``) from the three figures: fits
        (required + margin within the budget), tight (required within it), does not fit."""
        if self.fits is None or self.error:
            return None
        if self.required > self.budget:
            return "does not fit"
        return "fits" if self.upper <= self.budget else "tight"

    @property
    def correct(self) -> bool | None:
        """A run that ran is wrong only when called `does not fit`; an OOM only when `fits`
        (a `tight` OOM is listed with its margin)."""
        if self.verdict is None:
            return None
        return self.verdict != ("does not fit" if self.outcome == "ran" else "fits")

    @property
    def rel_err(self) -> float | None:
        if self.published is None or self.estimated_measure is None:
            return None
        return self.estimated_measure / self.published - 1

    @property
    def under_beyond_band(self) -> bool | None:
        """The published figure is above the estimate of that measure by more than the margin
        (the estimate's 2 sigma): an under-prediction the band does not cover."""
        if self.published is None or self.estimated_measure is None:
            return None
        return self.published - self.estimated_measure > self.margin

    @property
    def centre_over_card(self) -> float:
        return self.device_used / self.card if self.card else 0.0

    def why(self) -> str:
        """Which part of the fit test decides a refusal (or, for an OOM row, an acceptance)."""
        if self.fits is None:
            return ""
        frag = self.breakdown.get("fragmentation", 0)
        ctx = self.breakdown.get("context", 0)
        parts = f"frag {frag / GIB:.1f}, ctx {ctx / GIB:.1f}, margin {self.margin / GIB:.1f} GiB"
        if self.fits:
            return f"upper {self.upper / GIB:.1f} <= budget {self.budget / GIB:.1f} ({parts})"
        if self.device_used > self.card:
            return f"centre over the card ({parts})"
        need = f"needs {self.required / GIB:.2f} GiB with the cache freed"
        if self.required > self.card:
            return f"{need}: over the card ({parts})"
        if self.upper > self.card:
            return f"{need}, within the card; its margin takes it over the card ({parts})"
        return f"{need}; + margin within the card, over the budget: headroom ({parts})"


def run_row(row: dict[str, Any], do_plan: bool) -> Result:
    import hf_memkit as mk

    card = mk.get_device(row["gpu"]).total_memory
    r = Result(row["id"], row["outcome"], row["gpu"], card, row.get("counted", True),
               bool(row.get("longest")))
    pub = row.get("published")
    if pub:
        r.published = int(float(pub["value"]) * UNITS[pub["unit"]])
        r.measure, r.measure_stated = pub["measure"], pub.get("measure_stated", True)
    t0 = time.perf_counter()
    model = build_model(row)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            est = estimate(row, model)
        except Exception as exc:  # a row hf_memkit cannot express is reported, not fatal
            r.error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            r.seconds = time.perf_counter() - t0
            return r
        r.device_used, r.upper, r.budget, r.fits = est.device_used, est.upper, est.budget, est.fits
        r.required = est.required
        r.breakdown, r.margin = dict(est.breakdown), est.margin
        if r.measure:
            r.estimated_measure = getattr(est, MEASURE_FIELD[r.measure])
        if do_plan:
            r.plan = plan(row, model)
    r.seconds = time.perf_counter() - t0
    return r


# ---------------------------------------------------------------------------------------------
# summary and rendering (compute first, render separately)
# ---------------------------------------------------------------------------------------------

def summarize(results: list[Result]) -> dict[str, Any]:
    counted = [r for r in results if r.counted and r.error is None]
    ran = [r for r in counted if r.outcome == "ran"]
    oom = [r for r in counted if r.outcome == "oom"]
    refused = [r.id for r in ran if r.verdict == "does not fit"]
    accepted = [r.id for r in oom if r.verdict == "fits"]
    tight = {r.id: {"outcome": r.outcome, "margin": r.upper - r.required,
                    "within_budget_by": r.budget - r.required}
             for r in counted if r.verdict == "tight"}
    errs = [r.rel_err for r in counted if r.rel_err is not None]
    longest = [r for r in counted if r.longest]
    planned = [r for r in ran if r.plan.get("status") == "plan"]
    return {
        "ran": len(ran), "oom": len(oom), "refused": refused, "accepted": accepted,
        "tight": tight,
        "errors": [r.id for r in results if r.error],
        "not_counted": [r.id for r in results if not r.counted],
        "median_abs_err": statistics.median(abs(e) for e in errs) if errs else None,
        "n_err": len(errs), "worst_err": max(errs, key=abs) if errs else None,
        "longest": {r.id: r.centre_over_card for r in longest},
        "longest_within_10pct": sum(abs(r.centre_over_card - 1) <= 0.10 for r in longest),
        "under_beyond_band": [r.id for r in counted if r.under_beyond_band],
        "planned": len(planned), "no_plan": [r.id for r in ran if r.plan.get("status") == "none"],
        "bar_met": len(refused) <= 1 and not accepted,
    }


def _g(b: int | None) -> str:
    return "" if b is None else f"{b / GIB:.2f}"


def verdict_text(r: Result) -> str:
    if r.error:
        return "error"
    if r.verdict is None:
        return "?"
    word = r.verdict
    return word if r.correct else f"**{word}** ({'REFUSED' if r.outcome == 'ran' else 'ACCEPTED'})"


def markdown(results: list[Result], summary: dict[str, Any]) -> str:
    lines = ["| id | outcome | GPU | centre GiB | upper GiB | budget GiB | verdict | published "
             "| est. same measure | err | centre/card | plan (same method, GPU, seq, batch) |",
             "|---|---|---|---:|---:|---:|---|---|---:|---:|---:|---|"]
    for r in results:
        pub = ""
        if r.published is not None:
            pub = f"{r.published / GIB:.2f} GiB {r.measure}" + ("" if r.measure_stated else "*")
        err = "" if r.rel_err is None else f"{r.rel_err * 100:+.1f}%"
        ratio = f"{r.centre_over_card:.2f}" if r.longest and not r.error else ""
        rid = r.id + ("" if r.counted else " (not counted)") + (" [longest]" if r.longest else "")
        plan_text = r.error or r.plan.get("text", "")
        lines.append(f"| {rid} | {r.outcome} | {r.gpu} | {_g(r.device_used)} | {_g(r.upper)} | "
                     f"{_g(r.budget)} | {verdict_text(r)} | {pub} | {_g(r.estimated_measure)} | "
                     f"{err} | {ratio} | {plan_text} |")
    s = summary
    med = "n/a" if s["median_abs_err"] is None else f"{s['median_abs_err'] * 100:.1f}%"
    worst = "n/a" if s["worst_err"] is None else f"{s['worst_err'] * 100:+.1f}%"
    lines += [
        "",
        "`*` the source does not say which peak it shows (compared with peak_reserved).",
        "",
        f"- known-working called `does not fit`: {len(s['refused'])}/{s['ran']}"
        + (f" ({', '.join(s['refused'])})" if s["refused"] else ""),
        f"- known-OOM called `fits`: {len(s['accepted'])}/{s['oom']}"
        + (f" ({', '.join(s['accepted'])})" if s["accepted"] else ""),
        "- `tight` (the centre within the budget, its margin not): "
        + ("; ".join(f"{k} ({v['outcome']}): within the budget by "
                     f"{v['within_budget_by'] / GIB:.2f} GiB, margin {v['margin'] / GIB:.2f} GiB"
                     for k, v in s.get("tight", {}).items()) or "none"),
        f"- median |error| of the estimate's figure of the published measure: {med} over "
        f"{s['n_err']} rows (worst {worst}); published above the estimate by more than its "
        f"margin: {len(s['under_beyond_band'])}/{s['n_err']}"
        + (f" ({', '.join(s['under_beyond_band'])})" if s["under_beyond_band"] else ""),
        "- longest published context, centre / card: "
        + (", ".join(f"{k} {v:.2f}" for k, v in s["longest"].items()) or "none")
        + f" ({s['longest_within_10pct']}/{len(s['longest'])} within 10% of the card)",
        f"- planner: a plan for {s['planned']}/{s['ran']} known-working rows"
        + (f"; no plan for {', '.join(s['no_plan'])}" if s["no_plan"] else ""),
        f"- not counted: {', '.join(s['not_counted']) or 'none'}; errors: "
        f"{', '.join(s['errors']) or 'none'}",
        "- bar (<= 1 known-working called `does not fit`, no known OOM called `fits`): "
        f"{'met' if s['bar_met'] else 'MISSED'}",
    ]
    return "\n".join(lines)


def reasons(results: list[Result]) -> str:
    out = ["", "Why each wrong verdict falls where it does:"]
    for r in results:
        if r.correct is False:
            out.append(f"- {r.id}: centre {_g(r.device_used)} GiB, card {_g(r.card)} GiB; {r.why()}")
    return "\n".join(out) if len(out) > 2 else ""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write rows and summary as JSON here")
    ap.add_argument("--markdown", help="write the table (markdown) here as well")
    ap.add_argument("--only", help="run only rows whose id contains this")
    ap.add_argument("--no-plan", action="store_true", help="skip plan_training (faster)")
    ap.add_argument("--data", default=str(DATA), help="the rows (default: %(default)s)")
    ap.add_argument("--from-json", metavar="PATH",
                    help="render the table and summary of an earlier --json run (no estimates)")
    add_flag(ap)
    a = ap.parse_args(argv)
    guard(a.quick and not a.from_json, a.json, "--json")
    if a.markdown:
        guard(a.quick, a.markdown, "--markdown")
    if a.from_json:
        names = {f.name for f in fields(Result)}
        with open(a.from_json) as f:
            results = [Result(**{k: v for k, v in r.items() if k in names})
                       for r in json.load(f)["rows"]]
        print(markdown(results, summarize(results)) + reasons(results))
        return 0
    rows = [r for r in load_rows(Path(a.data)) if (not a.only or a.only in r["id"])
            and (not a.quick or a.only or r["id"] in QUICK)]
    if not rows:
        print(f"no row matches {a.only!r}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    results = []
    for i, row in enumerate(rows, 1):
        print(f"[{i}/{len(rows)}] {row['id']} ...", file=sys.stderr, flush=True)
        res = run_row(row, not a.no_plan)
        print(f"    {verdict_text(res)}, centre {_g(res.device_used)} GiB, {res.seconds:.1f} s"
              + (f", {res.error}" if res.error else ""), file=sys.stderr, flush=True)
        results.append(res)
    summary = summarize(results)
    table = markdown(results, summary) + reasons(results)
    total = time.perf_counter() - start
    print(table)
    print(f"\n{len(rows)} rows in {total:.0f} s")
    if a.markdown:
        Path(a.markdown).write_text(table + "\n")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": [dict(asdict(r), rel_err=r.rel_err, correct=r.correct)
                                for r in results],
                       "summary": summary, "seconds": total}, f, indent=1)
    if summary["errors"]:
        print(f"not estimated: {', '.join(summary['errors'])}", file=sys.stderr)
    return 0 if (summary["bar_met"] or a.quick) and not summary["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
