"""Paged bitsandbytes optimizers: which state the real optimizer puts in CUDA managed memory.

bitsandbytes builds every pageable buffer through ``Optimizer8bit.get_state_buffer`` (on CUDA:
``F.get_paged``, ``cudaMallocManaged``, for ``numel >= 1e5``); everything else in its state
(absmax blocks, qmaps) is an ordinary tensor. On CPU it keeps the layout and warns that paging
is off, so the real optimizer's state, split by whether ``get_state_buffer`` made it, gives the
paged and the resident bytes a CUDA step would have: checked against the estimate for CUDA."""

from __future__ import annotations

import warnings

import pytest
import torch

from hf_memkit._optimizers import OptimizerContext, ParamInfo, get_optimizer_profile
from tests.helpers import require

PAGED_MIN = 100_000  # bitsandbytes/optim/optimizer.py get_state_buffer: `p.numel() < 1e5`


def _split_state(opt: torch.optim.Optimizer, made: set[int]) -> tuple[int, int, int]:
    """(paged, largest paged param's paged bytes, resident) of ``opt``'s real state: a buffer
    ``get_state_buffer`` made for a param of >= 1e5 elements is paged on CUDA."""
    paged, at_once, resident, seen = 0, 0, 0, set()
    for p, st in opt.state.items():
        mine = 0
        for v in st.values():
            if not torch.is_tensor(v) or v.untyped_storage().data_ptr() in seen:
                continue
            seen.add(v.untyped_storage().data_ptr())
            n = v.untyped_storage().nbytes()
            if id(v) in made and p.numel() >= PAGED_MIN:
                mine += n
            else:
                resident += n
        paged += mine
        at_once = max(at_once, mine)
    return paged, at_once, resident


@pytest.mark.parametrize("name,cls", [("paged_adamw_8bit", "PagedAdamW8bit"),
                                      ("paged_adamw_32bit", "PagedAdamW32bit"),
                                      ("paged_lion_8bit", "PagedLion8bit")])
# (PagedAdEMAMix8bit cannot step on CPU: its _get_state_double_buffer calls F.get_paged without
# get_state_buffer's CPU fallback; test_bnb_ademamix_rmsprop covers its layout by hand)
def test_paged_and_resident_state_match_the_real_optimizer(name, cls):
    bnb = require("bitsandbytes")
    shapes = [(512, 256), (300, 512), (384, 128), (64,)]   # 131072, 153600, 49152, 64 elements
    params = [torch.nn.Parameter(torch.randn(*s)) for s in shapes]
    opt = getattr(bnb.optim, cls)(params)
    made: set[int] = set()      # the buffers get_state_buffer returns (it still makes them)
    original = opt.get_state_buffer

    def recorded(*a, **kw):
        out = original(*a, **kw)
        made.add(id(out))
        return out
    opt.get_state_buffer = recorded
    sum(p.sum() for p in params).backward()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # "Paged optimizers are not supported on CPU"
        opt.step()
    paged, at_once, resident = _split_state(opt, made)
    infos = [ParamInfo(p.numel(), tuple(p.shape), p.element_size()) for p in params]
    m = get_optimizer_profile(name).estimate(infos, OptimizerContext("cuda"))
    assert (m.paged, m.paged_resident) == (paged, at_once)
    assert m.state == pytest.approx(resident, abs=64)    # the step counters bnb keeps as ints
    assert 0 < at_once < paged                            # two params page, one at a time


def test_paged_state_counts_outside_device_used_but_its_step_pages_inside():
    """The estimate of a paged optimizer on a CUDA target: device_used holds the largest
    parameter's pages, not all of the paged state, and explain() says where the rest is."""
    require("bitsandbytes")
    from transformers import LlamaConfig

    import hf_memkit as mk

    config = LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, vocab_size=1000)
    args = dict(per_device_train_batch_size=1, optim="paged_adamw_32bit")
    paged = mk.estimate_memory(config, args, seq_len=64, device="A100-80GB")
    plain = mk.estimate_memory(config, dict(args, optim="adamw_bnb_8bit"), seq_len=64,
                               device="A100-80GB")
    b = paged.breakdown
    assert 0 < b["optimizer_paged_resident"] < b["optimizer_paged"]
    assert paged.device_used == paged.peak_reserved + b["context"] + b["optimizer_paged_resident"]
    assert any("outside device memory" in n for n in paged.notes)
    assert "outside device memory" in paged.explain()
    assert "optimizer_paged" not in plain.breakdown
