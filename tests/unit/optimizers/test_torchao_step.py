"""torchao's low-bit AdamW step transient: the CPU figure measured by RSS (bench/estimator_cpu.py
rows "adamw_torch_{8,4}bit") stays for CPU targets; a CUDA target gets what Inductor's Triton
schedule keeps in memory (hf_memkit/_optimizers/torchao.py), measured here on a GPU when one is
present."""

from __future__ import annotations

import pytest
import torch

from hf_memkit._optimizers import OptimizerContext, ParamInfo, get_optimizer_profile
from tests.helpers import require

BIG = ParamInfo(1024 * 1024, (1024, 1024), 4)
ODD = ParamInfo(509 * 128, (509, 128), 4)          # not a multiple of the block: dense state


def test_cpu_keeps_the_measured_step_and_cuda_gets_inductors_buffers():
    for bits, cpu, cuda in ((8, 8, 2), (4, 26, 24)):
        p = get_optimizer_profile(f"adamw_torch_{bits}bit")
        assert p.estimate([BIG, ODD], OptimizerContext("cpu")).transient == cpu * BIG.numel
        # per moment on CUDA: the staged/written-out buffers + one fp32 scale per 256-block
        assert p.estimate([BIG, ODD], OptimizerContext("cuda")).transient == (
            cuda * BIG.numel + 2 * 4 * BIG.numel // 256)
        assert p.estimate([ODD], OptimizerContext("cuda")).transient == 0   # fused in place


@pytest.mark.gpu
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_step_transient_matches_the_compiled_step(bits, dtype):
    """torch.cuda.max_memory_allocated over a steady step (state made and graph compiled by the
    first one) less what was allocated before it, against the CUDA estimate."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    ao = require("torchao.optim")
    torch.manual_seed(0)
    shapes = [(4096, 1024), (1024, 1024), (1024,)]
    params = [torch.nn.Parameter(torch.randn(*s, device="cuda", dtype=dtype)) for s in shapes]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = getattr(ao, f"AdamW{bits}bit")(params, block_size=256)   # the Trainer's block size
    opt.step()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    opt.step()
    torch.cuda.synchronize()
    measured = torch.cuda.max_memory_allocated() - base
    infos = [ParamInfo(p.numel(), tuple(p.shape), p.element_size()) for p in params]
    predicted = get_optimizer_profile(f"adamw_torch_{bits}bit").estimate(
        infos, OptimizerContext("cuda")).transient
    # the caching allocator rounds each block to 512 B; a few small buffers on top
    assert measured == pytest.approx(predicted, rel=0.05, abs=64 * 1024)
