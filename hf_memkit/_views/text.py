"""Turning results into text for people (docs/style.md §4): rich tables, nothing computed here."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from .._units import format_bytes

if TYPE_CHECKING:  # annotations only: rendering a catalog GPU needs neither torch nor transformers
    from .._device.probe import DeviceInfo

# -- tables that never cut a number ------------------------------------------------------------
# Every cell is plain Text (no rich markup: "hf-memkit[plot]" stays as written), numeric columns
# never wrap, and ``fit_columns`` gives each column a width itself: text columns wrap at spaces
# down to their longest word, and where even that does not fit the table is printed wider than
# the terminal rather than cutting a value ("140.…").


def _text(v: Any) -> Text:
    return v if isinstance(v, Text) else Text("" if v is None else str(v))


def new_table(title: str | None = None, *, show_header: bool = True, **kw: Any) -> Table:
    return Table(title=_text(title) if title else None, show_header=show_header, **kw)


def add_column(t: Table, header: str, *, numeric: bool = False, **kw: Any) -> None:
    """A column; ``numeric`` ones are right-aligned and never wrap (a number stays whole)."""
    kw.setdefault("justify", "right" if numeric else "left")
    t.add_column(header, no_wrap=numeric, overflow="fold", **kw)


def add_row(t: Table, *cells: Any, style: str | None = None) -> None:
    t.add_row(*(_text(c) for c in cells), style=style)


# A word longer than this in a text column (a path, a long label) may fold across lines (every
# character kept) rather than widen the table; numbers are far shorter and stay whole.
FOLD_WORDS_LONGER_THAN = 24


def _widths(col, cells: list) -> tuple[int, int]:
    """(natural, minimum) content width of a column: its longest line, and its longest line
    (no_wrap) or word (wrapping; at most ``FOLD_WORDS_LONGER_THAN``)."""
    lines = [ln for c in [col.header, *cells] for ln in _text(c).plain.splitlines() or [""]]
    natural = max((Text(ln).cell_len for ln in lines), default=1)
    if col.no_wrap:
        return natural, natural
    words = [w for ln in lines for w in ln.split()]
    longest = max((Text(w).cell_len for w in words), default=1)
    return natural, min(longest, FOLD_WORDS_LONGER_THAN)


def fit_columns(table: Table, width: int) -> int:
    """Give each column of ``table`` a width so that it fits ``width`` without cutting a word;
    returns the width the table needs (more than ``width`` when it cannot fit)."""
    cols = table.columns
    if not cols or any(not isinstance(c, (str, Text)) for col in cols for c in col._cells):
        return width
    for col in cols:
        col.width = None
    ranges = [_widths(col, list(col._cells)) for col in cols]
    natural = sum(n for n, _ in ranges)
    probe = Console(width=10**5, file=None)
    overhead = probe.measure(table).maximum - natural
    if natural + overhead <= width:
        return width
    # the widest columns give way first, none below its minimum: the largest cap that fits
    def widths_at(cap: int) -> list[int]:
        return [max(m, min(n, cap)) for n, m in ranges]

    cap = max(n for n, _ in ranges)
    while cap > 1 and sum(widths_at(cap)) + overhead > width:
        cap -= 1
    for col, w in zip(cols, widths_at(cap), strict=True):
        col.width = w
    return max(width, overhead + sum(col.width for col in cols))


def print_tables(console: Console, *renderables: Any) -> None:
    """Print to ``console``; a table that cannot fit its width without cutting a value is
    printed wider (the terminal wraps the line; nothing is lost)."""
    for r in renderables:
        need = fit_columns(r, console.width) if isinstance(r, Table) else console.width
        if need > console.width:
            old = console.width
            console.width = need
            try:
                console.print(r, crop=False)
            finally:
                console.width = old
        else:
            console.print(r)


def _field_table(title: str, rows: list[tuple[str, str]]) -> Table:
    t = new_table(title, show_header=False)
    add_column(t, "field", style="bold")
    add_column(t, "value")
    for k, v in rows:
        add_row(t, k, v)
    return t


def device_table(dev: DeviceInfo, title: str = "Device") -> Table:
    cc = ".".join(map(str, dev.compute_capability)) if dev.compute_capability else "-"
    rows = [
        ("name", dev.name), ("kind", dev.kind), ("count", str(dev.count)),
        ("total memory", format_bytes(dev.total_memory)),
        ("free memory", format_bytes(dev.free_memory)),
        *([("held by this process", format_bytes(dev.own_memory))]
          if dev.own_memory is not None else []),
        *([("held by other processes", format_bytes(dev.others_memory))]
          if dev.others_memory is not None else []),
        ("compute capability", cc),
        ("bf16 / tf32 / fp16 tensor cores",
         " / ".join("yes" if x else "no" for x in (dev.supports_bf16, dev.supports_tf32,
                                                   dev.supports_fp16_tensor_cores))),
        ("MIG slice", "yes" if dev.mig else "no"),
        ("source", dev.source + (f" (catalog: {dev.catalog_name})" if dev.catalog_name and
                                 dev.source != "catalog" else "")),
    ]
    if dev.peak_tflops:
        rows.append(("peak TFLOP/s fp32/tf32/fp16/bf16",
                     " / ".join(f"{dev.peak_tflops.get(k, 0):g}" for k in ("fp32", "tf32", "fp16",
                                                                           "bf16"))))
    if dev.memory_bandwidth:
        rows.append(("memory bandwidth", f"{dev.memory_bandwidth / 1e9:g} GB/s"))
    if dev.interconnect:
        rows.append(("interconnect", f"{dev.interconnect} {dev.interconnect_bandwidth / 1e9:g} GB/s"))
    return _field_table(title, rows)


def catalog_table(devices: list[DeviceInfo]) -> Table:
    """The catalog in 80 columns: light borders, units in the headers, no column of its own
    for bf16 support (a card without it shows its fp16 TFLOP/s, marked "fp16")."""
    from rich import box

    t = new_table("GPU catalog (hf-memkit devices)", box=box.SIMPLE_HEAD, show_edge=False,
                  pad_edge=False)
    t.caption = _text("TFLOP/s: dense peak; link: interconnect and its GB/s; cc: compute "
                      "capability (AMD: the gfx version ROCm's torch reports)")
    for col, numeric in (("name", False), ("memory", True), ("cc", True),
                         ("bf16\nTFLOP/s", True), ("fp32\nTFLOP/s", True), ("HBM\nGB/s", True),
                         ("link", False)):
        add_column(t, col, numeric=numeric)
    for d in devices:
        half = d.peak_tflops["bf16"] or d.peak_tflops["fp16"]
        add_row(t, d.name, format_bytes(d.total_memory), _cc(d),
                f"{half:g}" if d.peak_tflops["bf16"] else f"fp16 {half:g}",
                f"{d.peak_tflops['fp32']:g}", f"{d.memory_bandwidth / 1e9:g}",
                f"{d.interconnect} {d.interconnect_bandwidth / 1e9:g} GB/s"
                if d.interconnect_bandwidth else "-")
    return t


def _cc(d: DeviceInfo) -> str:
    """The compute capability (on ROCm the gfx major.minor torch reports); "mps" on Apple."""
    if d.compute_capability is None:
        return d.kind
    return "{}.{}".format(*d.compute_capability)


def render_to_text(*renderables, width: int = 100) -> str:
    import io

    console = Console(width=width, record=True, file=io.StringIO())
    print_tables(console, *renderables)
    return console.export_text()


BREAKDOWN_ROWS = ("weights", "gradients", "optimizer", "activations", "temporaries")
_LATE_PHASES = ("backward", "backward (accumulating)", "optimizer step")

# The breakdown is one instant, the step's peak: what is alive then, in that phase's terms.
PHASE_WORDS = {
    "forward": "the forward of a step's first micro-step: activations are being saved and no "
               "gradients exist yet (the backward creates them; each optimizer step frees them)",
    "forward (accumulating)": "a forward of a later micro-step: the gradients accumulated by "
                              "the earlier micro-steps are kept",
    "backward": "the backward of a step's first micro-step: it frees saved activations and "
                "creates gradients as it goes, so their split depends on where the peak falls",
    "backward (accumulating)": "a backward of a later micro-step: gradients accumulate into "
                               "those kept from the earlier micro-steps",
    "optimizer step": "the optimizer step: activations are freed; weights, gradients, optimizer "
                      "state and the optimizer's temporaries are alive",
    "eval forward": "an evaluation forward: no gradients and nothing saved for a backward",
    "generate (prefill)": "generation's prefill of the prompts (no grad), the KV cache "
                          "being filled",
    "generate (decode)": "generation's last decode step: the KV cache of prompt + "
                         "completion, the sampling's fp32 logits",
    "score": "scoring the completions without grad (old and reference log-probs)",
    "generate (vLLM)": "a colocated vLLM generating (awake) beside the trainer's weights and "
                       "optimizer state",
}


def _row_label(key: str, value: int, est) -> str:
    """A breakdown term, with why it is zero (or nearly) at this phase's peak."""
    phase, tiny = est.peak_phase, value < (1 << 20)
    if key == "gradients" and value == 0:
        return ("gradients (none in eval)" if est.stage == "eval" else
                "gradients (none alive yet)" if phase in ("forward", "backward") else key)
    if key == "optimizer" and value == 0 and est.stage == "forward_backward":
        return "optimizer (no optimizer step)"
    if key == "activations" and tiny and phase in _LATE_PHASES:
        return "activations (freed by then)"
    return key


