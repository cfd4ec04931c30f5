"""TRL's ``activation_offloading``: saved activations go to pinned host memory, as the trace runs it.

``SFTTrainer`` and ``DPOTrainer`` wrap every ``training_step`` in
``get_act_offloading_ctx_manager(model)`` (TRL 1.16, ``trl/models/activation_offloading.py``),
an ``OffloadActivations`` ``saved_tensors_hooks`` with its defaults: ``use_streams=True``,
``use_pin_memory=True``, ``min_offload_size=1024``, ``max_fwd_stash_size=5``.
``ActivationOffload`` applies the same rules to the fake-tensor trace:

* ``pack_tensor`` (forward): every saved tensor gets an id. It stays on the device (the graph
  keeps it) when its storage is already being offloaded (deduplication by storage, only while
  that storage is in the forward stash; ``StorageKeys``), when it is under ``min_offload_size`` bytes, or when it
  is a parameter or shares a parameter's storage (``update_model_params``). Anything else is
  copied into a pinned host tensor of its size (``torch.empty_like(pin_memory=True)``; a
  broadcast view copies its storage); a non-contiguous view is first made contiguous on the
  device (a clone when its storage offset is not 0). The device tensor is kept in ``fwd_stash``
  until a later offload finds it ``max_fwd_stash_size`` ids behind, then dropped: the graph
  holds only the host copy, and the device memory goes as soon as nothing else uses it.
* ``unpack_tensor_with_streams`` (backward): a tensor still in ``fwd_stash`` is used as it is;
  any other offloaded one comes back as a new device tensor (``.to(device)`` + ``as_strided``),
  kept in ``bwd_tensor_stash`` until the backward hook of the *next* autograd node that unpacks
  (``prev_node_ids``) runs; that first node's hook also empties ``fwd_stash``. What is left is
  dropped at the end of the backward (``queue_callback``).
* The host copies are pinned blocks from torch's ``CachingHostAllocator``, rounded up to a power
  of two and cached for the next micro-step; each is released when its tensor is unpacked.
  ``host_peak`` is the most bytes of them alive at once, the pinned RAM the step needs
  (``MemoryEstimate.host_offloaded``).

Not modelled: the copies' time (they run on a side stream, overlapping compute), and
``NoOpManager`` regions: TRL exempts the model's ``lm_head`` (or ``output``) module, but the
trainers' fused log-prob head reads ``lm_head.weight`` without calling that module, so under
``SFTTrainer``/``DPOTrainer`` nothing is exempt (Liger modules are exempt by a name test that
transformers' Liger patching does not match).

TRL builds ``OffloadActivations`` from ``torch.accelerator.current_accelerator().type``, which
is None on a machine without an accelerator: the trainer fails at construction, so a CPU target
is refused (``refusal``).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from typing import Any

import torch

from .._cuda.host import pinned_block
from .._errors import HfMemkitError

MIN_OFFLOAD_SIZE = 1024      # OffloadActivations defaults, as get_act_offloading_ctx_manager
MAX_FWD_STASH_SIZE = 5       # passes them


def refusal(trainer: str = "SFTTrainer") -> str:
    return (f"activation_offloading=True cannot run on a CPU: {trainer} builds TRL's "
            "OffloadActivations from torch.accelerator.current_accelerator(), which is None "
            "without a GPU (the trainer raises AttributeError). Drop activation_offloading for "
            "CPU training, or estimate for the GPU it will run on with device= (e.g. "
            "device=\"H100-80GB\")")


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


class StorageKeys:
    """``_get_unique_tensor_key`` without address reuse: TRL keys a storage by its address (+
    offset, dtype), and keeps the key of a view it cloned while the view's own storage may be
    freed, so a later tensor that the allocator places at that address can match it; when that
    happens depends on the allocator. Here a storage gets a serial number for its lifetime."""

    def __init__(self) -> None:
        from torch.utils.weak import WeakIdKeyDictionary

        self._serial: Any = WeakIdKeyDictionary()
        self._next = itertools.count()

    def __call__(self, t: torch.Tensor) -> tuple:
        st = t.untyped_storage()
        if st not in self._serial:
            self._serial[st] = next(self._next)
        return self._serial[st], t.storage_offset(), t.dtype


class ActivationOffload:
    """``OffloadActivations`` for one traced model (see the module docstring)."""

    def __init__(self, trainer: str = "SFTTrainer") -> None:
        self.trainer = trainer
        self.param_storages: set[int] = set()
        self._peak = 0
        self._live: _Step | None = None

    @property
    def host_peak(self) -> int:
        """The most pinned host bytes alive at once in any step since ``watch`` (live: a step
        in progress counts)."""
        return max(self._peak, self._live.host_peak if self._live is not None else 0)

    def watch(self, model: torch.nn.Module) -> None:
        """``update_model_params``: the storages of the model's parameters are never
        offloaded."""
        self.param_storages = {_storage(p) for p in model.parameters()}
        self._peak = 0

    @contextlib.contextmanager
    def __call__(self, target: Any) -> Iterator[None]:
        """One ``training_step`` under the offloading hooks (``__enter__`` starts clean)."""
        if target is None:
            raise HfMemkitError(refusal(self.trainer))
        self._live = _Step(self)
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._live.pack, self._live.unpack):
                yield
        finally:
            self._peak, self._live = self.host_peak, None


class _Step:
    """The pack/unpack state of one step."""

    def __init__(self, owner: ActivationOffload) -> None:
        self.params = owner.param_storages
        self.next_id = 0
        self.tracker: dict[int, tuple] = {}      # id -> (tensor or host bytes, offloaded, view)
        self.fwd_stash: dict[int, torch.Tensor] = {}
        self.key_ids: dict[tuple, int] = {}      # storage_to_tensor_id
        self.id_keys: dict[int, tuple] = {}      # _storage_key_by_tensor_id
        self.bwd_stash: dict[int, torch.Tensor] = {}
        self.node: Any = None
        self.first_backward = True
        self.host_live = self.host_peak = 0
        self.key = StorageKeys()

    # ---- forward ----
    def pack(self, t: torch.Tensor) -> int:
        self.next_id += 1
        tid = self.next_id
        key = self.key(t)
        if key in self.key_ids:                  # its storage is already on its way
            self.tracker[tid] = (t, False, None)
            self._track(key, tid)                # (never in fwd_stash: only unpack releases it)
            return tid
        if (t.element_size() * t.nelement() < MIN_OFFLOAD_SIZE
                or isinstance(t, torch.nn.Parameter) or _storage(t) in self.params):
            self.tracker[tid] = (t, False, None)
            return tid
        broadcast = 0 in t.stride()
        if not broadcast and (not t.is_contiguous() or t.storage_offset() != 0):
            t = t.clone(memory_format=torch.contiguous_format) if t.storage_offset() \
                else t.contiguous()
        for old in [i for i in self.fwd_stash if i <= tid - MAX_FWD_STASH_SIZE]:
            self._drop_fwd(old)
        nbytes = t.untyped_storage().nbytes() if broadcast else t.element_size() * t.nelement()
        self.host_live += pinned_block(nbytes)
        self.host_peak = max(self.host_peak, self.host_live)
        view = (t.size(), t.stride(), t.storage_offset(), t.dtype,
                nbytes // t.element_size() if broadcast else None)
        self.tracker[tid] = (nbytes, True, view)
        self.fwd_stash[tid] = t
        self._track(key, tid)
        return tid

    def _track(self, key: tuple, tid: int) -> None:
        self.key_ids[key], self.id_keys[tid] = tid, key

    def _release(self, tid: int) -> None:
        key = self.id_keys.pop(tid, None)
        if key is not None and self.key_ids.get(key) == tid:
            del self.key_ids[key]

    def _drop_fwd(self, tid: int) -> None:
        del self.fwd_stash[tid]
        self._release(tid)

    # ---- backward ----
    def unpack(self, tid: int) -> torch.Tensor:
        if self.first_backward:
            self.first_backward = False
            torch.autograd.variable.Variable._execution_engine.queue_callback(
                self.bwd_stash.clear)
        held, offloaded, view = self.tracker.pop(tid)
        self._release(tid)
        if not offloaded:
            return held
        self.host_live -= pinned_block(held)
        node = torch._C._current_autograd_node()
        prev = []
        if node is not self.node:
            self.node, prev = node, list(self.bwd_stash)
        refs = 0
        if tid in self.fwd_stash:
            t, back = self.fwd_stash[tid], False
        else:  # .to(device) of the host copy, then as_strided to the saved layout
            size, stride, offset, dtype, storage_numel = view
            t = torch.empty(size, dtype=dtype) if storage_numel is None else torch.as_strided(
                torch.empty(storage_numel, dtype=dtype), size, stride, offset)
            self.bwd_stash[tid], back = t, True
            refs = torch._C._storage_Use_Count(_storage(t))
        if node is not None:
            node.register_hook(lambda outputs, inputs: self._after_node(
                tid, back, refs, prev, outputs))
        return t

    def _after_node(self, tid: int, back: bool, refs: int, prev: list[int], outputs: Any) -> Any:
        if back and tid in self.bwd_stash and \
                torch._C._storage_Use_Count(_storage(self.bwd_stash[tid])) > refs:
            del self.bwd_stash[tid]                   # record_stream: freed once used
        for old in list(self.fwd_stash):              # in the backward now
            self._drop_fwd(old)
        for old in prev:
            self.bwd_stash.pop(old, None)
        return outputs
