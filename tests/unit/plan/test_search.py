"""The planner's shortcuts never change its answer: lower bounds (model states, forward-only
probes of a group's smallest split and of any split whose forward likely misses) and the
smallest-micro-batch rejection pick the same setup as estimating every candidate exactly."""

from __future__ import annotations

import warnings

import pytest
from transformers import LlamaConfig

import hf_memkit as mk
from hf_memkit._estimate import TraceCache, estimate_for
from hf_memkit._model.spec import resolve_model
from hf_memkit._plan import PlanRequest, search_for
from hf_memkit._setup.setup import normalize_args
from hf_memkit._units import MiB
from tests.unit.plan.test_plan_training import SEQ, TARGET, TINY
from tests.unit.plan.test_plan_training import cpu as _cpu


def _exhaustive_choice(budget: int, device=None):
    """The fastest candidate whose exact estimate fits, in ladder order, without shortcuts:
    one with the user's optimizer (transformers' default) whenever any fits, pure bf16 only
    where no mixed-precision setup fits (it changes numerics, not speed)."""
    req = PlanRequest(TINY, SEQ, TARGET, device or _cpu(budget), max_memory=budget,
                      method="full")
    s, cands = search_for(req)
    for c in cands:
        s.price(c)
    # what must fit is what the step needs plus its margin (MemoryEstimate.upper)
    fitting = [c for c in cands if s.estimate(c).upper <= budget]
    own = [c for c in fitting if c.optim == "adamw_torch_fused"]
    return min(own or fitting, key=lambda c: (c.precision == "pure-bf16", c.rel_time)) \
        if fitting else None


@pytest.mark.parametrize("device,budget_mib", [
    *(("cpu", b) for b in (200, 60, 40, 30, 20, 14, 11, 9)),
    # a CUDA target: allocator replays, activation offloading (its probe stood in for by
    # checkpointing's), forward-only rejections of larger splits; budgets across its range
    *(("A100-80GB", b) for b in (1000, 1021, 1045)),
])
def test_plan_matches_an_exhaustive_exact_search(device, budget_mib):
    budget = budget_mib * MiB
    dev = _cpu(budget) if device == "cpu" else mk.get_device(device)
    best = _exhaustive_choice(budget, dev)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if best is None:
            with pytest.raises(mk.HfMemkitError, match="needs at least"):
                mk.plan_training(TINY, seq_len=SEQ, target_batch_size=TARGET,
                                 device=dev, max_memory=budget, method="full")
            return
        p = mk.plan_training(TINY, seq_len=SEQ, target_batch_size=TARGET, device=dev,
                             max_memory=budget, method="full")
    c = p.chosen
    assert (c.optim, c.micro_batch, c.techniques, c.precision) == (
        best.optim, best.micro_batch, best.techniques, best.precision)
    assert c.device_used <= budget
    # every rejected candidate was rejected on a bound that is really above the budget
    for r in p.candidates:
        if r.estimate is not None and not r.fits:
            assert r.estimate.upper > budget or "host RAM" in r.reason


