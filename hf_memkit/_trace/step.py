"""Trace one training (or eval) step of the real model code on fake tensors.

This is the only module that touches private torch APIs (docs/style.md §11):
``torch._subclasses.fake_tensor.FakeTensorMode`` and
``torch.distributed._tools.mem_tracker.MemTracker``. If they are missing or change, the error says
that activation estimates are lost and which torch to use.

Recipe (checked on torch 2.13 CPU, transformers 5.23):
  * the model is built *inside* FakeTensorMode (``_from_config`` on fake tensors: init runs on
    metadata only, tied weights stay tied);
  * mixed precision wraps ``forward`` the way ``Accelerator.prepare_model`` does: autocast, then
    ``convert_outputs_to_fp32``;
  * an all-ones attention mask is dropped: the real run skips a mask after a data-dependent
    ``mask.all()`` check that fake tensors cannot decide, so keeping it would trace a 4-D mask the
    real run never builds. Padded batches keep their mask;
  * transformers treats fake tensors as "tracing" and refuses its data-dependent mask shortcuts:
    ``masking_utils.find_packed_sequence_indices`` (reached when there is no attention mask and
    no cache, e.g. under checkpointing) cannot prove a batch unpacked and a (B,1,T,T) mask gets
    built. The real run decides "not packed" for ordinary batches, so the trace patches it;
  * MemTracker runs inside the fake mode; a fresh tracker per micro-step.
"""

from __future__ import annotations

import contextlib
import copy
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import MethodType
from typing import Any

import torch

from .._compat import quiet_notices
from .._cuda.collectives import SequenceSplit
from .._cuda.emulation import emulate_cuda
from .._cuda.events import EventLog
from .._cuda.target import CudaTarget
from .._errors import HfMemkitError
from .._model.adapters import LoraSpec, cast_adapters, quantizable_linears
from .._model.facts import block_stacks, layer_count
from .micro import eval_step, train_micro_step
from .quant import SimLinear4bit

try:  # private torch APIs, fenced here and nowhere else
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.common_utils import get_untyped_storages
    from torch.distributed._tools.mem_tracker import MemTracker
except Exception as _exc:  # pragma: no cover - depends on the torch build
    FakeTensorMode = MemTracker = get_untyped_storages = None  # type: ignore[assignment]
    _IMPORT_ERROR: Exception | None = _exc
else:
    _IMPORT_ERROR = None

CPU = torch.device("cpu")
# ops that run through cuBLAS on CUDA (aten/src/ATen/native/cuda/Blas.cpp): the first of each
# thread allocates its cuBLAS workspace (``EventLog.matmul``); linear and matmul reach these
_CUBLAS_OPS = frozenset(getattr(torch.ops.aten, name) for name in (
    "mm", "addmm", "bmm", "baddbmm", "addbmm", "_addmm_activation", "mv", "addmv", "dot",
    "vdot", "addr") if hasattr(torch.ops.aten, name))


def require_tracing() -> None:
    if _IMPORT_ERROR is not None:
        raise HfMemkitError(
            "activation tracing needs torch's FakeTensorMode and "
            "torch.distributed._tools.mem_tracker.MemTracker (torch >= 2.5); this torch "
            f"({torch.__version__}) lacks them ({_IMPORT_ERROR}), so activations and temporaries "
            "cannot be estimated. Install torch >= 2.5"
        )


@dataclass
class TraceResult:
    """Bytes seen by MemTracker on fake tensors (CPU semantics: exact, unrounded).

    ``phases`` maps a phase of the step to its peak total (weights and inputs included):
    ``forward``/``backward`` of micro-step 1 (no gradients yet) and ``forward_accum`` /
    ``backward_accum`` of micro-step 2 (gradients of micro-step 1 alive), or ``eval``.
    The peak moves between phases with depth (e.g. autocast's weight cache at the end of the
    forward vs the logits at the start of the backward), so each is extrapolated on its own.
    """

    num_layers: int
    weights: int                 # params + buffers of the traced model
    grads: int                   # gradient bytes of its trainable params
    inputs: int                  # the micro-batches alive during the step
    phases: dict[str, int] = field(default_factory=dict)
    categories: dict[str, dict[str, int]] = field(default_factory=dict)  # per phase, at its peak
    seconds: float = 0.0
    sdpa_kernels: tuple[str, ...] = ()   # the CUDA kernel of each SDPA call (CUDA targets)
    cuda_dropout: bool = False           # CUDA's fused dropout ran (CUDA targets)
    events: EventLog | None = None       # CUDA targets: allocations and frees, for the replay
    trainable: tuple[int, ...] = ()      # bytes of each trainable parameter, in model order
    reference: int = 0                   # weights of a reference model copy (in ``weights``)
    host: int = 0                        # pinned host bytes a trainer's offloading held at once

    @property
    def peak(self) -> int:
        return max(self.phases.values())


