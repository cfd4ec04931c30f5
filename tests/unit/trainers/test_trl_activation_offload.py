"""TRL's ``activation_offloading`` (issue #14): the trace's offloading hooks (``_trainers/offload``)
against TRL's own ``OffloadActivations``, and what the estimate makes of them.

TRL's class needs an accelerator; here it runs on real CPU tensors with the accelerator faked as
the CPU (``torch.accelerator.current_accelerator`` -> cpu, so "on the device" means on the CPU;
``torch.cpu`` lacks ``Stream.synchronize`` and ``empty_cache``, given no-ops) and unpinned host copies. Its
tracker then says which saved tensors it offloaded and what it kept; the mirror must decide the
same on the same step, and hold the same bytes after the forward and at the backward's peak. TRL's storage key (an address) is swapped for ``StorageKeys`` (a serial
number per live storage), as the mirror keys storages: which freed address malloc hands out
next is not something either run should depend on."""

from __future__ import annotations

import warnings
from unittest import mock

import pytest

from tests.helpers import require

require("trl")

import torch  # noqa: E402
from torch.distributed._tools.mem_tracker import MemTracker  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import hf_memkit as mk  # noqa: E402
from hf_memkit._cuda.host import pinned_block  # noqa: E402
from hf_memkit._errors import HfMemkitError  # noqa: E402
from hf_memkit._trainers.offload import ActivationOffload, StorageKeys  # noqa: E402

CFG = LlamaConfig(hidden_size=128, intermediate_size=344, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=1000,
                  tie_word_embeddings=False)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return LlamaForCausalLM(CFG).train()


def _batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(0, CFG.vocab_size, (2, 64), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids.clone()}


def _live(mt: MemTracker) -> int:
    return int(sum(s["Total"] for s in mt.get_tracker_snapshot("current").values()))


class _BackwardPeak(TorchDispatchMode):
    """The most bytes "on the device" after any op of the backward: all alive, less what
    ``host()`` says are host copies (a fresh copy is not yet in TRL's tracker while it is being
    filled, so the forward is read after it, not op by op)."""

    def __init__(self, mt: MemTracker, host=lambda: 0) -> None:
        super().__init__()
        self.mt, self.host, self.peak, self.on = mt, host, 0, False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.on:
            self.peak = max(self.peak, _live(self.mt) - self.host())
        return out


def _trl_step(model: torch.nn.Module) -> dict[str, int]:
    """TRL's OffloadActivations over one forward + backward, read after the forward."""
    from trl.models import activation_offloading as ao

    with mock.patch.object(torch.accelerator, "current_accelerator",
                           lambda *a, **k: torch.device("cpu")):
        ctx = ao.OffloadActivations(use_pin_memory=False)
    ctx.update_model_params(model)
    batch = _batch()
    keys = StorageKeys()
    with mock.patch.object(torch.cpu.Stream, "synchronize", lambda self: None, create=True), \
            mock.patch.object(torch.cpu, "empty_cache", lambda: None, create=True), \
            mock.patch.object(ao, "_get_unique_tensor_key", keys), MemTracker() as mt:
        mt.track_external(model, *batch.values())
        before = _live(mt)
        host_now = lambda: sum(v[0].untyped_storage().nbytes()  # noqa: E731
                               for v in ctx.tracker.values() if v[1])
        with ctx, _BackwardPeak(mt, host_now) as bwd:
            loss = model(**batch).loss
            copies = [v[0] for v in ctx.tracker.values() if v[1]]
            host = sum(t.untyped_storage().nbytes() for t in copies)
            out = {"offloaded": len(copies), "kept": len(ctx.tracker) - len(copies),
                   "host": sum(pinned_block(t.untyped_storage().nbytes()) for t in copies),
                   # what stays "on the device": all that is alive less the host copies
                   "device": _live(mt) - before - host}
            del copies
            bwd.on = True
            loss.backward()
        out["tracked_after"] = len(ctx.tracker)
    out["backward"] = bwd.peak - before
    return out