def estimate_title(est) -> str:
    s = est.setup
    amp = est.precision
    return (f"{est.stage} step on {est.device.name}: micro-batch "
            f"{s.eval_batch if est.stage == 'eval' else s.micro_batch} x seq {est.seq_len}, "
            + (f"{amp}, no optimizer (forward + backward)" if est.stage == "forward_backward"
               else f"accumulation {s.grad_accum}, {amp}, optim {s.optim}")
            + (", checkpointing" if s.checkpointing else ""))


# What to do when a verdict is tight (fragmentation may push the step over: expandable segments
# let the allocator map freed pages into one growing segment, torch docs "Optimizing memory usage
# with PYTORCH_CUDA_ALLOC_CONF").
TIGHT_ADVICE = ("set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, or train one micro-batch "
                "less (with one more accumulation step)")


def verdict(est) -> tuple[str, str, str]:
    """(word, detail, rich style) of whether ``est`` fits its budget: ``MemoryEstimate.verdict``
    and what it means in bytes."""
    word = est.verdict
    if word == "unknown":
        return word, ("no budget to judge by (estimate_memory sets one)" if est.budget is None
                      else "only a lower bound on what the step needs"), "yellow"
    if est.refusals:
        return word, "the run cannot start: " + "; ".join(est.refusals), "bold red"
    if word == "fits":
        return word, f"{format_bytes(est.budget - est.upper)} to spare, margin included", \
            "bold green"
    if word == "tight":
        return word, (f"needs {format_bytes(est.required)}, within the budget by "
                      f"{format_bytes(est.budget - est.required)}; its margin "
                      f"({format_bytes(est.upper - est.required)}) is not: fragmentation may "
                      f"push it over; {TIGHT_ADVICE}"), "bold yellow"
    return word, (f"{_at_least(est)}{format_bytes(est.required - est.budget)} missing "
                  f"({format_bytes(est.upper - est.budget)} with its margin)"), "bold red"