def enable_checkpointing(model: torch.nn.Module, kwargs: dict[str, Any]) -> None:
    """transformers 5 renamed gradient_checkpointing_enable; call whichever is installed."""
    new = getattr(model, "activation_checkpointing_enable", None)
    if new is not None:
        new(activation_checkpointing_kwargs=kwargs)
    else:  # transformers < 5
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if getattr(model.config, "use_cache", False):
        model.config.use_cache = False  # what the Trainer's checkpointing does (no KV cache)


def _wrap_amp(model: torch.nn.Module, amp: str) -> None:
    """What Accelerator.prepare_model does for native AMP."""
    from accelerate.utils import convert_outputs_to_fp32

    dtype = torch.bfloat16 if amp == "bf16" else torch.float16
    forward = torch.autocast(device_type="cpu", dtype=dtype)(model.forward.__func__)
    model.forward = MethodType(convert_outputs_to_fp32(forward), model)


def make_batch(task: str, batch: int, seq_len: int, *, target_len: int | None = None,
               padded: bool = False, config: Any = None) -> dict[str, torch.Tensor]:
    """One micro-batch as the default collators produce it (call inside the fake mode); the
    labels are the task's for ``config`` (``_model.tasks``)."""
    from .._model.tasks import TASKS

    b: dict[str, torch.Tensor] = {"input_ids": torch.zeros(batch, seq_len, dtype=torch.long)}
    if padded:
        b["attention_mask"] = torch.ones(batch, seq_len, dtype=torch.long)
    b.update(TASKS.get(task).labels_for(config, batch, seq_len, target_len or seq_len))
    return b


@contextlib.contextmanager
def _unpacked_sequences(packed: bool = False):
    """Ordinary batches are not packed (see the module docstring); a padding-free batch is, and
    ``find_packed_sequence_indices`` returns its sequence index on fake tensors as it is."""
    if packed:
        yield
        return
    try:
        import transformers.masking_utils as mu
    except ImportError:  # transformers without masking_utils: nothing to patch
        yield
        return
    original = getattr(mu, "find_packed_sequence_indices", None)
    if original is None:
        yield
        return
    mu.find_packed_sequence_indices = lambda *a, **k: None
    try:
        yield
    finally:
        mu.find_packed_sequence_indices = original


class _NoHook:
    def remove(self) -> None:
        pass


if MemTracker is not None:

    class _GlobalPeakTracker(MemTracker):
        """MemTracker keeping only the global peak. The stock ``_update_peak_stats`` also walks
        every tracked module's stats on every op (quadratic in model size; 80% of a 70B plan's
        time); we never read per-module peaks."""

        def _update_peak_stats(self, peak_state: Any) -> None:
            for dev, snap in self._curr_mem_snap.items():
                if self._peak_mem.get(dev, 0) < snap["Total"]:
                    self._peak_mem[dev] = snap["Total"]
                    self._peak_mem_snap[dev] = dict(snap)

        log: EventLog | None = None  # allocation/free events for the allocator replay

        def _log_new(self, t: torch.Tensor) -> None:
            if self.log is not None:
                for st in get_untyped_storages(t):
                    winfo = self._WINFO[st][0]
                    if not hasattr(winfo, "mk_key"):
                        winfo.mk_key = self.log.seen(st, winfo.mem_consumed)

        def _update_and_maybe_create_winfos(self, t, reftype, update_existing=False):
            winfos = super()._update_and_maybe_create_winfos(t, reftype, update_existing)
            self._log_new(t)
            return winfos

        def _track(self, reftype, t) -> None:
            super()._track(reftype, t)
            self._log_new(t)

        def _track_module_params_and_buffers(self, module, install_grad_hooks=True):
            # the stock tracker hooks every parameter's gradient and fails on a frozen one (a
            # LoRA base; adapters peft's disable_adapter() freezes mid-step): a no-op handle
            for p in module.parameters():
                if not p.requires_grad and self._param_to_grad_hook_handles.get(p) is None:
                    self._param_to_grad_hook_handles[p] = (_NoHook(), _NoHook())
            return super()._track_module_params_and_buffers(module, install_grad_hooks)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            res = super().__torch_dispatch__(func, types, args, kwargs)
            if self.log is not None and func.overloadpacket in _CUBLAS_OPS:
                self.log.matmul()  # where CUDA's cuBLAS workspace of this thread is allocated
            return res

        def _delete_callback(self, winfo, w_st) -> None:
            super()._delete_callback(winfo, w_st)
            if self.log is not None and hasattr(winfo, "mk_key"):
                self.log.gone(winfo.mk_key)


