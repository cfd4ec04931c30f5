"""The cost model: predicted seconds per sample on one rank (only ratios between candidates are
used).

FLOPs per token (Kaplan et al. 2020; PaLM appendix B): forward 2N, backward 4N (input and weight
gradients, 2N each); attention adds 12 x layers x hidden x seq per token for fwd+bwd. Each method
gives its own (``Method.train_flops``, ``Method.slowdown``), each technique what it adds
(``Technique.extra_flops``; ``extra_seconds`` for host copies), each optimizer its step cost
(``OptimizerProfile.step_cost``) and each engine its per-micro-step overhead and communication (``Engine``).
"""

from __future__ import annotations

from dataclasses import dataclass

from .._device.probe import DeviceInfo
from .._engines import ENGINES, Sharding, comm_seconds
from .._methods import METHODS
from .._optimizers import get_optimizer_profile
from .._techniques import TECHNIQUES
from .space import Candidate

# The optimizer step on the host under offload (DeepSpeed CPUAdam / torch on CPU): bytes of
# optimizer traffic per second one rank's host cores sustain (an assumption; memory-bound AVX).
HOST_OPTIM_BANDWIDTH = 20e9
# Bytes moved per trainable parameter by a fused AdamW step (read p, g, m, v; write p, m, v):
# 7 x 4 B in fp32.
OPTIM_BYTES_PER_PARAM = 28
# GEMM efficiency grows with the tokens of a micro-batch and saturates (Narayanan et al. 2021:
# small micro-batches under-use tensor cores): eff = tokens / (tokens + TOKENS_HALF_EFF).
TOKENS_HALF_EFF = 512
# Micro-batches that are multiples of 8 (64 on A100-class) keep GEMM shapes tensor-core aligned
# (NVIDIA "Matrix multiplication background" guide): others pay this penalty.
MISALIGNED_PENALTY = 1.04
PER_MICRO_STEP_OVERHEAD_S = 2e-3     # launch/python overhead of one forward+backward
# Eager attention materialises the (heads x seq x seq) score matrix per layer: written by QK^T,
# read and written by softmax, read by PV in the forward, and about twice that traffic in the
# backward: ~8 passes over it, memory-bound. Fused SDPA/flash kernels keep it on chip
# (Dao et al. 2022, FlashAttention, Sec. 3).
EAGER_SCORE_PASSES = 8


@dataclass(frozen=True)
class Shape:
    """What the cost model needs from the model and the request."""

    n_params: int
    layers: int
    hidden: int
    heads: int
    seq_len: int
    target: int          # the per-rank batch of one optimizer step
    nodes: int = 1


def peak_flops(dev: DeviceInfo, precision: str, tf32: bool) -> float:
    t = dev.peak_tflops or {}
    if dev.kind != "cuda" or not t:
        return 1e12  # CPU/MPS: only relative costs within one precision matter
    if precision in ("bf16", "pure-bf16"):
        return t.get("bf16", 0) * 1e12 or t.get("fp16", 1) * 1e12
    if precision == "fp16":
        return t.get("fp16", 1) * 1e12
    return (t.get("tf32") if tf32 and t.get("tf32") else t.get("fp32", 1)) * 1e12


def _compute(c: Candidate, s: Shape, n_trainable: int, dev: DeviceInfo) -> float:
    attn_flops = 12 * s.layers * s.hidden * s.seq_len
    method = METHODS.get(c.method)
    flops = method.train_flops(s.n_params, n_trainable) + attn_flops
    for name in c.techniques:
        flops += TECHNIQUES.get(name).extra_flops(s.n_params, attn_flops)
    flops *= method.slowdown
    tokens = c.micro_batch * s.seq_len
    eff = tokens / (tokens + TOKENS_HALF_EFF)
    align = 64 if dev.compute_capability == (8, 0) else 8
    if c.micro_batch % align and c.micro_batch < s.target:
        eff /= MISALIGNED_PENALTY
    compute = flops * s.seq_len / (peak_flops(dev, c.precision, True) * eff)
    if c.attn == "eager":
        elem = 4 if c.precision == "fp32" else 2
        compute += (EAGER_SCORE_PASSES * s.layers * s.heads * s.seq_len * s.seq_len * elem
                    / (dev.memory_bandwidth or 5e10))
    return compute


def cost(c: Candidate, s: Shape, *, n_trainable: int, dev: DeviceInfo,
         sharding: Sharding | None = None) -> float:
    """Predicted seconds per sample on one rank. Data-parallel engines add the communication of
    a step that compute does not hide (``comm_seconds``, from the catalog's interconnect
    bandwidth) and divide the optimizer step by the ranks that share it; offload steps the
    optimizer on the host."""
    bw = dev.memory_bandwidth or 5e10
    overhead = PER_MICRO_STEP_OVERHEAD_S / c.micro_batch
    optim = (get_optimizer_profile(c.optim).step_cost * OPTIM_BYTES_PER_PARAM * n_trainable
             / bw / s.target)
    comm = 0.0
    if sharding is not None:
        engine = ENGINES.get(sharding.engine)
        overhead += engine.step_overhead(sharding, layers=s.layers, n_params=s.n_params,
                                         itemsize=4 if c.precision == "fp32" else 2,
                                         bandwidth=bw) / c.micro_batch
        shards = engine.optimizer_shards(sharding)
        optim /= shards
        if sharding.offload_optimizer:
            optim = OPTIM_BYTES_PER_PARAM * n_trainable / shards / HOST_OPTIM_BANDWIDTH / s.target
        if sharding.world_size > 1:
            comm = comm_seconds(sharding, n_params=s.n_params, n_trainable=n_trainable,
                                grad_accum=c.grad_accum, mixed_precision=c.precision != "fp32",
                                intra_bw=dev.interconnect_bandwidth, num_nodes=s.nodes) / s.target
    return _compute(c, s, n_trainable, dev) + overhead + optim + comm + _transfers(c, s, dev)


def _transfers(c: Candidate, s: Shape, dev: DeviceInfo) -> float:
    """Seconds per sample the techniques add outside compute (host copies)."""
    itemsize = 4 if c.precision == "fp32" else 2
    out = 0.0
    for name in c.techniques:
        out += TECHNIQUES.get(name).extra_seconds(shape=s, dev=dev, itemsize=itemsize)
    return out