# One line each on what the figures of ``explain()`` mean.
FIGURE_WORDS = {
    "needs": "the smallest memory the step runs in: the allocator frees its cached blocks and "
             "retries before an OOM (what the verdict judges)",
    "peak allocated": "live tensors at the peak (torch.cuda.max_memory_allocated)",
    "peak reserved": "what the caching allocator holds at the peak when nothing presses "
                     "(max_memory_reserved)",
    "device used": "what nvidia-smi shows for this process when nothing presses: reserved + "
                   "context",
    "margin": "2 sigma of the uncertain terms (docs/fitting.md)",
}


def estimate_table(est) -> Table:
    t = new_table(estimate_title(est), caption_justify="left")
    add_column(t, "memory at the peak", style="bold")
    add_column(t, "bytes", numeric=True)
    add_column(t, "what it is")
    word, detail, style = verdict(est)
    add_row(t, "needs", _at_least(est) + format_bytes(est.required), FIGURE_WORDS["needs"],
            style="bold")
    add_row(t, "budget", format_bytes(est.budget) if est.budget is not None else "-",
            est.budget_basis)
    add_row(t, "verdict", word, detail, style=style)
    total = max(est.device_used, 1)
    for key in BREAKDOWN_ROWS:
        v = est.breakdown.get(key, 0)
        add_row(t, _row_label(key, v, est), format_bytes(v), f"{100 * v / total:.1f}%")
    add_row(t, "= peak allocated", format_bytes(est.peak_allocated),
            FIGURE_WORDS["peak allocated"], style="cyan")
    add_row(t, "fragmentation", format_bytes(est.breakdown.get("fragmentation", 0)), "")
    add_row(t, "= peak reserved", format_bytes(est.peak_reserved),
            FIGURE_WORDS["peak reserved"], style="cyan")
    add_row(t, "context", format_bytes(est.breakdown.get("context", 0)), "")
    if "vllm" in est.breakdown:  # a colocated vLLM: outside torch's allocator, on the device
        add_row(t, "colocated vLLM", format_bytes(est.breakdown["vllm"]), "")
    paged = est.breakdown.get("optimizer_paged", 0)
    if paged:  # managed memory: only the pages the step needs at once count as device memory
        add_row(t, "paged optimizer, step pages",
                format_bytes(est.breakdown.get("optimizer_paged_resident", 0)), "")
    lo, hi = est.band
    add_row(t, "device used", format_bytes(est.device_used),
            f"{FIGURE_WORDS['device used']}; band {format_bytes(lo)} .. {format_bytes(hi)}"
            + ("; the device holds less, so the allocator frees cache as it goes"
               if est.peak_reserved + est.breakdown.get("context", 0) > est.device_used else ""))
    if any(k.startswith(("generate", "score")) for k in est.phase_peaks):
        for k, v in est.phase_peaks.items():   # an online-RL step's phases side by side
            add_row(t, f"  phase: {k}", format_bytes(v), "allocated at its peak")
    margin = est.upper - est.required
    add_row(t, "margin (2 sigma)", format_bytes(margin), FIGURE_WORDS["margin"])
    for term, share in sorted(est.margin_terms.items(), key=lambda kv: -kv[1]):
        if share:
            add_row(t, f"  · {term}", format_bytes(share),
                    f"{100 * share / max(margin, 1):.0f}% of the margin")
    add_row(t, "= needs + margin", format_bytes(est.upper), "fits when within the budget")
    if paged:
        add_row(t, "paged optimizer state", format_bytes(paged),
                "CUDA managed memory, outside device memory (paged to host when short)")
    t.caption = _text(f"peak in: {est.peak_phase}"
                      + (f" ({PHASE_WORDS[est.peak_phase]})" if est.peak_phase in PHASE_WORDS
                         else "") + "".join(f"\nnote: {n}" for n in est.notes))
    return t


