"""One rank of a run with tensor, context or sequence parallelism (``_engines.dims``).

What a rank computes is a smaller step of the same model, so the trace runs on it directly:

* **TP** (transformers' plan): the rank's model has ``heads / tp`` heads and ``1 / tp`` of the
  MLP width (``_model.tensor_parallel``); weights, gradients, optimizer state and activations
  come out per rank.
* **CP** (torch ring attention over FSDP2, accelerate's ``cp_size``) and **SP** (DeepSpeed
  ALST / Ulysses, ``sp_size``): a rank holds ``S / cp`` (``S / sp``) tokens of every sequence,
  padded to ``2 x cp`` (``sp``), and every layer but attention is the plain model at that
  length. Each attention call adds what the library allocates around the kernel; the trace
  allocates it there (``_cuda.collectives``), so it counts only while that layer's attention
  runs and lands in the allocator replay.

Saved activations do not change: ring attention saves the local query, key, value, output and
logsumexp, as local attention does; Ulysses' attention saves the exchanged query, key and value,
which hold as many bytes as the local ones (``S x heads / sp`` against ``S / sp x heads``),
except key/value heads replicated up to ``sp`` (saved by the traced attention).

TP's collectives (all-reduced hidden states, gathered logits) are added to the phases here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .._engines import ParallelDims
from .._errors import ConfigError
from .._model.spec import ModelSpec
from .._model.tensor_parallel import narrowed, tp_problems
from .._setup.setup import TrainingSetup
from .._units import format_bytes

CP_ATTENTION = ("sdpa", None)   # torch CP patches scaled_dot_product_attention only
SP_ATTENTION = ("sdpa", "flash_attention_2", "flash_attention_3", None)


@dataclass
class RankView:
    """One rank's model and sequence, and the bytes its attention adds per phase."""

    spec: ModelSpec
    seq_len: int
    buffers: dict[str, int] = field(default_factory=dict)   # "forward" / "backward"
    notes: list[str] = field(default_factory=list)

    def add_to(self, phases: dict[str, int]) -> None:
        """Add the buffers to a step's phase totals (backward phases take the backward's)."""
        for k in phases:
            phases[k] += self.buffers.get("backward" if k.startswith("backward") else
                                          "forward" if "forward" in k else "", 0)


