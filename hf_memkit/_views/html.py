"""Notebook views (``_repr_html_``) of estimates and plans: the setup, a breakdown bar and the
verdict, in inline HTML and CSS (no script, nothing external). Text rendering is ``_views.text``."""

from __future__ import annotations

import html
from typing import Any

from .._units import format_bytes
from .text import PHASE_WORDS, estimate_title, needs_text, plan_model_name, top_candidates, verdict

_BAR = (("weights", "#4e79a7"), ("gradients", "#f28e2b"), ("optimizer", "#e15759"),
        ("activations", "#76b7b2"), ("temporaries", "#59a14f"), ("fragmentation", "#edc948"),
        ("context", "#b07aa1"), ("optimizer_paged_resident", "#ff9da7"))  # in device_used
_MARGIN_CSS = "repeating-linear-gradient(45deg,#bab0ac 0 3px,#fff 3px 6px)"
_BADGE = {"fits": ("#d1fae5", "#065f46", "fits"), "tight": ("#fef3c7", "#92400e", "tight"),
          "does not fit": ("#fee2e2", "#991b1b", "does not fit"),
          "unknown": ("#fef3c7", "#92400e", "fit unknown")}


def _e(v: Any) -> str:
    return html.escape(str(v), quote=True)


def _badge(est) -> str:
    word, detail, _ = verdict(est)
    bg, fg, text = _BADGE[word]
    return (f'<span style="background:{bg};color:{fg};padding:1px 6px;border-radius:3px;'
            f'font-weight:600">{text}</span> <span style="color:#555">{_e(detail)}</span>')


def breakdown_bar_html(est) -> str:
    """A horizontal bar of device_used by term, the margin hatched, and the budget as a line."""
    margin = max(est.upper - est.required, 0)
    scale = max(est.upper, est.budget or 0, 1)
    segs, legend = [], []
    for key, color in _BAR:
        v = est.breakdown.get(key, 0)
        if v <= 0:
            continue
        tip = _e(f"{key} {format_bytes(v)}")
        segs.append(f'<div title="{tip}" style="width:{100 * v / scale:.3f}%;background:{color}">'
                    "</div>")
        legend.append(f'<span style="white-space:nowrap;margin-right:10px"><span style="display:'
                      f'inline-block;width:10px;height:10px;background:{color};margin-right:3px">'
                      f"</span>{tip}</span>")
    if margin:
        tip = _e(f"margin (2 sigma) {format_bytes(margin)}")
        segs.append(f'<div title="{tip}" style="width:{100 * margin / scale:.3f}%;background:'
                    f'{_MARGIN_CSS}"></div>')
        legend.append(f'<span style="white-space:nowrap;margin-right:10px"><span style="display:'
                      f'inline-block;width:10px;height:10px;background:{_MARGIN_CSS};'
                      f'margin-right:3px"></span>{tip}</span>')
    marker = ""
    if est.budget is not None:
        tip = _e(f"budget {format_bytes(est.budget)}")
        marker = (f'<div title="{tip}" style="position:absolute;top:-4px;bottom:-4px;left:calc('
                  f'{100 * est.budget / scale:.3f}% - 1px);border-left:2px solid #111"></div>')
        legend.append(f'<span style="white-space:nowrap">&#9474; {tip}</span>')
    return ('<div style="position:relative;display:flex;height:18px;margin:8px 0 4px 0;'
            'background:#f3f4f6;border:1px solid #d1d5db">' + "".join(segs) + marker + "</div>"
            f'<div style="font-size:11px;line-height:1.6">{"".join(legend)}</div>')


def _memory_line(est) -> str:
    budget = format_bytes(est.budget) if est.budget is not None else "no budget"
    at_least = "at least " if est.needs_at_least else ""
    return (f"needs {at_least}{format_bytes(est.required)} of {budget} (with its margin "
            f"{format_bytes(est.upper)}; device used {format_bytes(est.device_used)})")


def estimate_html(est) -> str:
    return ('<div style="font-family:system-ui,sans-serif;font-size:13px;max-width:760px">'
            f'<div style="font-weight:600">{_e(estimate_title(est))}</div>'
            f"<div>{_badge(est)}</div><div>{_e(_memory_line(est))}</div>"
            + breakdown_bar_html(est)
            + f'<div style="color:#555;font-size:11px">peak in: {_e(est.peak_phase)}'
            + (f" ({_e(PHASE_WORDS[est.peak_phase])})" if est.peak_phase in PHASE_WORDS else "")
            + "</div></div>")


def plan_html(plan) -> str:
    c = plan.chosen
    est = c.estimate
    rows = [("model", plan_model_name(plan)),
            ("device", f"{plan.device.name} x {plan.num_gpus}, budget {format_bytes(plan.budget)}"),
            ("batch", f"target {plan.target_batch_size} = micro-batch {c.micro_batch} x "
                      f"accumulation {c.grad_accum} x {plan.num_gpus} rank(s), seq_len "
                      f"{plan.seq_len}"),
            ("chosen", f"{c.label()}, attention {c.attn}")]
    cell = 'style="text-align:left;padding:1px 8px 1px 0;vertical-align:top"'
    head = "".join(f"<tr><th {cell}>{_e(k)}</th><td {cell}>{_e(v)}</td></tr>" for k, v in rows)
    body = "" if est is None else (f"<div>{_badge(est)} {_e(_memory_line(est))}</div>"
                                   + breakdown_bar_html(est))
    alts = "".join(
        f"<tr><td {cell}>{_e(x.label())}</td><td {cell}>{x.rel_time:.2f}x</td>"
        f"<td {cell}>{_e(needs_text(x))}</td>"
        f"<td {cell}>{_e('CHOSEN' if x.chosen else x.reason)}</td></tr>"
        for x in top_candidates(plan, 5))
    return ('<div style="font-family:system-ui,sans-serif;font-size:13px;max-width:760px">'
            '<div style="font-weight:600">hf-memkit plan</div>'
            f'<table style="border-collapse:collapse">{head}</table>{body}'
            '<details><summary style="cursor:pointer">setups considered (fastest first, '
            f'{len(plan.candidates)} in all)</summary><table style="border-collapse:collapse;'
            f'font-size:12px"><tr><th {cell}>setup</th><th {cell}>rel. time</th><th {cell}>'
            f"needs</th><th {cell}>verdict</th></tr>{alts}</table></details>"
            "<div style=\"color:#555;font-size:11px\">plan.explain() for the full text</div>"
            "</div>")
