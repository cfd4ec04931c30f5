"""``MemoryEstimate``: the predicted memory of one step, in bytes, and how to read it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .._device.probe import DeviceInfo
from .._setup.setup import TrainingSetup
from .._units import format_bytes

# The verdict words (``MemoryEstimate.verdict``): the same in explain(), the tables, repr, JSON
# and the CLI's exit status (docs/fitting.md).
FITS, TIGHT, DOES_NOT_FIT, UNKNOWN = "fits", "tight", "does not fit", "unknown"
VERDICTS = (FITS, TIGHT, DOES_NOT_FIT, UNKNOWN)
_SHORT_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


@dataclass
class MemoryEstimate:
    """Predicted memory of one step. Bytes throughout; ``explain()`` renders it."""

    peak_allocated: int = field(metadata={"help": "Max live tensor bytes (max_memory_allocated)."})
    peak_reserved: int = field(metadata={"help": "Caching-allocator reserved at peak when nothing presses (CPU: = allocated)."})
    device_used: int = field(metadata={"help": "What this process holds on the device, as NVML lists it per process: reserved (which the allocator keeps within the device's memory by freeing its cache) + CUDA context + NCCL buffers; never the driver's reservation or other processes (on an idle GPU, what nvidia-smi's used rises by)."})
    breakdown: dict[str, int] = field(metadata={
        "help": "weights, gradients, optimizer, activations, temporaries (sum to peak_allocated); "
                "fragmentation, context; optimizer_paged when a paged optimizer keeps state in "
                "CUDA managed memory"})
    peak_phase: str = field(metadata={"help": "'forward', 'backward', 'forward (accumulating)', "
                                              "'backward (accumulating)', 'optimizer step', "
                                              "'eval forward'; GRPO / RLOO: also 'generate "
                                              "(prefill)', 'generate (decode)', 'score'."})
    stage: str = field(metadata={"help": "'train', 'eval' or 'forward_backward'."})
    device: DeviceInfo = field(repr=False, metadata={"help": "Device estimated for."})
    setup: TrainingSetup = field(repr=False, metadata={"help": "Normalised training arguments."})
    seq_len: int = field(default=0, metadata={"help": "Sequence length (the longest in a batch)."})
    uncertainty: float = field(default=0.0, metadata={"help": "Relative 1-sigma of device_used (margin / 2 / device_used)."})
    notes: list[str] = field(default_factory=list, metadata={"help": "What was assumed or noted."})
    model_states: int = field(default=0, metadata={
        "help": "Resident weights + gradients + optimizer state on this rank (sharded where the "
                "engine shards; DeepSpeed ZeRO-3 with its gathered largest module)."})
    host_offloaded: int = field(default=0, metadata={
        "help": "Bytes an offloading engine keeps in host memory for this rank."})
    trace_seconds: float = field(default=0.0, repr=False)  # the trace's (read from disk: its own)
    traced_layers: tuple[int, ...] = field(default=(), repr=False)
    lower_bound: bool = field(default=False, repr=False, metadata={
        "help": "True when the planner only bounded this setup from below (it did not fit)."})
    margin: int = field(default=0, metadata={
        "help": "2 sigma in bytes, from each uncertain term (margin_terms); what must fit the "
                "budget is required + margin (see upper)."})
    required: int = field(default=0, metadata={
        "help": "The smallest device memory the step runs in: on CUDA, the smallest capacity "
                "at which the replayed step completes through the caching-allocator model (it "
                "frees cached blocks and retries before an OOM), plus context; at most "
                "device_used (0 given: device_used)."})
    required_at_least: bool = field(default=False, repr=False, metadata={
        "help": "True when the planner judged this setup against its budget and found it "
                "misses: required is then at least what the step needs, not its smallest "
                "capacity (estimate_memory always searches that)."})
    margin_terms: dict[str, int] = field(default_factory=dict, metadata={
        "help": "Each uncertain term's share of the margin in bytes (shares of the combined "
                "variance, so they sum to the margin): traced activations and temporaries, "
                "CUDA context, allocator, NCCL buffers; or a user calibration's residuals."})
    cuda_version: str | None = field(default=None, metadata={
        "help": "The target's CUDA version the estimate assumed (None off CUDA)."})
    budget: int | None = field(default=None, metadata={
        "help": "Bytes the setup may use on the device, as plan_training computes it: "
                "max_memory if given, else what CUDA hands out (NVML's total less the driver's "
                "reserve) x (1 - headroom), no more than the "
                "free memory of this machine's device. None: no budget was given (see fits)."})
    budget_basis: str = field(default="", metadata={
        "help": "How the budget was derived, e.g. '23.65 GiB CUDA hands out of 23.99 GiB; no other tenant assumed'."})
    refusals: list[str] = field(default_factory=list, metadata={
        "help": "Why the run cannot start whatever its memory (a colocated vLLM's start-up "
                "rules); fits is False when there are any."})
    trained_dtype: str = field(default="", metadata={
        "help": "The dtype the trained weights are kept in, and with them their gradients and "
                "the optimizer's master copy: 'float32' under mixed precision (bf16 / fp16 "
                "autocast), 'bfloat16' in pure bf16 training; '' when unknown (older JSON)."})
    phase_peaks: dict[str, int] = field(default_factory=dict, metadata={
        "help": "Peak live tensor bytes of each phase of the step (before CUDA's workspaces "
                "and rounding), e.g. 'generate (decode)', 'score', 'forward', 'backward', "
                "'optimizer step'; peak_phase names the largest."})

    def __post_init__(self) -> None:
        if not self.required:
            self.required = self.device_used

    @property
    def verdict(self) -> str:
        """``"fits"``, ``"tight"``, ``"does not fit"`` or ``"unknown"`` (docs/fitting.md, the
        verdict): ``fits`` when ``upper`` (``required`` plus the margin) is within ``budget``;
        ``tight`` when ``required`` is and the margin is not (the centre fits: runs like it ran
        at 96-98% of their card, but fragmentation may push it over); ``does not fit`` when
        ``required`` is over the budget, or the run cannot start (``refusals``); ``unknown``
        without a budget, or for a lower bound within it."""
        if self.refusals:
            return DOES_NOT_FIT
        if self.budget is None:
            return UNKNOWN
        if self.required > self.budget:
            return DOES_NOT_FIT
        if self.lower_bound or (self.required_at_least and self.upper > self.budget):
            return UNKNOWN  # the step needs at least this much: the band's side is not known
        return FITS if self.upper <= self.budget else TIGHT

    @property
    def precision(self) -> str:
        """`str`: the step's precision in words: the autocast dtype and the dtype the trained
        weights (their gradients, the optimizer's master copy) are kept in, e.g. ``"bf16
        autocast over fp32 trained weights"`` or ``"pure bf16 (no fp32 master weights)"``."""
        trained = _SHORT_DTYPES.get(self.trained_dtype, self.trained_dtype)
        amp = self.setup.amp
        if amp:
            return f"{amp} autocast over {trained} trained weights" if trained else amp
        if trained == "fp32":
            return "fp32"
        if not trained:  # an estimate saved without it: say no more than is known
            return "no autocast"
        return f"pure {trained} (no fp32 master weights)"

    @property
    def fits(self) -> bool | None:
        """Whether the step is expected to run in ``budget``: True for the verdicts ``fits``
        and ``tight`` (the centre fits), False for ``does not fit``, None for ``unknown``.
        ``verdict`` tells ``fits`` from ``tight``; the planner prefers ``fits``."""
        return {FITS: True, TIGHT: True, DOES_NOT_FIT: False}.get(self.verdict)

    @property
    def to_spare(self) -> int | None:
        """Bytes between ``upper`` and the budget (negative: over it); None without a budget."""
        return None if self.budget is None else self.budget - self.upper

    @property
    def needs_at_least(self) -> bool:
        """Whether ``required`` only bounds what the step needs from below: a lower-bound
        estimate, or one the planner judged to miss its budget (``required_at_least``)."""
        return self.lower_bound or self.required_at_least

    @property
    def upper(self) -> int:
        """What must fit the budget: ``required`` (the smallest memory the step runs in) plus
        the margin. One safety factor: the budget's headroom is for other tenants of the GPU."""
        return self.required + self._margin()

    @property
    def band(self) -> tuple[int, int]:
        """device_used +- ``margin`` (2 sigma: about a 95% band of what NVML shows)."""
        d = self._margin()
        return int(self.device_used - d), int(self.device_used + d)

    def _margin(self) -> int:
        return int(self.margin if self.margin else 2 * self.uncertainty * self.device_used)

    def to_dict(self) -> dict[str, Any]:
        return {
            "peak_allocated": self.peak_allocated, "peak_reserved": self.peak_reserved,
            "device_used": self.device_used, "breakdown": dict(self.breakdown),
            "peak_phase": self.peak_phase, "stage": self.stage, "seq_len": self.seq_len,
            "uncertainty": self.uncertainty, "notes": list(self.notes),
            "model_states": self.model_states, "host_offloaded": self.host_offloaded,
            "device": self.device.to_dict(), "setup": self.setup.to_dict(),
            "cuda_version": self.cuda_version, "margin": self.margin,
            "required": self.required, "required_at_least": self.required_at_least,
            "margin_terms": dict(self.margin_terms),
            "upper": self.upper, "budget": self.budget, "budget_basis": self.budget_basis,
            "fits": self.fits, "verdict": self.verdict, "phase_peaks": dict(self.phase_peaks),
            "refusals": list(self.refusals), "trained_dtype": self.trained_dtype,
        }

    def explain(self) -> str:
        from .._views.text import estimate_table, render_to_text

        return render_to_text(estimate_table(self))

    def __str__(self) -> str:
        return (f"MemoryEstimate({self.stage} on {self.device.name}: device_used "
                f"{format_bytes(self.device_used)}, peak_allocated {format_bytes(self.peak_allocated)}"
                f", peak in {self.peak_phase})")

    def __repr__(self) -> str:
        from .._views.text import estimate_repr

        return estimate_repr(self)

    def _repr_html_(self) -> str:
        from .._views.html import estimate_html

        return estimate_html(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> MemoryEstimate:
        """Inverse of ``to_dict`` (``Plan.from_dict`` reads its candidates' estimates so)."""
        return cls(
            peak_allocated=d["peak_allocated"], peak_reserved=d["peak_reserved"],
            device_used=d["device_used"], breakdown=dict(d["breakdown"]),
            peak_phase=d["peak_phase"], stage=d["stage"],
            device=DeviceInfo.from_dict(d["device"]), setup=TrainingSetup.from_dict(d["setup"]),
            seq_len=d["seq_len"], uncertainty=d["uncertainty"], notes=list(d["notes"]),
            model_states=d.get("model_states", 0), host_offloaded=d.get("host_offloaded", 0),
            cuda_version=d.get("cuda_version"), margin=d.get("margin", 0),
            required=d.get("required") or d["device_used"],
            required_at_least=bool(d.get("required_at_least", False)),
            margin_terms=dict(d.get("margin_terms", {})),
            budget=d.get("budget"), budget_basis=d.get("budget_basis", ""),
            phase_peaks=dict(d.get("phase_peaks", {})), refusals=list(d.get("refusals", [])),
            trained_dtype=d.get("trained_dtype", ""))