def _mirror_step(model: torch.nn.Module) -> dict[str, int]:
    off = ActivationOffload()
    off.watch(model)
    batch = _batch()
    with MemTracker() as mt:
        mt.track_external(model, *batch.values())
        before = _live(mt)
        with off(target="cuda"), _BackwardPeak(mt) as bwd:
            loss = model(**batch).loss
            out = {"host": off.host_peak, "device": _live(mt) - before}
            bwd.on = True
            loss.backward()
    out["host_after"] = off.host_peak
    out["backward"] = bwd.peak - before
    return out


def test_the_trace_offloads_what_trls_offload_activations_offloads():
    model = _model()
    trl_run = _trl_step(model)
    model.zero_grad(set_to_none=True)
    mirror = _mirror_step(model)
    assert trl_run["offloaded"] > 10 and trl_run["kept"] > 0   # both rules are exercised
    assert trl_run["tracked_after"] == 0                       # TRL unpacked everything
    # the host copies TRL made, block for block (host_peak is read live in the forward)
    assert mirror["host"] == trl_run["host"]
    # and what the step keeps on the device after the forward: the same bytes
    assert mirror["device"] == trl_run["device"]
    assert mirror["host_after"] == mirror["host"]              # backward only releases
    # the backward's peak on the device: tensors coming back node by node, freed a node later
    assert mirror["backward"] == trl_run["backward"]


def test_offloading_keeps_less_on_the_device_than_the_graph_would():
    model = _model()
    batch = _batch()
    with MemTracker() as mt:
        mt.track_external(model, *batch.values())
        before = _live(mt)
        with _BackwardPeak(mt) as bwd:
            loss = model(**batch).loss
            plain = _live(mt) - before
            bwd.on = True
            loss.backward()
    model.zero_grad(set_to_none=True)
    mirror = _mirror_step(model)
    assert mirror["device"] < 0.7 * plain
    assert mirror["backward"] < 0.8 * (bwd.peak - before)


# for the estimates: layers' activations, not the fused head's tile buffer, set the peak
ECFG = LlamaConfig(hidden_size=512, intermediate_size=1376, num_hidden_layers=4,
                   num_attention_heads=8, num_key_value_heads=4, vocab_size=1000,
                   tie_word_embeddings=False)


def _est(args, device="H100-80GB", **kw):
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        e = mk.estimate_memory(ECFG, {"bf16": True, "per_device_train_batch_size": 4,
                                      "gradient_checkpointing": False,  # SFTConfig: True
                                      "max_length": 512, **args}, device=device, **kw)
    assert not [w for w in rec if "activation_offloading" in str(w.message)]
    return e


def test_sft_estimate_moves_activations_to_pinned_host_memory():
    plain = _est({}, trainer="sft")
    off = _est({"activation_offloading": True}, trainer="sft")
    assert plain.host_offloaded == 0
    held = ("activations", "temporaries")
    saved = sum(plain.breakdown[k] - off.breakdown[k] for k in held)
    assert off.peak_allocated < plain.peak_allocated - 0.2 * sum(plain.breakdown[k] for k in held)
    # the device saves only what went to the host (the copies are more: a tensor saved again
    # after its first copy left the stash is copied again, in power-of-two pinned blocks)
    assert saved < off.host_offloaded
    assert any("activation offloading keeps" in n for n in off.notes)


def test_dpo_reference_forward_adds_nothing_to_the_host():
    args = {"activation_offloading": True, "per_device_train_batch_size": 2}
    with_ref = _est(args, trainer="dpo")
    precomputed = _est({**args, "precompute_ref_log_probs": True}, trainer="dpo")
    assert with_ref.host_offloaded == precomputed.host_offloaded > 0


def test_checkpointing_leaves_only_layer_inputs_to_offload():
    full = _est({"activation_offloading": True}, trainer="sft")
    ckpt = _est({"activation_offloading": True, "gradient_checkpointing": True}, trainer="sft")
    assert 0 < ckpt.host_offloaded < full.host_offloaded / 4


def test_cpu_target_is_refused_with_the_fix():
    with pytest.raises(HfMemkitError, match=r"activation_offloading=True cannot run on a CPU.*"
                                            r"device="):
        _est({"activation_offloading": True, "bf16": False}, device="cpu", trainer="sft")
