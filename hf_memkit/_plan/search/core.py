"""Find the fastest candidate that fits: price every candidate, reject what cannot fit on cheap
lower bounds (model states alone; a step's forward alone, traced without its backward, which for
an accumulating step also bounds its second micro-step's forward, the first's with the gradients
alive), and trace exactly before accepting.

Candidates are estimated in the order of ``Search.passes``: each method's setups without offload
(the ladder), then, with ``method="auto"`` and no ``host_memory``, offload after them all; within
a pass, by predicted speed, and a pass stops at its fastest fit. A setup that misses by the
allocator's fragmentation is tried with expandable segments before the next (``edges``). Pure bf16
changes numerics (no fp32 master weights), not speed: within a method and tier it is tried only
after every mixed-precision setup, so checkpointing and checkpoint offload come before it.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field
from typing import NoReturn

from ..._errors import HfMemkitError
from ..._estimate import MemoryEstimate, TraceCache, estimate_for
from ..._estimate.phases import states_for, trained_spec
from ..._estimate.progress import report
from ..._methods import Method
from ..._setup.setup import TrainingSetup, normalize_args
from ..._techniques import TECHNIQUES
from ..._trainers.packing import with_lengths
from ..._units import format_bytes
from ..cost import Shape, cost
from ..emit import ArgsContext, training_args
from ..request import PlanRequest
from ..space import Candidate, SpecBook, rung_of, user_optimizer
from .edges import allocator_of, expandable, host_short, order, say_offload, tightest


def _at_forward(rs) -> int:
    """What the forward holds before any activation (``phases._train_phases``' forward less
    its traced excess): resident states but gradients (freed by the previous step's
    ``zero_grad``, unless one resident buffer), and the unsharded parameters gathered for it."""
    return (rs.weights + rs.optimizer + rs.buckets + rs.gathered_forward
            + (rs.gradients if rs.resident_gradients else 0))



def _group(c: Candidate) -> tuple:
    """What a candidate is apart from its micro-batch split."""
    return (c.method, c.precision, c.optim, c.techniques, c.parallel, c.attn)


@dataclass
class Search:
    req: PlanRequest
    book: SpecBook
    ctx: ArgsContext
    shape: Shape
    methods: list[Method]
    budget: int
    host_budget: int | None
    notes: list[str] = field(default_factory=list)
    cache: TraceCache = field(default_factory=TraceCache)
    _setups: dict[tuple, TrainingSetup] = field(default_factory=dict)
    _smallest: dict[tuple, Candidate] = field(default_factory=dict)
    _second: dict[tuple, Candidate] = field(default_factory=dict)  # the next split up
    _states: dict[tuple, tuple] = field(default_factory=dict)
    _priced: set[str] = field(default_factory=set)
    _tried: set[tuple] = field(default_factory=set)      # groups with a candidate tried
    # the smallest split's forward probe, or the one standing in for it (_stand_in_probe)
    _probes: dict[tuple, MemoryEstimate] = field(default_factory=dict)
    _forwards: dict[tuple, dict[int, int]] = field(default_factory=dict)  # micro-batch: forward
    _pool: set[int] = field(default_factory=set)     # the candidates ``run`` tries now
    _fastest_fit: tuple | None = None                # the first of them known to fit (order)

    def setup_of(self, c: Candidate, eval_batch: int | None = None) -> TrainingSetup:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            setup = normalize_args(training_args(c, self.ctx, eval_batch), source="plan",
                                   num_gpus=self.req.ranks, trainer=self.req.trainer)
        rows = self.req.lengths.rows if c.padding_free and self.req.lengths else ()
        return with_lengths(setup, rows, None)[0] if rows else setup

    def estimate(self, c: Candidate, *, stage: str = "train",
                 setup: TrainingSetup | None = None, probe: bool = False,
                 judge: bool = True) -> MemoryEstimate:
        """``judge``: the smallest capacity is searched only where the verdict against the
        budget depends on it; ``judge=False`` always (what ``estimate_memory`` reports). With
        the allocator options ``c`` is planned with (``Candidate.allocator``)."""
        spec = self.book.get(c.method, c.precision)[0]
        report(f"estimating {c.label()}{' (eval)' if stage == 'eval' else ''}")
        return estimate_for(spec, setup or self.setup_of(c), self.req.dev,
                            seq_len=self.req.seq_len, stage=stage, cache=self.cache, probe=probe,
                            cuda_version=self.req.cuda_version,
                            fit_budget=self.budget if judge else None,
                            allocator=allocator_of(c))

    # -- pricing and the cheap bound ----------------------------------------------------------
    def _states_setup(self, c: Candidate) -> TrainingSetup:
        """The setup of ``c`` as far as model states go: read once per engine rung, precision
        and accumulation (what the sharding depends on), with ``c``'s optimizer."""
        key = (c.parallel, c.precision, c.grad_accum > 1)
        if key not in self._setups:
            self._setups[key] = self.setup_of(c)
        return self._setups[key].replace(optim=c.optim)

    def states_of(self, c: Candidate) -> tuple:
        """(the states setup, one rank's model states, trainable parameters) of ``c``: the same
        for every micro-batch split and technique of one method, precision, engine rung,
        accumulation and optimizer, so computed once for all of them."""
        key = (c.method, c.precision, c.parallel, c.grad_accum > 1, c.optim)
        if key not in self._states:
            setup = self._states_setup(c)
            spec = trained_spec(self.book.get(c.method, c.precision)[0], setup)
            rs, _ = states_for(spec, setup, self.req.dev)
            self._states[key] = (setup, rs, sum(p.numel for p in spec.states()[1]))
        return self._states[key]

    def price(self, c: Candidate) -> None:
        """Set ``rel_time`` (not yet relative) and reject on model states alone."""
        setup, rs, n_trainable = self.states_of(c)
        c.rel_time = cost(c, self._shape(c), n_trainable=n_trainable, dev=self.req.dev,
                          sharding=setup.sharding)
        per_node = rs.host * (self.req.ranks // self.req.nodes)
        if self.host_budget is not None and per_node > self.host_budget:
            c.reason = (f"offload needs {format_bytes(per_node)} of host RAM per node > "
                        f"{format_bytes(self.host_budget)}")
        elif rs.model_states + rs.buckets > self.budget:
            c.reason = (f"weights + gradients + optimizer state alone need "
                        f"{format_bytes(rs.model_states + rs.buckets)} > budget "
                        f"{format_bytes(self.budget)}")
        elif (at_forward := _at_forward(rs)) > self.budget:
            c.reason = (f"weights + optimizer state + the parameters the engine gathers for the "
                        f"forward alone need {format_bytes(at_forward)} > budget "
                        f"{format_bytes(self.budget)}")

    def _shape(self, c: Candidate) -> Shape:
        """The cost model's shape, with the tokens a sample really costs (_plan.lengths)."""
        lengths = self.req.lengths
        if lengths is None:
            return self.shape
        tokens = lengths.mean_len if c.padding_free else lengths.padded_tokens(c.micro_batch)
        return dataclasses.replace(self.shape, seq_len=max(1, round(tokens)))

    # -- the search ---------------------------------------------------------------------------
    def _try(self, c: Candidate) -> bool:
        """Estimate ``c`` and say whether it fits; only exact estimates are accepted.

        Where its group looks ample (``_ample``), the first candidate tried (the fastest split
        of the setup, the one chosen when memory is ample) is traced exactly at once: one
        trace. Otherwise ``c`` is rejected by its own forward where the group's probe says its
        forward likely misses (``_forward_misses``), else traced exactly. (No line through two
        micro-batches bounds a third: ``TraceCache``.)"""
        setup, g = self.setup_of(c), _group(c)
        first = g not in self._tried
        self._tried.add(g)
        if first and self._ample(c):
            return self.record(c, self.estimate(c, setup=setup)) or expandable(self, c, setup)
        if self._forward_misses(c):
            return False
        return self.record(c, self.estimate(c, setup=setup)) or expandable(self, c, setup)

    def _ample(self, c: Candidate) -> bool:
        """Whether ``c`` looks likely to fit: its group's smallest split scaled to ``c``'s
        micro-batch: from its exact estimate, only the activations and temporaries at its peak
        (model states, context and fragmentation stay); else from ``_smallest_fits``' forward
        probe, its forward grown to ``c``'s micro-batch (``_forward_guess``). A guess that only
        orders the traces (``c`` first, or the group's smallest splits first); every verdict
        still rests on a bound or an exact estimate."""
        small = self._smallest[_group(c)]
        ratio = c.micro_batch / small.micro_batch
        probe = self._probes.get(_group(c))  # exact where the step's trace was cached
        est = small.estimate if small.estimate is not None else probe
        if est is not None and not est.lower_bound and est.peak_phase != "optimizer step":
            scaled = est.breakdown.get("activations", 0) + est.breakdown.get("temporaries", 0)
            return est.upper + scaled * (ratio - 1) <= self.budget
        if probe is None:
            return False
        return self._forward_guess(c, probe, small) <= self.budget

    def _forward_guess(self, c: Candidate, probe: MemoryEstimate, small: Candidate) -> int:
        """``c``'s upper as its forward alone would need it, from the group's forward probe
        at the smallest split ``small``: the probe's forward less what it holds before any
        activation (``_at_forward``), scaled to ``c``'s micro-batch (the probe's peak may be
        the optimizer step, whose breakdown says nothing of the activations); where ``c``
        accumulates, its second micro-step's forward grows the same on top of the gradients.
        A guess: the backward is not in it."""
        peaks = probe.phase_peaks
        forward = peaks.get("forward", 0)
        grown = max(0, forward - _at_forward(self.states_of(c)[1]))
        own = peaks.get("forward (accumulating)", forward) if c.grad_accum > 1 else forward
        scaled = own + grown * (c.micro_batch / small.micro_batch - 1)
        return probe.upper + max(0, scaled - max(peaks.values()))

    def _forward_misses(self, c: Candidate) -> bool:
        """Where a guess says that ``c``'s forward alone likely misses: ``c``'s own forward-only
        trace (a fifth of a two-micro-step trace, a third of a one-step one), a lower bound that
        rejects ``c`` where it misses. The guess: the group probe's forward phase less what the
        forward holds before any activation, scaled from the smallest split's micro-batch to
        ``c``'s; not where the chord between two forward probes of the group says it fits.
        Elsewhere no trace here (``_try`` then traces ``c`` exactly)."""
        g = _group(c)
        probe, small = self._probes.get(g), self._smallest[g]
        if probe is None or not probe.lower_bound or c.micro_batch <= small.micro_batch:
            return False
        if self._forward_guess(c, probe, small) <= self.budget:
            return False
        seen = self._forwards.setdefault(g, {small.micro_batch: probe.upper})
        below = max((b for b in seen if b < c.micro_batch), default=None)
        above = min((b for b in seen if b > c.micro_batch), default=None)
        if below is not None and above is not None and seen[below] + (
                seen[above] - seen[below]) * (c.micro_batch - below) // (above - below) \
                <= self.budget:  # the chord between two forward probes: a guess, no bound
            return False
        est = self.estimate(c, probe=True)
        seen[c.micro_batch] = est.upper
        return est.lower_bound and not self.record(c, est)

    def record(self, c: Candidate, est: MemoryEstimate) -> bool:
        c.estimate, c.device_used, c.peak_allocated = est, est.device_used, est.peak_allocated
        host = est.host_offloaded * (self.req.ranks // self.req.nodes)
        # what must fit is what the step needs (the allocator freeing its cache before an
        # OOM) plus the margin of its uncertain terms
        c.fits = est.upper <= self.budget and not est.refusals and not host_short(self, c)
        if c.fits and id(c) in self._pool and not est.lower_bound:
            self._fastest_fit = min(order(c), self._fastest_fit or order(c))
        if not c.fits and est.refusals:
            c.reason = "cannot start: " + "; ".join(est.refusals)
        elif not c.fits:
            at_least = "at least " if est.needs_at_least else ""
            c.reason = (f"needs {at_least}{format_bytes(est.required)} (+ margin "
                        f"{format_bytes(est.upper - est.required)}) > budget "
                        f"{format_bytes(self.budget)}" if est.upper > self.budget else
                        f"offload needs {format_bytes(host)} of host RAM per node > "
                        f"{format_bytes(self.host_budget)}")
        return c.fits

    def _smallest_fits(self, c: Candidate) -> bool:
        """Memory grows with the micro-batch: when the smallest micro-batch of ``c``'s setup
        does not fit (bounded from below by its forward alone: a forward-only trace shared by
        the whole group), no larger one does, and ``c`` is rejected without a trace of its own.
        Where the group does not look ample, or a faster split has failed, the smallest is traced
        exactly, which settles the group; or, where the probe says the smallest likely fits
        (``_forward_bound``), the next split up: where it does not fit, no larger one does, and
        the smallest (the slowest split) is traced only when the search reaches it."""
        g = _group(c)
        small = self._smallest[g]
        if small is c:
            return True
        if small.estimate is None and g not in self._probes:
            stand_in = self._stand_in_probe(g)
            if stand_in is not None:  # its own probe would fit too: not traced
                self._probes[g] = stand_in
            else:
                est = self._probes[g] = self.estimate(small, probe=True)
                if est.upper > self.budget:
                    self.record(small, est)
        if small.estimate is None and (g in self._tried or not self._ample(c)):
            # the next split up: where it does not fit, no larger one does, and the smallest
            # (slower) is traced only when the search reaches it
            second = self._second.get(g) if self._forward_bound(g) else None
            if second is not None and second.micro_batch <= c.micro_batch:
                if second is c:
                    return True
                if second.estimate is None:
                    if self._after_a_fit(second):
                        return True
                    self._try(second)
                if not second.fits:
                    c.reason = (f"a smaller micro-batch ({second.micro_batch}) already does not "
                                f"fit: {second.reason}")
                    return False
            elif not self._after_a_fit(small):
                self._try(small)
        if small.estimate is not None and not small.fits:
            c.reason = (f"a smaller micro-batch ({small.micro_batch}) already does not fit: "
                        f"{small.reason}")
            return False
        return True

    def price_method(self, candidates: list[Candidate], method: str) -> None:
        """Price the candidates of ``method`` (once): a method the search never reaches is
        never priced, so its model (a LoRA or 4-bit spec of a large model takes seconds to
        build) is never resolved; its candidates keep ``rel_time`` None."""
        if method in self._priced:
            return
        self._priced.add(method)
        for c in candidates:
            if c.method != method:
                continue
            self.price(c)
            self._place(c)

    def _after_a_fit(self, settler: Candidate) -> bool:
        """Whether a split that would settle its group comes after a candidate of this pool
        known to fit: the search never reaches it, so it is not traced to settle the group (the
        faster split asking is then judged on its own)."""
        return self._fastest_fit is not None and order(settler) >= self._fastest_fit

    def _stand_in_probe(self, g: tuple) -> MemoryEstimate | None:
        """The probe of the group ``g`` without one of its techniques whose forward is like the
        setup's without it (``Technique.forward_like``: activation offloading), where that
        probe fits: ``g``'s own forward holds no more, so its probe would fit too and reject
        nothing. It stands in for ``g``'s in the guesses that order the traces (``_ample``,
        ``_forward_bound``, ``_forward_misses``), never as a bound: a verdict on ``g`` still
        rests on its own traces."""
        method, precision, optim, techniques, parallel, attn = g
        for t in techniques:
            if not TECHNIQUES.get(t).forward_like:
                continue
            probe = self._probes.get((method, precision, optim,
                                      tuple(x for x in techniques if x != t), parallel, attn))
            if probe is not None and probe.upper <= self.budget:
                return probe
        return None

    def _forward_bound(self, g: tuple) -> bool:
        """Whether the group's probe was bounded by its forward (not by the optimizer step,
        which says nothing of the activations): then its smallest split likely fits, and the
        next split up decides the group (``_smallest_fits``); else the smallest is traced first,
        since where it does not fit, nothing of the group does."""
        probe = self._probes.get(g)
        return probe is not None and probe.peak_phase != "optimizer step"

    def _place(self, c: Candidate) -> None:
        """Keep ``c`` as its group's smallest or next-smallest split where it is one."""
        g = _group(c)
        small = self._smallest.get(g)
        if small is None or c.micro_batch < small.micro_batch:
            self._smallest[g], c = c, small
        if c is not None and (g not in self._second
                              or c.micro_batch < self._second[g].micro_batch):
            self._second[g] = c

    def passes(self) -> list[tuple[Method, bool, int]]:
        """(method, with the user's optimizer, engine tier) in the order the search tries them
        (docs/fitting.md, methods, rungs and offload). Offloading parameters or optimizer state
        (tier 1) is slow and needs host RAM the plan may not know: with ``method="auto"`` it
        comes after every method's setups without it, unless ``host_memory`` was given; within
        one method the user's optimizer comes before another one."""
        offload_last = self.req.method == "auto" and self.req.host_memory is None
        first = ((True, 0), (False, 0)) if offload_last else \
            ((True, 0), (True, 1), (False, 0), (False, 1))
        out = [(m, own, tier) for m in self.methods for own, tier in first]
        if offload_last:
            out += [(m, own, 1) for m in self.methods for own in (True, False)]
        return out

    def run(self, candidates: list[Candidate]) -> Candidate:
        mine = user_optimizer(self.req)
        said_full = False
        for meth, own_optim, tier in self.passes():
            self.price_method(candidates, meth.name)
            pool = sorted((c for c in candidates if c.method == meth.name and not c.reason
                           and rung_of(c.parallel).tier == tier
                           and (c.optim == mine) == own_optim), key=order)
            self._pool, self._fastest_fit = {id(c) for c in pool}, None
            chosen = next((c for c in pool if not c.reason and self._smallest_fits(c)
                           and self._try(c)), None)
            if chosen is not None:
                if not own_optim:
                    self._swapped_optimizer(chosen, mine)
                say_offload(self, candidates, chosen)
                return chosen
            if meth.name == "full" and not own_optim and tier == 0 \
                    and self.req.method == "auto" and len(self.methods) > 1 and not said_full \
                    and any(c.method == "full" and rung_of(c.parallel).tier == 0
                            for c in candidates):  # engine="zero3-offload": none was asked for
                said_full = True
                self.notes.append("no full fine-tuning setup fits without offloading parameters "
                                  "or optimizer state; falling back to the LoRA family, which "
                                  "trains adapters instead of all weights")
        tight = tightest(self, candidates) if self.req.allow_tight else None
        if tight is not None:
            return tight
        self.raise_impossible(candidates)

    def _swapped_optimizer(self, chosen: Candidate, mine: str) -> None:
        """The optimizer is part of the user's recipe: say loudly that it was changed."""
        msg = (f"no {chosen.method} setup with {mine} (TrainingArguments' default optimizer) fits "
               f"{format_bytes(self.budget)} on {self.req.dev.name}; the plan uses "
               f"{chosen.optim} instead, which changes the optimizer's numerics. Pin "
               f"optim={mine!r} to keep it (the plan then says what it needs), or pin "
               f"optim={chosen.optim!r} to accept this one")
        self.notes.append(msg)
        warnings.warn(msg, UserWarning, stacklevel=3)

    def eval_batch(self, chosen: Candidate) -> int:
        """The largest power of two (<= 4 x the micro-batch) whose eval step fits, each traced
        exactly: from the floor up where the eval just above the floor likely misses
        (``_tight``), else from the top down (the largest usually fits: one trace). The floor
        is the micro-batch's own power of two, which is not traced where the eval step is the
        train step's forward and loss (the trainer's ``eval_is_forward``: it holds no more than
        the train step that fits at that batch); else 1."""
        setup = self.setup_of(chosen)
        top = 1 << (4 * chosen.micro_batch).bit_length() - 1
        floor = 1 << chosen.micro_batch.bit_length() - 1 \
            if setup.trainer_kind.eval_is_forward else 1

        def fits(b: int) -> bool:
            est = self.estimate(chosen, stage="eval", setup=setup.replace(eval_batch=b))
            return est.upper <= self.budget

        if floor < top and self._tight(chosen, 2 * floor):
            # the eval step's memory grows with its batch: from the floor up, the first batch
            # that does not fit ends the search (one trace where the next one up misses)
            b = floor
            while b < top and fits(2 * b):
                b *= 2
            return b
        b = top
        while b > floor and not fits(b):
            b //= 2
        return b

    def _tight(self, chosen: Candidate, batch: int) -> bool:
        """Whether the eval step at ``batch`` likely misses: the chosen train step's weights and
        context, and its activations and temporaries scaled to ``batch`` (an eval step keeps
        no gradients or optimizer state in the estimate, and saves no activations for a
        backward: a guess from above). The eval batch is then searched from its floor up, else
        from the top down. Only the order of the traces; the batch found is the same."""
        est = chosen.estimate
        if est is None:
            return False
        b = est.breakdown
        grown = (b.get("activations", 0) + b.get("temporaries", 0)) * batch / chosen.micro_batch
        return b.get("weights", 0) + b.get("context", 0) + grown > self.budget

    def raise_impossible(self, candidates: list[Candidate]) -> NoReturn:
        """Say the smallest memory any setup needs, and which setup that is."""
        for meth in self.methods:
            self.price_method(candidates, meth.name)
        best = None
        for c in candidates:
            if c.micro_batch != 1 and c.estimate is None:
                continue
            if c.estimate is None or (c.micro_batch == 1 and c.estimate.lower_bound):
                try:
                    c.estimate = self.estimate(c)
                except HfMemkitError:
                    continue
                c.device_used = c.estimate.device_used
            if best is None or c.estimate is None or best.estimate is None or \
                    c.estimate.upper < best.estimate.upper:
                best = c
        if best is None:
            raise HfMemkitError("no setup could be estimated for this model")
        dev, budget, seq_len = self.req.dev, self.budget, self.req.seq_len
        qlora = "" if "qlora" in {c.method for c in candidates} else ", method='qlora'"
        fits_device = best.estimate is not None and best.estimate.upper <= budget
        if best.reason.startswith("offload needs") and fits_device:
            raise HfMemkitError(
                f"the only setups that fit {dev.name} offload to CPU RAM, and {best.label()} "
                f"{best.reason[len('offload '):]}; give host_memory= if the nodes have more RAM, "
                f"or use more GPUs, a shorter seq_len{qlora}")
        est = best.estimate
        margin = "" if est is None or est.upper <= est.required else (
            f" + margin {format_bytes(est.upper - est.required)} (the estimate's "
            "uncertainty; `hf-memkit calibrate` on this GPU narrows it)")
        needs = est.required if est is not None else best.device_used
        mm = self.req.max_memory
        has = f"{dev.name} has {format_bytes(budget)} usable" if mm is None else \
            f"max_memory={mm!r} allows {format_bytes(budget)}; raise max_memory, or try"
        raise HfMemkitError(
            f"needs at least {format_bytes(needs)}{margin} with {best.label()} at "
            f"seq {seq_len}; {has if mm is not None else has + '; try'} a shorter "
            f"seq_len{qlora}, more GPUs or a larger GPU")