@pytest.mark.parametrize("device,args", [
    ("cpu", {"per_device_train_batch_size": 4}),
    ("cpu", {"per_device_train_batch_size": 4, "activation_checkpointing": True}),
    ("cpu", {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 4,
             "optim": "adafactor"}),
    # the planner also rejects larger splits on their own forward (CUDA: allocator replay)
    ("A100-80GB", {"per_device_train_batch_size": 8, "gradient_accumulation_steps": 2,
                   "bf16": True, "activation_checkpointing": True}),
    ("A100-80GB", {"per_device_train_batch_size": 16, "bf16": True}),
    # pure bf16 (no fp32 masters) sharded by FSDP2, accumulating; 6 blocks, traced at 2 and 3
    # and extrapolated: the probe's accumulating forward is the real second micro-step's
    ("A100-80GB", {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 4,
                   "activation_checkpointing": True, "fsdp": "full_shard auto_wrap",
                   "fsdp_config": {"version": 2,
                                   "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]},
                   "layers": 6, "dtype": "bfloat16"}),
])
def test_forward_probe_bounds_the_step_from_below(device, args):
    args = dict(args)
    layers, dtype = args.pop("layers", None), args.pop("dtype", None)
    config = TINY if layers is None else LlamaConfig(**{**TINY.to_dict(),
                                                       "num_hidden_layers": layers})
    spec = resolve_model(config, **({"dtype": dtype} if dtype else {}))
    dev = mk.get_device(device)
    setup = normalize_args(args, num_gpus=2 if "fsdp" in args else None)
    cache = TraceCache()
    probe = estimate_for(spec, setup, dev, seq_len=SEQ, cache=cache, probe=True)
    exact = estimate_for(spec, setup, dev, seq_len=SEQ)
    assert probe.lower_bound and not exact.lower_bound
    assert probe.device_used <= exact.device_used and probe.upper <= exact.upper
    assert probe.peak_phase in ("forward", "forward (accumulating)", "optimizer step")
    # the second micro-step's forward is the first's with the first's gradients alive: the
    # probe, which traced the first forward alone, has it to the byte
    accumulating = "forward (accumulating)"
    assert (accumulating in probe.phase_peaks) == (setup.grad_accum > 1)
    if setup.grad_accum > 1:
        assert probe.phase_peaks[accumulating] == exact.phase_peaks[accumulating]
        assert probe.phase_peaks[accumulating] > probe.phase_peaks["forward"]
    # with the full trace cached, the probe is the exact estimate
    estimate_for(spec, setup, dev, seq_len=SEQ, cache=cache)
    again = estimate_for(spec, setup, dev, seq_len=SEQ, cache=cache, probe=True)
    assert not again.lower_bound and again.device_used == exact.device_used


def test_setups_sharing_a_trace_replay_their_own_parameters():
    """Pure bf16 and FSDP's bf16 gathers of fp32 master weights share one trace; the allocator
    replay of each runs its own gradients and optimizer step. Before, the replay was memoised
    without the parameters' sizes, and a plan that estimated the pure-bf16 setup first reported
    its fragmentation for the mixed-precision one (Llama-3.1-70B on 8 H100s: 6.1 GiB against the
    3.4 GiB ``estimate_memory`` gives the same setup)."""
    dev = mk.get_device("A100-80GB")
    fsdp = {"fsdp": "full_shard auto_wrap", "per_device_train_batch_size": 4, "optim": "sgd",
            "fsdp_config": {"version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}}
    pure_setup = normalize_args(fsdp, num_gpus=2)                 # a bf16 model, no AMP
    amp_setup = normalize_args({**fsdp, "bf16": True}, num_gpus=2)
    wider = LlamaConfig(**{**TINY.to_dict(), "hidden_size": 256, "intermediate_size": 688})
    pure, amp = resolve_model(wider, dtype="bfloat16"), resolve_model(wider)
    cache = TraceCache()
    first = estimate_for(pure, pure_setup, dev, seq_len=SEQ, cache=cache)
    shared = estimate_for(amp, amp_setup, dev, seq_len=SEQ, cache=cache)
    alone = estimate_for(amp, amp_setup, dev, seq_len=SEQ)
    assert len(cache) == 1                       # one trace for both
    (trace,) = cache._store.values()
    # SGD keeps no state: both setups' optimizer ratios are 0, so only the parameters tell
    # the two replays apart; each setup has its own
    assert len([k for k in trace.replayed if k != "events"]) == 2
    assert first.peak_reserved != alone.peak_reserved
    assert shared.breakdown["fragmentation"] == alone.breakdown["fragmentation"]
    assert (shared.peak_allocated, shared.peak_reserved, shared.device_used) == (
        alone.peak_allocated, alone.peak_reserved, alone.device_used)


def test_a_verdict_judged_against_a_budget_is_the_searched_ones(monkeypatch):
    """The planner judges a step whose fragmentation decides its verdict with one replay, at the
    most fragmentation that would still fit; ``estimate_memory`` searches the smallest capacity
    instead. For every budget across that range the two agree, and a step judged to miss says
    it needs at least what it was judged by (never more than the search finds)."""
    from hf_memkit._estimate import device

    judged_once = []
    most = device._most_fragmentation
    monkeypatch.setattr(device, "_most_fragmentation",
                        lambda *a: judged_once.append(1) or most(*a))
    wider = LlamaConfig(**{**TINY.to_dict(), "hidden_size": 256, "intermediate_size": 688})
    spec, dev = resolve_model(wider), mk.get_device("A100-80GB")
    setup = normalize_args({"per_device_train_batch_size": 8, "bf16": True})
    full = estimate_for(spec, setup, dev, seq_len=SEQ)
    assert full.breakdown["fragmentation"] > 0
    lo = full.upper - full.breakdown["fragmentation"]
    cache = TraceCache()
    for i in range(13):
        budget = lo + (full.device_used + full.margin - lo) * i // 12
        judged = estimate_for(spec, setup, dev, seq_len=SEQ, cache=cache, fit_budget=budget)
        assert (judged.upper <= budget) == (full.upper <= budget), budget
        if judged.required_at_least:  # judged to miss: bounded by what it was judged by
            assert judged.upper > budget and judged.required <= full.required
        else:                           # searched as estimate_memory searches
            assert judged.required == full.required
    assert judged_once  # some budgets were settled by the one replay


# a vocabulary-heavy model: its eval step at 2x the micro-batch holds more than the train step
VOCAB = LlamaConfig(**{**TINY.to_dict(), "vocab_size": 32000, "hidden_size": 64,
                       "intermediate_size": 128, "num_attention_heads": 4,
                       "num_key_value_heads": 2})


@pytest.mark.parametrize("model,seq,budget_mib", [(TINY, SEQ, 30), (TINY, SEQ, 14),
                                                  (VOCAB, 512, 450), (VOCAB, 512, 300)])
def test_the_planned_eval_batch_fits_where_it_was_not_traced(model, seq, budget_mib):
    """The eval batch is the largest power of two up to 4x the micro-batch whose eval fits, down
    to the micro-batch's own power of two, which is not traced (the eval step is the train
    step's forward and loss); searched from that floor up where the budget is tight over the
    train step, else from the top down. Independent eval estimates: the planned eval batch fits
    the budget, also where the search stopped at that floor (the vocabulary-heavy model at 450
    MiB: micro-batch 2, eval 2), and the next power of two up does not, whichever order found
    it."""
    budget = budget_mib * MiB
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p = mk.plan_training(model, seq_len=seq, target_batch_size=8, device=_cpu(budget),
                             max_memory=budget, method="full")
    kw = p.training_args_kwargs
    ev = mk.estimate_memory(model, kw, device=_cpu(budget), seq_len=seq, stage="eval")
    floor = 1 << kw["per_device_train_batch_size"].bit_length() - 1
    assert kw["per_device_eval_batch_size"] >= floor
    assert ev.upper <= budget, (kw, ev.upper, budget)
    up = 2 * kw["per_device_eval_batch_size"]
    if up <= 4 * kw["per_device_train_batch_size"]:
        above = mk.estimate_memory(model, {**kw, "per_device_eval_batch_size": up},
                                   device=_cpu(budget), seq_len=seq, stage="eval")
        assert above.upper > budget, (kw, above.upper, budget)