def _fits_word(est) -> str:
    return "unknown" if est is None else est.verdict


def estimate_repr(est) -> str:
    """``repr(MemoryEstimate)``: one line, the numbers a person checks first."""
    parts = ", ".join(f"{k}: {format_bytes(v)}" for k, v in est.breakdown.items())
    budget = format_bytes(est.budget) if est.budget is not None else "None"
    return (f"MemoryEstimate({estimate_title(est)!r}, device_used="
            f"{format_bytes(est.device_used)}, required={format_bytes(est.required)}, "
            f"upper={format_bytes(est.upper)}, budget={budget}, "
            f"verdict={_fits_word(est)!r}, peak_phase={est.peak_phase!r}, breakdown={{{parts}}})")


def plan_model_name(plan) -> str:
    name = plan.model_name if isinstance(plan.model_name, str) else getattr(
        plan.model_name, "name_or_path", "") or type(plan.model_name).__name__
    return str(name)


def _at_least(est) -> str:
    return "at least " if est.needs_at_least else ""


def _predicted_memory(plan, c) -> str:
    """The plan's one memory figure (what the run needs) and its verdict."""
    est = c.estimate
    per = " per GPU" if plan.num_gpus > 1 else ""
    if est is None:  # a plan read back from its compact JSON
        return (f"device used {format_bytes(c.device_used)} of {format_bytes(plan.budget)}{per}: "
                + ("fits" if c.fits else "does not fit"))
    word, detail, _ = verdict(est)
    return (f"needs {_at_least(est)}{format_bytes(est.required)} of "
            f"{format_bytes(plan.budget)}{per}: {word} ({detail})")


