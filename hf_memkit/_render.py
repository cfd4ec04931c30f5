"""Turning results into text for people (STYLE.md §4): rich tables, nothing computed here."""

from __future__ import annotations

from rich.table import Table

from ._device import DeviceInfo
from ._model import ModelProfile
from ._units import format_bytes


def device_table(dev: DeviceInfo, title: str = "Device") -> Table:
    t = Table(title=title, show_header=False)
    t.add_column("field", style="bold")
    t.add_column("value")
    cc = ".".join(map(str, dev.compute_capability)) if dev.compute_capability else "-"
    rows = [
        ("name", dev.name), ("kind", dev.kind), ("count", str(dev.count)),
        ("total memory", format_bytes(dev.total_memory)),
        ("free memory", format_bytes(dev.free_memory)),
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
    for k, v in rows:
        t.add_row(k, v)
    return t


def catalog_table(devices: list[DeviceInfo]) -> Table:
    t = Table(title="GPU catalog (hf-memkit devices)")
    for col in ("name", "memory", "cc", "bf16", "bf16 TFLOP/s", "fp32 TFLOP/s", "HBM GB/s",
                "interconnect"):
        t.add_column(col, no_wrap=col == "name")
    for d in devices:
        t.add_row(d.name, format_bytes(d.total_memory), "{}.{}".format(*d.compute_capability),
                  "yes" if d.supports_bf16 else "no", f"{d.peak_tflops['bf16'] or d.peak_tflops['fp16']:g}"
                  + ("" if d.peak_tflops["bf16"] else " (fp16)"),
                  f"{d.peak_tflops['fp32']:g}", f"{d.memory_bandwidth / 1e9:g}",
                  f"{d.interconnect} {d.interconnect_bandwidth / 1e9:g} GB/s")
    return t


def profile_table(p: ModelProfile) -> Table:
    t = Table(title=f"Model: {p.name}", show_header=False)
    t.add_column("field", style="bold")
    t.add_column("value")
    rows = [
        ("architecture", f"{p.architecture} ({p.model_type}, task {p.task})"),
        ("parameters", f"{p.total_params:,} ({p.trainable_params:,} trainable)"),
        ("weights", f"{format_bytes(p.param_bytes)} as " + ", ".join(
            f"{k}: {v:,}" for k, v in p.params_by_dtype.items())),
        ("layers / hidden / intermediate", f"{p.num_layers} / {p.hidden_size} / {p.intermediate_size}"),
        ("heads / kv heads / head dim",
         f"{p.num_attention_heads} / {p.num_key_value_heads} / {p.head_dim}"
         + (" (GQA)" if p.is_gqa else "")),
        ("vocab / max positions", f"{p.vocab_size} / {p.max_position_embeddings}"),
        ("tied embeddings", "yes" if p.tie_word_embeddings else "no"),
        ("gradient checkpointing", "supported" if p.supports_gradient_checkpointing else "not supported"),
        ("attention", ", ".join(p.attn_implementations) + f" (now: {p.attn_implementation})"),
    ]
    for k, v in rows:
        t.add_row(k, v)
    return t


def render_to_text(*renderables, width: int = 100) -> str:
    import io

    from rich.console import Console

    console = Console(width=width, record=True, file=io.StringIO())
    for r in renderables:
        console.print(r)
    return console.export_text()


def estimate_table(est) -> Table:
    s = est.setup
    amp = s.amp or "fp32"
    title = (f"{est.stage} step on {est.device.name}: micro-batch "
             f"{s.eval_batch if est.stage == 'eval' else s.micro_batch} x seq {est.seq_len}, "
             + (f"{amp}, no optimizer (forward + backward)" if est.stage == "forward_backward"
                else f"accumulation {s.grad_accum}, {amp}, optim {s.optim}")
             + (", checkpointing" if s.checkpointing else ""))
    t = Table(title=title)
    t.add_column("memory", style="bold")
    t.add_column("bytes", justify="right")
    t.add_column("share", justify="right")
    total = max(est.device_used, 1)
    for key in ("weights", "gradients", "optimizer", "activations", "temporaries"):
        v = est.breakdown.get(key, 0)
        t.add_row(key, format_bytes(v), f"{100 * v / total:.1f}%")
    t.add_row("= peak allocated", format_bytes(est.peak_allocated), "", style="cyan")
    t.add_row("fragmentation", format_bytes(est.breakdown.get("fragmentation", 0)), "")
    t.add_row("= peak reserved", format_bytes(est.peak_reserved), "", style="cyan")
    t.add_row("context", format_bytes(est.breakdown.get("context", 0)), "")
    if est.breakdown.get("optimizer_paged"):
        t.add_row("paged optimizer", format_bytes(est.breakdown["optimizer_paged"]), "")
    lo, hi = est.band
    t.add_row("= device used", format_bytes(est.device_used),
              f"{format_bytes(lo)} .. {format_bytes(hi)}", style="bold green")
    t.add_row("margin (2 sigma)", format_bytes(hi - est.device_used),
              f"{100 * (hi - est.device_used) / total:.1f}%")
    t.add_row("= must fit", format_bytes(hi), "", style="bold")
    t.caption = f"peak in: {est.peak_phase}" + "".join(f"\nnote: {n}" for n in est.notes)
    return t


def plan_tables(plan) -> list:
    """The tables ``Plan.explain()`` prints: summary, chosen setup's memory, alternatives."""
    c = plan.chosen
    head = Table(title="hf-memkit plan", show_header=False)
    head.add_column("field", style="bold")
    head.add_column("value")
    name = plan.model_name if isinstance(plan.model_name, str) else getattr(
        plan.model_name, "name_or_path", "") or type(plan.model_name).__name__
    rows = [
        ("device", f"{plan.device.name} x {plan.num_gpus} ({format_bytes(plan.device.total_memory)}"
                   f" each; budget {format_bytes(plan.budget)})"),
        ("model", str(name)),
        ("batch", f"target {plan.target_batch_size} = micro-batch {c.micro_batch} x accumulation "
                  f"{c.grad_accum} x {plan.num_gpus} rank(s), seq_len {plan.seq_len}"),
        ("chosen", c.label() + f", attention {c.attn}"),
        ("predicted memory", f"{format_bytes(c.device_used)} of {format_bytes(plan.budget)}"
                             + (" per GPU" if plan.num_gpus > 1 else "")),
    ]
    par = getattr(plan, "parallel", None) or {}
    if par:
        nodes = par.get("num_nodes", 1)
        rows.append(("engine", par.get("label", "") + (f" over {nodes} nodes" if nodes > 1 else "")))
        if c.estimate is not None and c.estimate.host_offloaded:
            rows.append(("host memory", f"{format_bytes(c.estimate.host_offloaded)} per rank "
                                        "offloaded to CPU RAM"))
        launch = plan.launch_commands()
        rows.append(("launch", launch["accelerate"]))
        rows.append(("or", launch["torchrun"]))
    for k, v in rows:
        head.add_row(k, v)
    out = [head]
    if c.estimate is not None:
        out.append(estimate_table(c.estimate))
    alt = Table(title="setups considered (fastest first)")
    for col in ("setup", "rel. time/sample", "device used", "verdict"):
        alt.add_column(col)
    ranked = sorted(plan.candidates, key=lambda x: (not x.chosen, x.estimate is None, x.rel_time))
    shown = [x for x in ranked if x.estimate is not None][:8]
    for x in shown:
        alt.add_row(x.label(), f"{x.rel_time:.2f}x", format_bytes(x.device_used),
                    "CHOSEN" if x.chosen else x.reason)
    rejected: dict[str, int] = {}
    for x in plan.candidates:
        if x.estimate is None:
            key = ("weights + gradients + optimizer state alone exceed the budget"
                   if "alone need" in x.reason else
                   "offload needs more host RAM per node than host_memory"
                   if x.reason.startswith("offload needs") else x.reason)
            rejected[key] = rejected.get(key, 0) + 1
    for reason, n in rejected.items():
        alt.add_row(f"{n} more setup(s)", "", "", reason)
    out.append(alt)
    if plan.notes:
        notes = Table(title="notes", show_header=False)
        notes.add_column("note")
        for n in plan.notes:
            notes.add_row(n)
        out.append(notes)
    return out