def new_tracker(model: torch.nn.Module, inputs: list[Any], log: EventLog | None = None,
                stacks: list[list[torch.nn.Module]] = ()) -> Any:
    """A MemTracker over ``model`` and ``inputs`` (logging allocations into ``log``, each tagged
    with the block of ``stacks`` it happens in). torch's MemTracker registers a gradient hook on
    every parameter and fails on frozen ones (a LoRA base): ``_GlobalPeakTracker`` gives those a
    no-op handle."""
    mt = _GlobalPeakTracker()
    mt.log = log
    if log is not None:
        _tag_blocks(log, stacks)
        log.context = _block_context(mt, stacks)
    mt.track_external(model, *inputs)
    return mt


def _tag_blocks(log: EventLog, stacks: list[list[torch.nn.Module]]) -> None:
    """Each block's weights belong to that block (``EventLog.owner``)."""
    log.blocks = len(stacks[0]) if stacks else 0
    for s, stack in enumerate(stacks):
        for i, block in enumerate(stack):
            for t in (*block.parameters(), *block.buffers()):
                for st in get_untyped_storages(t):
                    log.weight_owner.setdefault(st._cdata, (s, i))


def _block_context(mt: Any, stacks: list[list[torch.nn.Module]]) -> Callable[[], tuple]:
    """The block running now (from MemTracker's module tracker: the modules whose forward or
    backward is under way) and whether autograd's backward runs."""
    tracker = mt._mod_tracker
    modules = {id(b): (s, i) for s, stack in enumerate(stacks) for i, b in enumerate(stack)}
    blocks = [b for stack in stacks for b in stack]
    names: dict[str, tuple[int, int]] = {}

    def here() -> tuple:
        if len(names) < len(blocks):  # names are given as the tracker first meets a module
            known = tracker._known_modules
            for b in blocks:
                name = known.get(b)
                if name is not None:
                    names[name] = modules[id(b)]
        block = next((names[p] for p in tracker.parents if p in names), None)
        return block, torch._C._current_graph_task_id() != -1

    return here


def _reset_peak(mt: Any) -> None:
    """Start a new peak window at the current total (what MemTracker.__enter__ does)."""
    mt._peak_mem_snap = mt.get_tracker_snapshot()
    mt._peak_mem = {dev: snap["Total"] for dev, snap in mt._peak_mem_snap.items()}


def _snap(mt: Any, kind: str) -> dict[str, int]:
    snap = mt.get_tracker_snapshot(kind).get(CPU, {})
    return {str(getattr(k, "value", k)): int(v) for k, v in snap.items()}


def _nbytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        key = id(t)
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


