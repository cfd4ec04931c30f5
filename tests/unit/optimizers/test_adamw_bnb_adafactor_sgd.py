"""Optimizer state, hand-computed from each library's state layout, and checked against the
state the real optimizer builds on CPU."""

from __future__ import annotations

import pytest
import torch

from hf_memkit import HfMemkitError
from hf_memkit._optimizers import (
    OptimizerContext,
    ParamInfo,
    get_optimizer_profile,
    supported_optimizers,
)
from tests.helpers import require

BIG = ParamInfo(1000 * 256, (1000, 256), 4)
SMALL = ParamInfo(256, (256,), 4)
EMB = ParamInfo(500 * 64, (500, 64), 4, embedding=True)
CPU = OptimizerContext("cpu")
CUDA = OptimizerContext("cuda")


def test_adamw_torch_hand_computed():
    m = get_optimizer_profile("adamw_torch").estimate([BIG, SMALL], CPU)
    assert m.state == 2 * 4 * (256_000 + 256) + 2 * 4          # exp_avg + exp_avg_sq + step
    assert m.transient == 2 * BIG.nbytes                       # sqrt() and the quotient
    two = get_optimizer_profile("adamw_torch").estimate([BIG, BIG, SMALL], CPU)
    assert two.transient == 3 * BIG.nbytes     # + the previous param's denom, still bound
    assert get_optimizer_profile("adamw_torch").estimate([BIG, BIG, SMALL], CUDA).transient == (
        2 * BIG.nbytes)                        # foreach: one copy of the largest group
    assert get_optimizer_profile("adamw_torch_fused").estimate([BIG], CUDA).transient == 0


def test_bnb_8bit_hand_computed():
    m = get_optimizer_profile("adamw_bnb_8bit").estimate([BIG, SMALL, EMB], CUDA)
    big = 2 * (256_000 + 4 * 1000)        # uint8 state x2 + fp32 absmax per 256-block x2
    small = 2 * 4 * 256                   # < 4096 elements: 32-bit state
    emb = 2 * 4 * 32_000                  # nn.Embedding: the Trainer overrides to 32-bit
    assert m.state == big + small + emb + 2 * 256 * 4   # + the two shared qmaps
    assert m.transient == 0 and m.paged == 0


def test_paged_state_leaves_the_allocator_on_cuda_only():
    huge = ParamInfo(200_000, (200_000,), 4)
    cuda = get_optimizer_profile("paged_adamw_8bit").estimate([huge], CUDA)
    cpu = get_optimizer_profile("paged_adamw_8bit").estimate([huge], CPU)
    assert cuda.paged == 2 * 200_000 and cpu.paged == cpu.paged_resident == 0   # uint8 codes
    assert cuda.state == cpu.state - cuda.paged      # absmax blocks and qmaps stay allocated


def test_adafactor_factored_moments():
    m = get_optimizer_profile("adafactor").estimate([BIG, SMALL], CPU)
    assert m.state == 4 * (1000 + 256) + 4 + 4 * 256 + 4


def test_sgd_momentum_from_optim_args():
    assert get_optimizer_profile("sgd").estimate([BIG], CPU).state == 0
    m = get_optimizer_profile("sgd").estimate([BIG], OptimizerContext("cpu", {"momentum": "0.9"}))
    assert m.state == BIG.nbytes


def real_state_bytes(opt: torch.optim.Optimizer) -> int:
    seen = {}
    for st in opt.state.values():
        for v in st.values():
            if torch.is_tensor(v):
                seen[v.untyped_storage().data_ptr()] = v.untyped_storage().nbytes()
    return sum(seen.values())


@pytest.mark.parametrize("name,make", [
    ("adamw_torch", lambda ps: torch.optim.AdamW(ps)),
    ("adafactor", lambda ps: __import__("transformers").Adafactor(
        ps, lr=1e-3, scale_parameter=False, relative_step=False)),
    ("adamw_bnb_8bit", lambda ps: require("bitsandbytes").optim.AdamW(ps, optim_bits=8)),
    ("lion_8bit", lambda ps: require("bitsandbytes").optim.Lion(ps, optim_bits=8)),
])
def test_state_matches_the_real_optimizer(name, make):
    params = [torch.nn.Parameter(torch.randn(300, 128)), torch.nn.Parameter(torch.randn(128))]
    opt = make(params)
    sum(p.sum() for p in params).backward()
    opt.step()
    infos = [ParamInfo(p.numel(), tuple(p.shape), p.element_size()) for p in params]
    predicted = get_optimizer_profile(name).estimate(infos, CPU).state
    assert predicted == pytest.approx(real_state_bytes(opt), rel=0.001, abs=64)


def test_unknown_optimizer_lists_the_modelled_ones():
    with pytest.raises(HfMemkitError) as e:
        get_optimizer_profile("adamw_torch_fusd")
    msg = str(e.value)
    assert "`adamw_torch_fusd`" in msg and "did you mean `adamw_torch_fused`" in msg
    for name in ("adamw_torch", "adamw_bnb_8bit", "adafactor", "sgd", "lion_8bit"):
        assert name in msg and name in supported_optimizers()