def _shape(spec: ModelSpec) -> tuple[int, int, int, int]:
    text = spec.config.get_text_config()
    h = int(text.num_attention_heads)
    kv = int(getattr(text, "num_key_value_heads", None) or h)
    d = int(getattr(text, "head_dim", None) or text.hidden_size // h)
    return h, kv, d, int(text.num_hidden_layers)


def tp_buffers(*, batch: int, local_seq: int, hidden: int, vocab: int, itemsize: int, tp: int,
               gathers_head: bool) -> dict[str, int]:
    """Bytes transformers' tensor parallelism holds on a rank beyond its narrowed model
    (``distributed/tensor_parallel.py``): a rowwise projection's partial output and the
    all-reduced copy coexist (``b x s x H``, as the embedding's lookup); the head's local logits
    (``b x s x V / tp``) while they are gathered to the full vocabulary; in the backward each
    colwise projection's input gradient is all-reduced into a new tensor (``b x s x H``).
    ``gathers_head``: TRL's fused head calls ``full_tensor()`` on the head's weight (``V x H``),
    held from the head's forward to its backward."""
    act = batch * local_seq * hidden * itemsize
    logits = batch * local_seq * -(-vocab // tp) * itemsize
    head = vocab * hidden * itemsize if gathers_head else 0
    return {"forward": max(act, logits) + head, "backward": act}


def _problems(spec: ModelSpec, setup: TrainingSetup, dims: ParallelDims) -> list[str]:
    out = tp_problems(spec, dims.tp) if dims.tp > 1 else []
    h, kv, _, _ = _shape(spec)
    attn = spec.attn_implementation
    if dims.cp > 1 and attn not in CP_ATTENTION:
        out.append(f"cp_size={dims.cp} with attn_implementation={attn!r}: torch's context "
                   "parallelism replaces scaled_dot_product_attention only; use 'sdpa'")
    if dims.sp > 1:
        if (h // dims.tp) % dims.sp:
            ok = [k for k in range(2, h + 1) if h % k == 0]
            out.append(f"sp_size={dims.sp} does not divide the {h} attention heads (Ulysses "
                       f"splits heads across the SP ranks); use sp_size in {ok[:8]}")
        if kv % dims.sp and dims.sp % kv:
            out.append(f"sp_size={dims.sp} and {kv} key/value heads: DeepSpeed needs one to "
                       "divide the other")
        if attn not in SP_ATTENTION:
            out.append(f"sp_size={dims.sp} with attn_implementation={attn!r}: DeepSpeed's "
                       "Ulysses wraps sdpa or flash_attention_2/3")
    opts = setup.trainer_options
    if dims.cp > 1 and opts.get("packing"):
        out.append(f"packing=True with cp_size={dims.cp}: TRL refuses it (context parallelism "
                   "drops the block-diagonal mask); set packing=False")
    if dims.splits_sequence > 1 and not setup.trainer_kind.sequence_split:
        out.append(f"{setup.trainer_kind.title} with cp/sp: not modelled (its rollout or "
                   "paired rows are not split); estimate with cp_size=1 and sp_size=1")
    return out


def rank_view(spec: ModelSpec, setup: TrainingSetup, seq_len: int,
              device_kind: str = "cuda", padded: bool = False) -> RankView:
    """One rank's model, tokens per sequence and the collectives' buffers; ``ConfigError``
    naming the rule for what the libraries refuse."""
    dims = setup.parallel
    if dims.plain:
        return RankView(spec, seq_len)
    problems = _problems(spec, setup, dims)
    if dims.cp > 1 and device_kind != "cuda":
        problems.append(f"cp_size={dims.cp} on a {device_kind} target: torch's ring attention "
                        "runs on CUDA's attention kernels only (it has no rule for the CPU SDPA "
                        "kernel); estimate for a CUDA device")
    if problems:
        raise ConfigError(problems, source="parallelism_config")
    rank_spec = narrowed(spec, dims.tp)
    local = dims.rank_seq(seq_len)
    view = RankView(rank_spec, local)
    if dims.splits_sequence > 1:
        _sequence_buffers(view, setup, dims, seq_len)
    if dims.cp > 1:
        _mask_trap(view, setup, padded)
    if dims.tp > 1:
        _tensor_buffers(view, spec, setup, dims, device_kind)
    return view


def _mask_trap(view: RankView, setup: TrainingSetup, padded: bool) -> None:
    """transformers builds the model's 4D mask before accelerate's hook drops it for the ring
    attention (``masking_utils.create_causal_mask``): with padding in a rank's chunk (``padded``)
    it is ``b x s x s`` booleans, held through the forward. Without an ``attention_mask`` the
    head-tail chunk's positions read as packed sequences and build it too."""
    mask = setup.micro_batch * view.seq_len * view.seq_len
    if padded:
        view.buffers["forward"] = view.buffers.get("forward", 0) + mask
        view.notes.append(f"padded batches under context parallelism: transformers builds a "
                          f"{format_bytes(mask)} boolean mask of each rank's chunk before the "
                          "ring attention drops it; pad every sequence to a multiple of "
                          "2 x cp_size with an all-ones attention_mask to avoid it")
    else:
        view.notes.append("pass an attention_mask (all ones: TRL's collator does): without it "
                          "transformers reads the head-tail chunk's position_ids as packed "
                          f"sequences and builds a {format_bytes(mask)} mask per rank")


def _tensor_buffers(view: RankView, spec: ModelSpec, setup: TrainingSetup, dims: ParallelDims,
                    device_kind: str) -> None:
    text = spec.config.get_text_config()
    fused = device_kind == "cuda" and setup.trainer_kind.step(setup.trainer_options) is not None
    extra = tp_buffers(batch=setup.micro_batch, local_seq=view.seq_len,
                       hidden=int(text.hidden_size), vocab=int(text.vocab_size),
                       itemsize=2 if setup.amp else spec.dtype.itemsize, tp=dims.tp,
                       gathers_head=fused)
    for k, v in extra.items():
        view.buffers[k] = view.buffers.get(k, 0) + v
    view.notes.append(f"tensor parallelism x{dims.tp}: each rank holds 1/{dims.tp} of the "
                      "attention and MLP projections, the head and the input embedding "
                      "(transformers' tp_plan, split by heads, MLP width and vocabulary); norms "
                      "whole; hidden states and logits whole on every rank" +
                      ("; TRL's fused head gathers the head's whole weight" if fused else ""))
    view.notes.extend(setup.engine.parallel_notes(setup.sharding, dims))


def _sequence_buffers(view: RankView, setup: TrainingSetup, dims: ParallelDims,
                      seq_len: int) -> None:
    """The note on one rank's share; the attention buffers themselves are traced where the
    libraries allocate them (``TrainingSetup.sequence_split``, ``_cuda.collectives``)."""
    h, kv, d, _ = _shape(view.spec)
    split = setup.sequence_split()
    fwd, bwd, saved = split.attention_bytes((setup.micro_batch, h, view.seq_len, d), kv,
                                            2 if setup.amp else view.spec.dtype.itemsize)
    if dims.cp > 1:
        what = (f"context parallelism x{dims.cp} (torch ring attention, {dims.cp_comm}): "
                f"{view.seq_len} of {seq_len} tokens per rank (padded to a multiple of "
                f"{dims.sequence_divisor})")
    else:
        what = (f"sequence parallelism x{dims.sp} (DeepSpeed Ulysses): {view.seq_len} of "
                f"{seq_len} tokens per rank (a multiple of {dims.sp}), attention over all of "
                f"them with {h // dims.sp} heads")
    view.notes.append(f"{what}; each layer's attention allocates {format_bytes(fwd)} around "
                      f"its forward and {format_bytes(bwd)} around its backward" +
                      (f" and saves {format_bytes(saved)} more (key/value heads repeated up "
                       f"to sp={dims.sp})" if saved else "") + ", traced where they occur")