def build_fake(model_cls: type, config: Any, *, fm: Any, attn_implementation: str | None,
               dtype: torch.dtype, lora: LoraSpec | None) -> torch.nn.Module:
    """The model with fake parameters: built on meta (adapters included), then every parameter
    and buffer swapped for a fake CPU tensor of the same shape and dtype, memoised by identity so
    tied weights stay tied. (``to_empty`` inside the fake mode refuses meta tensors, and peft's
    ``.to()`` cannot swap fake parameters, so the swap is done by hand.)"""
    kwargs: dict[str, Any] = {"dtype": dtype}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    config = copy.deepcopy(config)  # building and checkpointing mutate the config
    with torch.device("meta"):
        model = model_cls._from_config(config, **kwargs)
        if lora is not None:
            import peft

            from .._compat import quiet_peft

            with quiet_peft():
                model = peft.get_peft_model(model, copy.deepcopy(lora.peft_config))
            cast_adapters(model, lora.adapter_dtype)
            if lora.quantized_4bit:
                base = model.get_base_model()
                for name, linear in quantizable_linears(base):
                    parent_name, _, child = name.rpartition(".")
                    parent = base.get_submodule(parent_name) if parent_name else base
                    setattr(parent, child, SimLinear4bit(linear, lora.compute_dtype))
    memo: dict[int, torch.Tensor] = {}
    with fm:
        for module in model.modules():
            for registry in (module._parameters, module._buffers):
                for name, t in list(registry.items()):
                    if t is None:
                        continue
                    if id(t) not in memo:
                        e = torch.empty(t.shape, dtype=t.dtype, device="cpu")
                        memo[id(t)] = (torch.nn.Parameter(e, requires_grad=t.requires_grad)
                                       if isinstance(t, torch.nn.Parameter) else e)
                    registry[name] = memo[id(t)]
    return model


def _batch(task: str, batch: int, seq_len: int, *, target_len: int | None, padded: bool,
           config: Any, packed: bool, labels: bool) -> dict[str, torch.Tensor]:
    b = make_batch(task, batch, seq_len, target_len=target_len, padded=padded, config=config)
    if packed:  # padding-free: the sequence boundaries are in position_ids
        b["position_ids"] = torch.zeros_like(b["input_ids"])
    if not labels:
        b.pop("labels", None)
    return b


def _models(model_cls: type, config: Any, *, fm: Any, attn_implementation: str | None,
            dtype: torch.dtype, lora: LoraSpec | None, hooks: Sequence[Callable[..., None]],
            stage: str, target: CudaTarget | None, amp: str | None, trainer: Any,
            reference: str | None) -> tuple[torch.nn.Module, torch.nn.Module | None]:
    """The fake model as the trainer runs it (techniques' hooks, the trainer's patches, mixed
    precision), and the frozen reference copy when the trainer holds one."""
    model = build_fake(model_cls, config, fm=fm, attn_implementation=attn_implementation,
                       dtype=dtype, lora=lora)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    for hook in hooks:
        hook(base, stage=stage, adapters=lora is not None, target=target)
    ref = None
    if trainer is not None:
        trainer.prepare(base, adapters=lora is not None)
        if reference == "copy":
            ref = build_fake(model_cls, config, fm=fm, attn_implementation=attn_implementation,
                             dtype=dtype, lora=None).requires_grad_(False).eval()
            trainer.prepare_reference(ref)
    model.train(stage == "train")
    for m in (model, ref) if amp else ():
        if m is not None:
            _wrap_amp(m, amp)
    if reference == "adapters" and lora is not None:
        # the policy with its adapters disabled, as module objects of its own (the tracker
        # refuses a second forward of the same modules in one step) over the same tensors
        shared = {id(t): t for t in (*model.parameters(), *model.buffers())}
        ref = copy.deepcopy(model, memo=shared)
    return model, ref