def _engine_rows(plan, written: dict[str, str] | None) -> list[tuple[str, str]]:
    """The engine's own settings as the run receives them (``fsdp_config``, DeepSpeed's
    ``zero_optimization``), and the launch lines (naming the files ``written`` holds)."""
    import json

    ta = getattr(plan, "training_args_kwargs", None) or {}
    rows = [("fsdp_config", json.dumps(ta["fsdp_config"]))] if ta.get("fsdp_config") else []
    ds = ta.get("deepspeed")
    if isinstance(ds, dict) and ds.get("zero_optimization"):
        rows.append(("deepspeed", "zero_optimization " + json.dumps(ds["zero_optimization"])))
    if written:
        rows.append(("files", ", ".join(v for k, v in written.items() if k != "launch")))
        rows.append(("launch", written["launch"]))
    elif getattr(plan, "parallel", None):
        launch = plan.launch_commands()
        rows += [("launch", launch["accelerate"]), ("or", launch["torchrun"])]
    return rows


def plan_tables(plan, written: dict[str, str] | None = None) -> list:
    """The tables ``Plan.explain()`` prints: summary, chosen setup's memory, alternatives
    (``written``: the files ``hf-memkit plan --write-config`` wrote, which the launch line
    names)."""
    c = plan.chosen
    rows = [
        ("device", f"{plan.device.name} x {plan.num_gpus} ({format_bytes(plan.device.total_memory)}"
                   f" each; budget {format_bytes(plan.budget)})"),
        ("model", plan_model_name(plan)),
        ("batch", f"target {plan.target_batch_size} = micro-batch {c.micro_batch} x accumulation "
                  f"{c.grad_accum} x {plan.num_gpus} rank(s), seq_len {plan.seq_len}"),
        ("chosen", c.label() + f", attention {c.attn}"),
        ("predicted memory", _predicted_memory(plan, c)),
    ]
    par = getattr(plan, "parallel", None) or {}
    if par:
        nodes = par.get("num_nodes", 1)
        rows.append(("engine", par.get("label", "") + (f" over {nodes} nodes" if nodes > 1 else "")))
    if c.estimate is not None and c.estimate.host_offloaded:
        rows.append(("host memory", f"{format_bytes(c.estimate.host_offloaded)} "
                                    f"{'per rank ' if plan.num_gpus > 1 else ''}offloaded to "
                                    "CPU RAM (pinned: the machine needs it free)"))
    for k, v in plan.env.items():
        rows.append(("environment", f"{k}={v}"))
    rows += _engine_rows(plan, written)
    out = [_field_table("hf-memkit plan", rows)]
    if c.estimate is not None:
        out.append(estimate_table(c.estimate))
    if getattr(plan, "ladder", None):
        out.append(ladder_table(plan.ladder))
    alt = new_table("setups considered (fastest first)")
    add_column(alt, "setup")
    add_column(alt, "rel. time\nper sample", numeric=True)
    add_column(alt, "needs", numeric=True)
    add_column(alt, "verdict")
    for x in top_candidates(plan):
        add_row(alt, x.label(), f"{x.rel_time:.2f}x", needs_text(x),
                "CHOSEN" if x.chosen else x.reason)
    for reason, n in plan.rejected_summary().items():
        add_row(alt, f"{n} more setup(s)", "", "", reason)
    out.append(alt)
    if plan.notes:
        notes = new_table("notes", show_header=False)
        add_column(notes, "note")
        for n in plan.notes:
            add_row(notes, n)
        out.append(notes)
    return out


