"""bitsandbytes AdEMAMix and RMSprop (issue 14): state hand-computed from the layout in
bitsandbytes/optim/ademamix.py (AdEMAMix.init_state: state1 (2, *p.shape) = m1, m2; state2 = nu;
absmax1 (2, blocks), absmax2 (blocks); qmap1 / qmap2 shared) and checked against the state the
real optimizer builds on CPU, both built directly and through the Trainer's ``optim`` names."""

from __future__ import annotations

import pytest
import torch

from hf_memkit._optimizers import OptimizerContext, ParamInfo, get_optimizer_profile
from tests.helpers import require
from tests.unit.optimizers.test_adamw_bnb_adafactor_sgd import real_state_bytes

BIG = ParamInfo(1000 * 256, (1000, 256), 4)
ODD = ParamInfo(1000 * 257, (1000, 257), 4)          # 1004 blocks, the last one partial
SMALL = ParamInfo(3000, (50, 60), 4)                 # < min_8bit_size (4096): 32-bit state
EMB = ParamInfo(500 * 64, (500, 64), 4, embedding=True)
CPU = OptimizerContext("cpu")
CUDA = OptimizerContext("cuda")
QMAPS = 2 * 256 * 4   # AdEMAMix: "dynamic" + "udynamic", shared by every param


@pytest.fixture(autouse=True)
def _fresh_bnb_overrides():
    """bitsandbytes keeps the Trainer's embedding overrides in a process-wide singleton, keyed by
    id(param) and by (group, index): clear it around each test so no test inherits another's."""
    def reset():
        try:
            import bitsandbytes
        except ImportError:
            return
        bitsandbytes.optim.GlobalOptimManager.get_instance().initialize()
    reset()
    yield
    reset()


def test_ademamix_8bit_hand_computed():
    m = get_optimizer_profile("ademamix_8bit").estimate([BIG, ODD, SMALL, EMB], CUDA)
    big = 3 * 256_000 + 4 * 3 * 1000       # uint8 m1, m2, nu + fp32 absmax (2, 1000) and (1000,)
    odd = 3 * 257_000 + 4 * 3 * 1004
    small = 3 * 4 * 3000                   # fp32 m1, m2, nu
    emb = 3 * 4 * 32_000                   # the Trainer's nn.Embedding override to 32-bit
    assert m.state == big + odd + small + emb + QMAPS
    assert m.transient == 0 and m.paged == 0        # CUDA kernels update in place


def test_ademamix_32bit_is_three_fp32_copies_and_no_qmaps():
    for name in ("ademamix", "paged_ademamix_32bit"):
        m = get_optimizer_profile(name).estimate([BIG, SMALL, EMB], CPU)
        assert m.state == 3 * 4 * (256_000 + 3000 + 32_000) and m.paged == 0


