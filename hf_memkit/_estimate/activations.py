"""Activations and temporaries: trace the real model code on fake tensors, extrapolate in depth
(and, for the planner's lower bounds, in the micro-batch).

Models with more than ``FULL_TRACE_MAX_LAYERS`` blocks are traced at 2 and 3 blocks and
extrapolated linearly in the block count, so a 70B plan takes seconds. Each phase of the step
(forward, backward, and their accumulating micro-step) is extrapolated on its own.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any

from .. import _store as store
from .._cuda.events import MARK, EventLog
from .._cuda.target import CudaTarget
from .._errors import HfMemkitError
from .._model.facts import layer_count, with_layers
from .._model.spec import ModelSpec
from .._setup.setup import TrainingSetup
from .._techniques import TECHNIQUES
from .._trace.step import trace_step
from .progress import report

FULL_TRACE_MAX_LAYERS = 4
EXTRAPOLATE_AT = (2, 3)
CATEGORIES = ("Activation", "Temp", "Gradient")
_KERNEL = re.compile(r"[\w.-]{1,64}")  # an SDPA kernel's name, as a trace entry may hold it


@dataclass
class Excess:
    """What each phase of a step adds on top of weights + inputs (+ gradients when
    accumulating), from the trace, extrapolated to full depth."""

    phases: dict[str, int]                 # forward, backward, [forward_accum, backward_accum]
    categories: dict[str, dict[str, int]]  # per phase: Activation, Temp, Gradient at its peak
    inputs: int
    seconds: float
    layers: tuple[int, ...]
    lower_bound: bool = False              # extrapolated in the micro-batch (TraceCache)
    sdpa_kernels: tuple[str, ...] = ()     # CUDA targets: the attention kernel of each call
    # CUDA traces: (blocks traced, allocation event log, trainable parameter bytes) per depth,
    # for the caching-allocator replay (``allocation``); its results memoised by key
    replays: tuple[tuple[int, EventLog, tuple[int, ...]], ...] = ()
    replayed: dict = field(default_factory=dict, repr=False, compare=False)
    host: int = 0                          # pinned host bytes of a trainer's offloading (TRL)
    cuda_dropout: bool = False             # CUDA targets: CUDA's fused dropout ran
    # the trace store's name of this trace (``store``; None: not kept on disk), under which
    # its replays are kept too (``device.allocator_fit``)
    stored_as: str | None = field(default=None, repr=False, compare=False)

    def to_dict(self) -> dict[str, Any]:
        """JSON data (the trace store, ``store``); ``replayed`` (a memo) is left out."""
        return {"phases": self.phases, "categories": self.categories, "inputs": self.inputs,
                "seconds": self.seconds, "layers": list(self.layers),
                "lower_bound": self.lower_bound, "sdpa_kernels": list(self.sdpa_kernels),
                "replays": [[n, log.to_dict(), list(tr)] for n, log, tr in self.replays],
                "host": self.host, "cuda_dropout": self.cuda_dropout}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Excess:
        """``to_dict`` read back (an entry of the trace store: untrusted, so every byte count
        and count is checked by ``store.count``); malformed data raises ``ValueError``,
        ``TypeError`` or ``KeyError``."""
        count = store.count
        seconds = float(d["seconds"])
        if not (math.isfinite(seconds) and seconds >= 0):
            raise ValueError("the trace's seconds must be a finite non-negative number")
        kernels = tuple(str(k) for k in d["sdpa_kernels"])
        if not all(_KERNEL.fullmatch(k) for k in kernels):
            raise ValueError("an SDPA kernel's name must be a short identifier")
        return cls({str(k): count(v) for k, v in d["phases"].items()},
                   {str(p): {str(k): count(v) for k, v in c.items()}
                    for p, c in d["categories"].items()},
                   count(d["inputs"]), seconds, tuple(count(n) for n in d["layers"]),
                   bool(d["lower_bound"]), kernels,
                   tuple((count(n), _counted(EventLog.from_dict(log)),
                          tuple(count(b) for b in tr)) for n, log, tr in d["replays"]),
                   host=count(d["host"]), cuda_dropout=bool(d["cuda_dropout"]))


def _counted(log: EventLog) -> EventLog:
    """``log``, once every handle, byte count and block index in it is a count
    (``store.count``; ``ValueError`` otherwise)."""
    for op, h, n in log.events:
        store.count(n)
        if op != MARK:
            store.count(h)
    blocks = [b for b, _ in log.where] + list(log.owner.values())
    for n in [*log.owner, log.blocks, *(i for b in blocks if b is not None for i in b)]:
        store.count(n)
    return log


def technique_hooks(setup: TrainingSetup) -> list[Any]:
    """The trace hooks of the setup's techniques (``Technique.trace_hook``), bound to their
    options, in the order of their names."""
    return [functools.partial(_apply_hook, TECHNIQUES.get(use.name), dict(use.options))
            for use in sorted(setup.techniques)]


def _apply_hook(t: Any, options: dict[str, Any], model: Any, **kw: Any) -> None:
    t.trace_hook(model, options, **kw)


def _lin(x1: float, x2: float, scale: float) -> int:
    return int(round(x1 + (x2 - x1) * scale))


def trace_excess(spec: ModelSpec, setup: TrainingSetup, *, seq_len: int, stage: str,
                 target_len: int | None, padded: bool, forward_only: bool = False,
                 target: CudaTarget | None = None) -> Excess:
    """``stage``: "train", "eval", or "forward_backward" (one forward + backward of the model's
    own loss, traced as a train micro-step without accumulation).

    Kept on disk between processes (``store``; off with ``HF_MEMKIT_NO_CACHE=1``), keyed by
    everything the trace depends on (``disk_key``)."""
    batch = setup.eval_batch if stage == "eval" else setup.micro_batch
    accum = 1 if stage == "forward_backward" else setup.grad_accum
    # two micro-steps show everything accumulation changes; the Trainer prefetches all of a
    # step's micro-batches, whose bytes are scaled up below (as TraceCache does)
    traced = min(accum, 2)
    # the trace sees only these: a longer accumulation shares its trace
    shape = setup.replace(micro_batch=batch, eval_batch=batch, grad_accum=traced)
    kw = dict(seq_len=seq_len, stage=stage, target_len=target_len, padded=padded,
              forward_only=forward_only, target=target)
    disk = store.TraceStore() if store.enabled() else None
    key = disk_key(spec, shape, **kw) if disk is not None else None
    e = _stored(disk, key)
    if e is None:
        report(f"tracing {spec.model_cls.__name__}: {stage}, micro-batch {batch} x "
               f"{seq_len} tokens{' (forward)' if forward_only else ''}")
        e = _trace_excess(spec, shape, **kw)
        if key is not None:
            disk.put(key, e.to_dict())
    if key is not None:
        e.stored_as = store.digest(key)
    if stage != "eval" and accum != traced:
        e = dataclasses.replace(e, inputs=e.inputs // traced * accum)
    return e


def disk_key(spec: ModelSpec, setup: TrainingSetup, **kw: Any) -> str | None:
    """The trace store's key of ``trace_excess(spec, setup, **kw)`` for a setup whose batch and
    accumulation are the traced ones: the spec's ``trace_identity()``, the setup's
    ``trace_key()`` and batch shape, ``kw`` and the library versions (``store.make_key``); None
    where a part has no stable form."""
    return store.make_key({"model": spec.trace_identity(), "setup": setup.trace_key(),
                           "batch": [setup.micro_batch, setup.eval_batch, setup.grad_accum],
                           **kw})


def _stored(disk: store.TraceStore | None, key: str | None) -> Excess | None:
    if disk is None or key is None:
        return None
    d = disk.get(key)
    if d is None:
        return None
    try:
        return Excess.from_dict(d)
    except (ValueError, TypeError, KeyError, AttributeError):
        disk.discard(key)
        return None


def _trace_excess(spec: ModelSpec, setup: TrainingSetup, *, seq_len: int, stage: str,
                  target_len: int | None, padded: bool, forward_only: bool,
                  target: CudaTarget | None) -> Excess:
    full = layer_count(spec.config)
    batch = setup.eval_batch if stage == "eval" else setup.micro_batch
    accum = 1 if stage == "forward_backward" else setup.grad_accum
    traced = min(accum, 2)
    # the micro-batch the trainer's collator builds, and the trainer's own loss (_trainers)
    kind, options = setup.trainer_kind, setup.trainer_options
    shape = kind.shape(options, batch, seq_len)
    kw = dict(task=spec.task, micro_batch=shape.rows, seq_len=shape.tokens, grad_accum=traced,
              amp=setup.amp, dtype=spec.dtype, attn_implementation=spec.attn_implementation,
              lora=spec.lora, stage="eval" if stage == "eval" else "train",
              target_len=target_len, padded=padded or shape.padded,
              hooks=technique_hooks(setup), forward_only=forward_only, target=target,
              trainer=kind.step(options),
              reference=kind.reference(options, spec.lora is not None), packed=shape.packed,
              split=setup.sequence_split())

    def excess(n: int):
        cfg = spec.config if n == full else with_layers(spec.config, n)
        try:
            r = trace_step(spec.model_cls, cfg, **kw)
        except (ValueError, NotImplementedError) as exc:
            if isinstance(exc, HfMemkitError) or not _raised_by_transformers(exc):
                raise
            raise HfMemkitError(
                f"{spec.model_cls.__name__}'s own code refused the step hf_memkit traces "
                f"(batch {batch} x seq {seq_len}, {stage}): {type(exc).__name__}: "
                f"{str(exc).strip().splitlines()[0] if str(exc).strip() else ''} hf_memkit runs "
                "the model's real code, so a training run with this config would fail the same "
                "way: fix the model's config (e.g. pad_token_id for batched sequence "
                "classification) or the setup") from exc
        out = {}
        for name, total in r.phases.items():
            held = r.weights + r.inputs + (r.grads if name.endswith("_accum") else 0)
            out[name] = total - held
        cats = {name: {k: c.get(k, 0) for k in CATEGORIES} for name, c in r.categories.items()}
        replay = ((n, r.events, r.trainable),) if r.events is not None else ()
        inputs = r.inputs // traced * accum if stage != "eval" else r.inputs
        return out, cats, inputs, r.seconds, (r.sdpa_kernels, r.cuda_dropout), replay, r.host

    if full <= FULL_TRACE_MAX_LAYERS or setup.checkpoint_every_n_layers > 1:
        ph, cats, inp, secs, (kernels, drop), rep, host = excess(full)
        return Excess(ph, cats, inp, secs, (full,), sdpa_kernels=kernels, replays=rep,
                      host=host, cuda_dropout=drop)
    k1, k2 = EXTRAPOLATE_AT
    ph1, c1, inp, s1, (kernels, drop), rep1, h1 = excess(k1)
    ph2, c2, _, s2, _, rep2, h2 = excess(k2)
    scale = (full - k1) / (k2 - k1)
    phases = {k: _lin(ph1[k], ph2[k], scale) for k in ph1}
    cats = {k: {c: max(0, _lin(c1[k][c], c2[k][c], scale)) for c in c1[k]} for k in c1}
    return Excess(phases, cats, inp, s1 + s2, (k1, k2), sdpa_kernels=kernels,
                  replays=rep1 + rep2, host=max(0, _lin(h1, h2, scale)), cuda_dropout=drop)


class TraceCache:
    """Memoised traces for many estimates of one model (the planner's search).

    The key is the spec's ``trace_identity()`` and the setup's ``trace_key()`` (every setup field
    a trace can depend on, techniques included), plus whether the setup accumulates and its
    micro-batch, so optimizers, engines and accumulation lengths share a trace, and a new
    technique never does with the plain setup.

    No line through the traces at two micro-batches bounds a third: a phase's peak is not
    convex in the micro-batch (measured: Llama-3.2-1B under SFTTrainer on an A100, the
    accumulating backward's peak grows by 7.0, 4.7 and 4.0 GiB per sample from micro-batch 1 to
    2, 4 and 8, so the line through 1 and 2 claimed 70.6 GiB at 8 where the step holds 53.8, and
    a plan rejected the fastest setup that fits). Lower bounds come from a step's own forward
    (``probe``).
    """

    def __init__(self) -> None:
        self._store: dict[tuple, Excess] = {}

    def __len__(self) -> int:
        return len(self._store)

    def key(self, spec: ModelSpec, setup: TrainingSetup, *, seq_len: int, stage: str,
            target_len: int | None, padded: bool, target: CudaTarget | None = None) -> tuple:
        return (spec.trace_identity(), stage, setup.trace_key(), seq_len, target_len, padded,
                target)

    def excess(self, spec: ModelSpec, setup: TrainingSetup, *, seq_len: int, stage: str,
               target_len: int | None, padded: bool,
               target: CudaTarget | None = None) -> Excess:
        # an accumulating setup is traced with two micro-steps (any longer accumulation
        # repeats the second); a non-accumulating one with its own single micro-step, as
        # estimate_memory traces it: the allocator replay differs between the two
        batch = setup.eval_batch if stage == "eval" else setup.micro_batch
        accum = 2 if stage == "train" and setup.grad_accum > 1 else 1
        k = self.key(spec, setup, seq_len=seq_len, stage=stage, target_len=target_len,
                     padded=padded, target=target) + (accum, batch)
        if k not in self._store:
            s = setup.replace(micro_batch=batch, eval_batch=batch, grad_accum=accum)
            self._store[k] = trace_excess(spec, s, seq_len=seq_len, stage=stage,
                                          target_len=target_len, padded=padded, target=target)
        e = self._store[k]
        if stage == "train":  # the Trainer prefetches all micro-batches of a step
            keep = [p for p in e.phases if setup.grad_accum > 1 or not p.endswith("_accum")]
            # replace keeps the replay memo and the trace store's name (``stored_as``)
            e = dataclasses.replace(e, phases={p: e.phases[p] for p in keep},
                                    categories={p: e.categories[p] for p in keep},
                                    inputs=e.inputs // accum * setup.grad_accum)
        return e

    def probe(self, spec: ModelSpec, setup: TrainingSetup, *, seq_len: int, stage: str,
              target_len: int | None, padded: bool,
              target: CudaTarget | None = None) -> Excess:
        """A train step bounded from below by its first forward alone (a forward-only trace
        costs about a third of a full one): the forward phase is exact, the backward is left
        out. An accumulating step's second micro-step runs the same forward with the gradients
        of the first alive: its ``forward_accum`` excess (over weights, inputs and gradients)
        is the first forward's (checked against two-micro-step traces in
        tests/unit/plan/test_search.py), so the probe bounds that phase too. The full trace
        instead when it is cached (or for eval)."""
        accum = 2 if stage == "train" and setup.grad_accum > 1 else 1
        key = self.key(spec, setup, seq_len=seq_len, stage=stage, target_len=target_len,
                       padded=padded, target=target) + (accum,)
        b = setup.micro_batch
        if stage != "train" or key + (b,) in self._store:
            return self.excess(spec, setup, seq_len=seq_len, stage=stage, target_len=target_len,
                               padded=padded, target=target)
        k = key + ("forward only", b)
        if k not in self._store:
            self._store[k] = trace_excess(spec, setup.replace(grad_accum=1), seq_len=seq_len,
                                          stage=stage, target_len=target_len, padded=padded,
                                          forward_only=True, target=target)
        e = self._store[k]
        phases, cats = dict(e.phases), dict(e.categories)
        if accum > 1:
            phases["forward_accum"], cats["forward_accum"] = phases["forward"], cats["forward"]
        return Excess(phases, cats, e.inputs * setup.grad_accum, e.seconds, e.layers,
                      lower_bound=True, sdpa_kernels=e.sdpa_kernels, host=e.host,
                      cuda_dropout=e.cuda_dropout)


def _raised_by_transformers(exc: BaseException) -> bool:
    """Whether the innermost frame of ``exc`` is transformers' code (a model refusing its
    config or inputs), not hf_memkit's or torch's."""
    import transformers

    root = os.path.dirname(transformers.__file__) + os.sep
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and tb.tb_frame.f_code.co_filename.startswith(root)