def ladder_table(ladder: list[dict]) -> Table:
    """What each rung of the chosen setup saved, from the setup without any of them up; the
    last row is the chosen setup itself."""
    t = new_table("what each rung saved (same micro-batch)")
    add_column(t, "rung")
    add_column(t, "must fit\nwith it", numeric=True)
    add_column(t, "saved", numeric=True)
    add_column(t, "host RAM", numeric=True)
    add_column(t, "time per\nsample", numeric=True)

    def size(v) -> str:
        return "n/a" if v is None else format_bytes(v)

    for r in ladder:
        saved = r.get("saved")
        host = r.get("host_offloaded")
        factor = r.get("time_factor")
        add_row(t, "+ " + r["rung"], size(r.get("must_fit", r.get("device_used"))),
                "n/a" if saved is None else format_bytes(saved) if saved >= 0 else
                f"costs {format_bytes(-saved)}",
                f"+{format_bytes(host)}" if host and host > 0 else
                f"-{format_bytes(-host)}" if host else "", f"x{factor:.2f}" if factor else "")
    return t


def needs_text(c) -> str:
    """A candidate's one memory figure: what its step needs (device used where only that was
    kept)."""
    est = c.estimate
    if est is None:
        return format_bytes(c.device_used)
    return ("≥ " if est.needs_at_least else "") + format_bytes(est.required)


def top_candidates(plan, n: int = 8) -> list:
    """The chosen setup, then the fastest estimated ones (a plan read back from the compact
    JSON keeps their numbers, not their full estimates)."""
    estimated = [x for x in plan.candidates if x.device_used is not None]
    return sorted(estimated, key=lambda x: (not x.chosen, x.rel_time or 0.0))[:n]


def plan_repr(plan) -> str:
    """``repr(Plan)``: the chosen setup and its verdict in one line (candidates only counted)."""
    name = plan_model_name(plan)
    if len(name) > 120:
        name = name[:60] + "..." + name[-57:]
    c = next((x for x in plan.candidates if x.chosen), None)
    est = c.estimate if c is not None else None
    mem = "" if est is None else (f", required={format_bytes(est.required)}, upper="
                                  f"{format_bytes(est.upper)}")
    fits = _fits_word(est) if est is not None else (
        "fits" if c is not None and c.fits else "does not fit")
    estimated = sum(x.device_used is not None for x in plan.candidates)
    return (f"Plan(model={name!r}, device='{plan.device.name} x {plan.num_gpus}', "
            f"chosen={c.label() if c else None!r}{mem}, budget={format_bytes(plan.budget)}, "
            f"verdict={fits!r}, candidates={len(plan.candidates)} ({estimated} estimated))")