@quiet_notices()  # transformers' notices about the traced model are not the user's to act on
def trace_step(model_cls: type, config: Any, *, task: str, micro_batch: int, seq_len: int,
               grad_accum: int = 1, amp: str | None = None, dtype: torch.dtype = torch.float32,
               attn_implementation: str | None = None, lora: LoraSpec | None = None,
               stage: str = "train", target_len: int | None = None,
               padded: bool = False, loss: str = "labels",
               hooks: Sequence[Callable[..., None]] = (),
               forward_only: bool = False, target: CudaTarget | None = None,
               trainer: Any = None, reference: str | None = None,
               packed: bool = False, split: SequenceSplit | None = None) -> TraceResult:
    """Peak bytes of one forward(+loss+backward) of ``config`` on fake tensors.

    ``hooks``: the setup's techniques, ``hook(model, stage=, adapters=, target=)`` on the fake
    (base) model. ``forward_only``: trace only the first micro-step's forward (a lower bound).
    ``target``: a CUDA target to trace as CUDA runs it (``_cuda.emulation``: CUDA's autocast
    policy, SDPA kernel and dropout); None traces this CPU's behaviour.

    ``loss="labels"`` is the Trainer's path (the model's own loss from ``labels``);
    ``loss="logits_sum"`` feeds no labels and backpropagates ``logits.sum()``, as some published
    benchmarks do (docs/anchors.md, note_sdpa_training_benchmark_script). ``trainer``: a
    ``_trainers.TraceStep`` whose loss replaces the model's (TRL's fused head); ``reference``
    "copy": a frozen copy of the model serves as its reference (DPO), held with the weights.
    ``packed``: padding-free rows (sequence boundaries in ``position_ids``). ``split``: the
    sequence is one rank's share of a longer one (context / sequence parallelism, CUDA targets):
    each attention call adds what the library allocates around it (``_cuda.collectives``).
    """
    if loss not in ("labels", "logits_sum"):
        raise HfMemkitError(f"loss must be 'labels' or 'logits_sum', got {loss!r}")
    require_tracing()
    t0 = time.perf_counter()
    fm = FakeTensorMode(allow_non_fake_inputs=False)
    model, ref = _models(model_cls, config, fm=fm, attn_implementation=attn_implementation,
                         dtype=dtype, lora=lora, hooks=hooks, stage=stage, target=target,
                         amp=amp, trainer=trainer, reference=reference)
    n_micro = min(grad_accum, 2) if stage == "train" else 1
    with fm:
        batches = [_batch(task, micro_batch, seq_len, target_len=target_len, padded=padded,
                          config=config, packed=packed, labels=loss == "labels")
                   for _ in range(max(grad_accum, 1) if stage == "train" else 1)]
    params = [p for p in model.parameters() if p.requires_grad]
    ref_bytes = _nbytes(list(ref.parameters()) + list(ref.buffers())) \
        if ref is not None and reference == "copy" else 0
    weights = _nbytes(list(model.parameters()) + list(model.buffers())) + ref_bytes
    grads = _nbytes(params)
    all_inputs = [t for b in batches for t in b.values()]
    inputs = sum(t.numel() * t.element_size() for t in all_inputs)
    phases: dict[str, int] = {}
    categories: dict[str, dict[str, int]] = {}

    def record(mt: Any, name: str) -> None:
        snap = _snap(mt, "peak")
        phases[name] = snap.get("Total", 0)
        categories[name] = snap
        _reset_peak(mt)

    kernels, dropout = [], False  # SDPA kernels CUDA picks; whether its fused dropout ran
    log = EventLog() if target is not None and not forward_only else None
    stacks = block_stacks([model, ref], layer_count(config)) if log is not None else []
    for i in range(1 if forward_only else n_micro):
        # a fresh tracker per micro-step registers the gradients the previous one left as such
        mt = new_tracker(model, all_inputs + ([ref] if ref is not None else []), log, stacks)
        if log is not None:
            log.mark(f"micro{i}")
        with fm, mt, _unpacked_sequences(packed), emulate_cuda(target, split) as cuda_ops, \
                trainer.context(target) if trainer is not None else contextlib.nullcontext():
            if stage == "train":
                train_micro_step(model, batches[i], loss, grad_accum, "_accum" if i else "",
                                  lambda name, _mt=mt: record(_mt, name), forward_only,
                                  trainer, ref)
            else:
                eval_step(model, batches[0], trainer, ref, mt, record)
            if cuda_ops is not None and i == 0:
                kernels, dropout = list(cuda_ops.kernels), cuda_ops.dropout
    return TraceResult(num_layers=layer_count(config), weights=weights, grads=grads,
                       inputs=inputs, phases=phases, categories=categories, events=log,
                       seconds=time.perf_counter() - t0, sdpa_kernels=tuple(kernels),
                       cuda_dropout=dropout, trainable=tuple(p.numel() * p.element_size()
                                                             for p in params),
                       reference=ref_bytes, host=trainer.host_peak() if trainer else 0)