def test_paged_ademamix_pages_both_buffers_of_big_params_on_cuda_only():
    huge, below = ParamInfo(200_000, (200_000,), 4), ParamInfo(99_999, (99_999,), 4)
    blocks = -(-200_000 // 256)
    cuda = get_optimizer_profile("paged_ademamix_8bit").estimate([huge, below], CUDA)
    assert cuda.paged == cuda.paged_resident == 3 * 200_000   # >= 1e5 elements: managed memory
    assert cuda.state == 3 * 99_999 + 4 * 3 * -(-99_999 // 256) + 4 * 3 * blocks + QMAPS
    cpu = get_optimizer_profile("paged_ademamix_8bit").estimate([huge, below], CPU)
    assert cpu.paged == 0 and cpu.state == cuda.state + cuda.paged
    assert get_optimizer_profile("paged_ademamix_32bit").estimate([huge], CUDA).paged == (
        3 * 4 * 200_000)


def test_ademamix_cpu_step_transient_hand_computed():
    # measured per element of the param being updated (bitsandbytes/backends/cpu/ops.py): 8-bit
    # 9 fp32 copies + the uint8 re-quantised output, 32-bit 4 fp32 copies, +1 fp32 for bf16
    assert get_optimizer_profile("ademamix_8bit").estimate([BIG, EMB], CPU).transient == (
        37 * 256_000)
    # the embedding takes the 32-bit path: 16 B/elt; here it is the larger cost
    big_emb = ParamInfo(700_000, (7000, 100), 4, embedding=True)
    assert get_optimizer_profile("ademamix_8bit").estimate([BIG, big_emb], CPU).transient == (
        max(37 * 256_000, 16 * 700_000))
    assert get_optimizer_profile("ademamix").estimate([BIG], CPU).transient == 16 * 256_000
    bf16 = ParamInfo(256_000, (1000, 256), 2)
    assert get_optimizer_profile("ademamix_8bit").estimate([bf16], CPU).transient == 41 * 256_000


def test_rmsprop_bnb_hand_computed():
    m8 = get_optimizer_profile("rmsprop_bnb_8bit").estimate([ODD, SMALL], CUDA)
    assert m8.state == 257_000 + 4 * 1004 + 4 * 3000 + 256 * 4    # one state, one qmap
    for name in ("rmsprop_bnb", "rmsprop_bnb_32bit"):
        assert get_optimizer_profile(name).estimate([ODD, SMALL], CUDA).state == (
            4 * (257_000 + 3000))


SHAPES = [(300, 128), (1000, 257), (50, 60), (128,)]   # exact blocks, partial block, 2 small


@pytest.mark.parametrize("name,cls,kw", [
    ("ademamix", "AdEMAMix", {"optim_bits": 32}),
    ("ademamix_8bit", "AdEMAMix", {"optim_bits": 8}),
    ("rmsprop_bnb", "RMSprop", {"optim_bits": 32}),
    ("rmsprop_bnb_8bit", "RMSprop", {"optim_bits": 8}),
])
def test_state_matches_the_real_optimizer(name, cls, kw):
    bnb = require("bitsandbytes")
    params = [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]
    opt = getattr(bnb.optim, cls)(params, **kw)
    sum(p.sum() for p in params).backward()
    opt.step()
    infos = [ParamInfo(p.numel(), tuple(p.shape), p.element_size()) for p in params]
    assert get_optimizer_profile(name).estimate(infos, CPU).state == real_state_bytes(opt)


class _Tiny(torch.nn.Module):
    """An embedding (the Trainer overrides it to 32-bit state), an 8-bit-sized matrix with a
    partial last block, small biases and norms; every tensor < 1e5 elements, so the paged
    variants run on CPU too (bitsandbytes pages >= 1e5 with CUDA managed memory only)."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(500, 64)
        self.norm = torch.nn.LayerNorm(64)
        self.up = torch.nn.Linear(64, 300)
        self.down = torch.nn.Linear(300, 257)

    def forward(self, x):
        return self.down(self.up(self.norm(self.emb(x))))


@pytest.mark.parametrize("name", ["ademamix", "ademamix_8bit", "paged_ademamix_32bit",
                                  "paged_ademamix_8bit", "rmsprop_bnb", "rmsprop_bnb_8bit",
                                  "rmsprop_bnb_32bit"])
def test_trainer_optim_name_builds_the_predicted_state(name, tmp_path):
    require("bitsandbytes")
    from transformers import Trainer, TrainingArguments

    model = _Tiny()
    args = TrainingArguments(output_dir=str(tmp_path), optim=name, report_to=[], use_cpu=True)
    opt = Trainer(model=model, args=args).create_optimizer()
    model(torch.randint(0, 500, (2, 8))).sum().backward()
    opt.step()
    embeddings = {id(model.emb.weight)}
    infos = [ParamInfo(p.numel(), tuple(p.shape), p.element_size(), embedding=id(p) in embeddings)
             for p in model.parameters()]
    assert get_optimizer_profile(name).estimate(infos, CPU).state == real_state_bytes(opt)


_STEP_PEAK = r"""
import json, sys, warnings
warnings.filterwarnings("ignore")
import torch, bitsandbytes as bnb
from hf_memkit.testing.groundtruth import open_window, close_window
bits, dtype = int(sys.argv[1]), getattr(torch, sys.argv[2])
p = torch.nn.Parameter(torch.randn(2000, 1000, dtype=dtype))
p.grad = torch.randn_like(p)
opt = bnb.optim.AdEMAMix([p], optim_bits=bits)
opt.step()                                   # builds the state; the next step is steady
w = open_window(0)
opt.step()
print("@@", json.dumps(close_window(w)["peak"]))
"""


@pytest.mark.slow
@pytest.mark.parametrize("name,bits,dtype", [("ademamix_8bit", 8, "float32"),
                                             ("ademamix", 32, "float32"),
                                             ("ademamix_8bit", 8, "bfloat16")])
def test_cpu_step_transient_matches_a_measured_step(name, bits, dtype):
    """The step's peak above its state, read as RSS in a child (MALLOC_MMAP_THRESHOLD_=65536:
    each tensor >= 64 KiB is its own mapping), against the modelled transient."""
    require("bitsandbytes")
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", _STEP_PEAK, str(bits), dtype], env=env,
                         capture_output=True, text=True, timeout=300, check=True).stdout
    measured = json.loads(next(ln[3:] for ln in out.splitlines() if ln.startswith("@@ ")))
    p = ParamInfo(2_000_000, (2000, 1000), torch.empty(0, dtype=getattr(torch, dtype)).itemsize)
    predicted = get_optimizer_profile(name).estimate([p], CPU).transient
    assert predicted == pytest.approx(measured, rel=0.03)
