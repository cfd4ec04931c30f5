"""The memory-technique registry: one ``Technique`` per setting that changes a step's memory.

A technique is switched on by ``TrainingArguments`` fields (``fields``); ``read`` turns the
arguments into the technique's options (None: off). A ``TrainingSetup`` carries the techniques
that are on as a set of ``TechniqueUse`` (name + options), and the trace cache key is derived
from the setup, so a new technique is part of the key by construction.

Each entry is a ``Technique`` subclass in a file of its own, registered with one
``register(Cls())`` line (as engines and methods are); it overrides what its technique does:
  * ``modelled``: False -> a warning names it and the estimate says it is ignored;
  * ``trace_hook(model, options, stage=, adapters=, target=)``: applied to the fake model before
    a traced step (e.g. checkpointing wraps the layers); ``target`` is the ``CudaTarget``, or
    None for a CPU;
  * ``host_bytes(spec, setup, seq_len, options, compute_dtype)``: bytes it keeps in host memory
    for a training step, added to ``MemoryEstimate.host_offloaded`` (an eval step counts none);
    ``compute_dtype``: the dtype each rank computes in;
  * ``devices``: the device kinds it acts on (empty: all). On any other target its host bytes
    are not counted, its trace hook (given ``target=None``) must leave the model as it is, and
    the estimate notes ``inert`` (why it changes nothing there);
  * ``extra_flops(n_params, attn_flops)``: compute it adds per token (the planner's cost model);
    ``extra_seconds(shape=, dev=, itemsize=)``: time per sample it adds that is not compute
    (host transfers), from ``_plan.cost.Shape`` and the target device;
  * ``searched``: the planner tries it on and off; ``emit(on, pins)`` gives the TrainingArguments
    fields for that (a dict value is merged into the same field of another technique's emit),
    ``prepare(model)`` applies it in ``Plan.prepare``, ``supported(model_cls)`` says whether the
    model can use it, ``available()`` whether this machine has what the Trainer needs for it
    (``missing``: what to install otherwise), ``requires``: techniques it only works with (the
    planner never tries it without them);
  * ``ladder``: where a searched technique sits among the memory rungs ``Plan.explain`` lists
    (lower: cheaper, applied first); ``pinned(pins)``: whether the user's pins switch it on or
    off, None when they leave it to the search (default: on/off as ``read`` says, when any of
    its fields is pinned).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple

from .._registry import Registry


class TechniqueUse(NamedTuple):
    """A technique that is on, with its options as sorted ``(key, value)`` pairs (hashable)."""

    name: str
    options: tuple[tuple[str, Any], ...] = ()

    def option(self, key: str, default: Any = None) -> Any:
        return dict(self.options).get(key, default)

    @classmethod
    def of(cls, name: str, options: Mapping[str, Any] | None = None) -> TechniqueUse:
        return cls(name, frozen(dict(options or {})))


def frozen(v: Any) -> Any:
    """A hashable, order-independent form of nested options (dicts and sets sorted)."""
    if isinstance(v, dict):
        return tuple(sorted((str(k), frozen(x)) for k, x in v.items()))
    if isinstance(v, (set, frozenset)):
        return tuple(sorted(frozen(x) for x in v))
    if isinstance(v, list):
        return tuple(frozen(x) for x in v)
    return v


class Technique:
    """Base of the registered memory techniques; each file overrides what its technique does."""

    name = ""
    fields: tuple[str, ...] = ()
    what = ""                             # what it changes, for notes and warnings
    modelled = True
    label: str | None = None              # in warnings and candidate labels (default: name)
    title: str | None = None              # in sentences (default: label)
    devices: tuple[str, ...] = ()         # device kinds it acts on (empty: all)
    inert = ""                            # the note on other device kinds
    searched = False
    missing = ""
    requires: tuple[str, ...] = ()
    ladder = 50
    # on, the forward holds no more device memory than the same setup without it, and nearly
    # as much: the planner lets a forward probe of that setup that fits stand in for this one's
    forward_like = False

    def read(self, explicit: Mapping[str, Any],
             get: Callable[[str], Any]) -> Mapping[str, Any] | None:
        """The options the arguments switch it on with (``explicit``: the fields given;
        ``get``: any field, defaults included), or None: off."""
        raise NotImplementedError

    def trace_hook(self, model: Any, options: Mapping[str, Any], *, stage: str, adapters: bool,
                   target: Any = None) -> None:
        """Patch the fake model before a traced step (nothing by default)."""

    def host_bytes(self, spec: Any, setup: Any, seq_len: int, options: Mapping[str, Any],
                   compute_dtype: Any) -> int:
        return 0

    def extra_flops(self, n_params: int, attn_flops: float) -> float:
        return 0.0

    def extra_seconds(self, *, shape: Any, dev: Any, itemsize: int) -> float:
        return 0.0

    def emit(self, on: bool, pins: Mapping[str, Any]) -> dict[str, Any]:
        return {}

    def prepare(self, model: Any) -> Any:
        return model

    def supported(self, model_cls: type) -> bool:
        return True

    def available(self) -> bool:
        return True

    def pinned(self, pins: Mapping[str, Any]) -> bool | None:
        """Whether the user's pinned fields switch it on or off (None: not pinned)."""
        if not any(f in pins for f in self.fields):
            return None
        return self.read(pins, pins.get) is not None

    @property
    def display(self) -> str:
        return self.label or self.name

    @property
    def sentence_name(self) -> str:
        return self.title or self.display

    def acts_on(self, device_kind: str) -> bool:
        return not self.devices or device_kind in self.devices


class Flag(Technique):
    """A technique switched on by one truthy ``TrainingArguments`` field, named as the
    technique (its value is the option)."""

    def __init__(self, name: str, what: str, *, modelled: bool = True) -> None:
        self.name, self.fields, self.what, self.modelled = name, (name,), what, modelled

    def read(self, explicit: Mapping[str, Any],
             get: Callable[[str], Any]) -> Mapping[str, Any] | None:
        v = get(self.name)
        return {"value": v} if v else None


TECHNIQUES: Registry[Technique] = Registry("memory technique")


def register(t: Technique) -> Technique:
    return TECHNIQUES.register(t)


def read_techniques(explicit: Mapping[str, Any],
                    get: Callable[[str], Any]) -> frozenset[TechniqueUse]:
    """The techniques the arguments switch on."""
    out = set()
    for t in TECHNIQUES:
        opts = t.read(explicit, get)
        if opts is not None:
            out.add(TechniqueUse.of(t.name, opts))
    return frozenset(out)


def unmodelled(uses: Iterable[TechniqueUse]) -> list[str]:
    """``"label: what"`` for every technique in ``uses`` the estimator does not model."""
    names = {u.name for u in uses}
    return [f"{t.display}: {t.what}" for t in TECHNIQUES if t.name in names and not t.modelled]


def searched() -> list[Technique]:
    return [t for t in TECHNIQUES if t.searched]
