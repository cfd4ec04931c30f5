"""A trace for a CUDA target follows CUDA, not this CPU (hf_memkit._cuda.emulation, _cuda,
_estimate.allocation).

Every expectation is worked out by hand in the test from the CUDA / torch source rule its
docstring cites, or measured independently: torch's own ``AutocastCUDA`` kernels (registered even
in this CPU-only build) run on fake CUDA tensors in a child process (a real forward + backward
measured through RSS is in tests/integration/test_forward_backward_measured.py).

Shorthand: B batch, H heads, S sequence length, L traced layers; MiB = 2**20 bytes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker
from transformers import LlamaConfig

import hf_memkit as mk
from hf_memkit._cuda.autocast import cuda_autocast
from hf_memkit._cuda.emulation import emulate_cuda
from hf_memkit._cuda.events import ALLOC, FREE, MARK
from hf_memkit._cuda.runtime import (
    CONTEXT_EAGER_LOADING,
    CONTEXT_LAZY_INIT,
    DEFAULT_WHEEL_CUDA,
    LAZY_TRAINING_KERNELS,
    cuda_runtime,
    nccl_buffers,
    parse_cuda_version,
)
from hf_memkit._cuda.sdpa import SdpaCall, sdpa_kernel
from hf_memkit._cuda.target import CudaTarget
from hf_memkit._errors import ConfigError
from hf_memkit._estimate.allocation import replay_step, step_events
from hf_memkit._model import load_bundled_config
from hf_memkit._model.facts import with_layers
from hf_memkit._model.spec import resolve_model
from hf_memkit._trace.step import trace_step

KiB = 1024
MiB = 1024 * KiB
B16, F32, F16 = torch.bfloat16, torch.float32, torch.float16
A100, V100, SM86 = CudaTarget((8, 0)), CudaTarget((7, 0)), CudaTarget((8, 6))

# 2 layers, hidden 128, 4 heads of 32, vocab 1000: 651,904 parameters in 21 tensors (worked out
# in tests/integration/test_forward_backward_measured.py)
TINY_LLAMA = dict(hidden_size=128, intermediate_size=344, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=4, vocab_size=1000)


# --- 1. autocast: CUDA's policy on the AutocastCPU key -------------------------------------------

def _grad_fn_inputs(t: torch.Tensor) -> list[str]:
    return [type(f).__name__ for f, _ in t.grad_fn.next_functions if f is not None]


def test_cuda_autocast_policy_on_cpu_fake_tensors():
    """aten/src/ATen/autocast_mode.h op lists, as CUDA applies them (autocast_mode.cpp
    ``TORCH_LIBRARY_IMPL(aten, Autocast, m)``): softmax / log_softmax / sum are
    AT_FORALL_FP32_SET_OPT_DTYPE (computed with dtype=float32), layer_norm and exp are
    AT_FORALL_FP32, linear / matmul AT_FORALL_LOWER_PRECISION_FP, addcmul AT_FORALL_PROMOTE (widest
    eligible input wins: fp32). ``cat`` has no CUDA autocast kernel (only AutocastCPU promotes it),
    so on CUDA it runs uncast and type promotion gives fp32 with no explicit cast in the graph.
    The CPU policy (``TORCH_LIBRARY_IMPL(aten, AutocastCPU, m)``) lists none of softmax, layer_norm,
    exp, sum: they stay bf16 there, and come back so once the context exits."""
    with FakeTensorMode():
        x = torch.empty(4, 8, dtype=B16, requires_grad=True)
        x32 = torch.empty(4, 8, requires_grad=True)
        w = torch.empty(8, 8, requires_grad=True)
        with torch.autocast("cpu", dtype=B16):
            cpu_softmax = torch.softmax(x, -1).dtype
            cpu_rest = {F.layer_norm(x, (8,)).dtype, torch.exp(x).dtype, x.sum().dtype}
            with cuda_autocast():
                out = {"softmax": torch.softmax(x, -1), "log_softmax": F.log_softmax(x, -1),
                       "layer_norm": F.layer_norm(x, (8,)), "exp": torch.exp(x),
                       "sum": x.sum(), "linear": F.linear(x32, w), "matmul": x32 @ w,
                       "addcmul": torch.addcmul(x32, x, x), "cat": torch.cat([x, x32])}
                cat_inputs = _grad_fn_inputs(out["cat"])
                sum(v.float().sum() for v in out.values()).backward()
            after_softmax = torch.softmax(x, -1).dtype
            cpu_cat_inputs = _grad_fn_inputs(torch.cat([x, x32]))
        dtypes = {k: v.dtype for k, v in out.items()}
        grads = (x.grad.dtype, x32.grad.dtype, w.grad.dtype)

    assert dtypes == {"softmax": F32, "log_softmax": F32, "layer_norm": F32, "exp": F32,
                      "sum": F32, "linear": B16, "matmul": B16, "addcmul": F32, "cat": F32}
    # the override does something: CPU's own policy leaves these in bf16
    assert cpu_softmax == B16 and cpu_rest == {B16}
    # CPU autocast promotes cat with an explicit cast (ToCopyBackward0); CUDA has no kernel
    assert cpu_cat_inputs == ["ToCopyBackward0", "AccumulateGrad"]
    assert cat_inputs == ["AccumulateGrad", "AccumulateGrad"]
    has_kernel = torch._C._dispatch_has_kernel_for_dispatch_key
    assert not has_kernel("aten::cat", torch._C.DispatchKey.AutocastCUDA)
    assert has_kernel("aten::cat", torch._C.DispatchKey.AutocastCPU)
    # backward runs through every op; each leaf gets a gradient of its own dtype
    assert grads == (B16, F32, F32)
    # the registration is removed on exit: CPU policy again
    assert after_softmax == B16


# torch's own AutocastCUDA kernels (this CPU build registers them) run on fake CUDA tensors, and
# the emulation on fake CPU tensors; each prints the output dtype. In a child process: fake CUDA
# tensors can abort the interpreter (docs/stack-facts.md#fake-cuda-tensors-on-a-cpu-build).
_AUTOCAST_CHILD = textwrap.dedent('''
    import contextlib, json
    import torch, torch.nn.functional as F
    from torch._subclasses.fake_tensor import FakeTensorMode
    from hf_memkit._cuda.emulation import cuda_autocast
    F32 = torch.float32

    def cases(dev, low):  # low: the autocast dtype, also the "low precision" inputs' dtype
        e = lambda *s, dtype=low: torch.empty(*s, dtype=dtype, device=dev)
        ids = lambda n: torch.zeros(n, dtype=torch.long, device=dev)
        return {
            "softmax": lambda: torch.softmax(e(4, 8), -1),
            "log_softmax": lambda: F.log_softmax(e(4, 8), -1),
            "layer_norm": lambda: F.layer_norm(e(4, 8), (8,)),
            "group_norm": lambda: F.group_norm(e(2, 4, 8), 2),
            "exp": lambda: torch.exp(e(4, 8)), "log": lambda: torch.log(e(4, 8)),
            "pow": lambda: torch.pow(e(4, 8), 2), "rsqrt": lambda: torch.rsqrt(e(4, 8)),
            "softplus": lambda: F.softplus(e(4, 8)),
            "sum": lambda: e(4, 8).sum(), "sum_dim": lambda: e(4, 8).sum(-1),
            "cumsum": lambda: torch.cumsum(e(4, 8), -1), "prod": lambda: e(4, 8).prod(),
            "logsumexp": lambda: torch.logsumexp(e(4, 8), -1),
            "vector_norm": lambda: torch.linalg.vector_norm(e(4, 8)),
            "norm": lambda: torch.norm(e(4, 8)),
            "cosine_similarity": lambda: F.cosine_similarity(e(4, 8), e(4, 8)),
            "linear": lambda: F.linear(e(4, 8, dtype=F32), e(8, 8, dtype=F32)),
            "matmul": lambda: e(4, 8, dtype=F32) @ e(8, 8, dtype=F32),
            "bmm": lambda: torch.bmm(e(2, 4, 8, dtype=F32), e(2, 8, 8, dtype=F32)),
            "baddbmm": lambda: torch.baddbmm(e(2, 4, 8, dtype=F32), e(2, 4, 8, dtype=F32),
                                             e(2, 8, 8, dtype=F32)),
            "einsum": lambda: torch.einsum("ij,jk->ik", e(4, 8, dtype=F32),
                                           e(8, 8, dtype=F32)),
            "mv": lambda: torch.mv(e(4, 8, dtype=F32), e(8, dtype=F32)),
            "conv2d": lambda: F.conv2d(e(1, 2, 4, 4, dtype=F32), e(3, 2, 3, 3, dtype=F32)),
            "addcmul": lambda: torch.addcmul(e(4, 8, dtype=F32), e(4, 8), e(4, 8)),
            "addcdiv": lambda: torch.addcdiv(e(4, 8, dtype=F32), e(4, 8), e(4, 8)),
            "dot": lambda: torch.dot(e(8), e(8, dtype=F32)),
            "cat": lambda: torch.cat([e(4, 8), e(4, 8, dtype=F32)]),
            "stack": lambda: torch.stack([e(4, 8), e(4, 8, dtype=F32)]),
            "cross_entropy": lambda: F.cross_entropy(e(4, 8), ids(4)),
            "nll_loss": lambda: F.nll_loss(e(4, 8), ids(4)),
            "mse_loss": lambda: F.mse_loss(e(4, 8), e(4, 8)),
            "gelu": lambda: F.gelu(e(4, 8)), "silu": lambda: F.silu(e(4, 8)),
            # added to the emulation's tables after this test found them missing
            "rms_norm": lambda: F.rms_norm(e(4, 8), (8,)),
            "vdot": lambda: torch.vdot(e(8), e(8, dtype=F32)),
            "upsample_linear1d": lambda: F.interpolate(e(1, 4, 8), scale_factor=2.0,
                                                       mode="linear"),
            "upsample_nearest2d": lambda: F.interpolate(e(1, 1, 4, 8), scale_factor=2.0),
        }

    @contextlib.contextmanager
    def real_cuda_autocast(dtype):
        torch.set_autocast_dtype("cuda", dtype)
        torch.set_autocast_enabled("cuda", True)
        try:
            yield
        finally:
            torch.set_autocast_enabled("cuda", False)

    @contextlib.contextmanager
    def emulated(dtype):
        with torch.autocast("cpu", dtype=dtype), cuda_autocast():
            yield

    def run(dev, policy, dtype):
        out = {}
        for name, make in cases(dev, dtype).items():
            with FakeTensorMode(allow_non_fake_inputs=True):
                try:
                    with policy(dtype):
                        out[name] = str(make().dtype)
                except Exception as exc:
                    out[name] = "error: " + type(exc).__name__
        return out

    out = {}
    for dtype in (torch.bfloat16, torch.float16):
        out[str(dtype)] = {
            "cuda": run("cuda", real_cuda_autocast, dtype),
            "emulated": run("cpu", emulated, dtype),
            "cpu": run("cpu", lambda d: torch.autocast("cpu", dtype=d), dtype)}
    print("@@" + json.dumps(out))
''')

AUTOCAST_GAPS = ("rms_norm", "vdot", "upsample_linear1d", "upsample_nearest2d")


@pytest.fixture(scope="module")
def autocast_reference():
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "-c", _AUTOCAST_CHILD], env=env, capture_output=True,
                          text=True, timeout=300)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("@@")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1][2:])


@pytest.mark.parametrize("dtype", ["torch.bfloat16", "torch.float16"])
def test_cuda_autocast_matches_torch_autocast_cuda_kernels(autocast_reference, dtype):
    """The reference is torch 2.13's own ``AutocastCUDA`` registrations (autocast_mode.cpp,
    ``TORCH_LIBRARY_IMPL(aten, Autocast, m)`` from the AT_FORALL_* lists of autocast_mode.h),
    executed on fake CUDA tensors: for every op below the emulation on CPU fake tensors gives
    the dtype CUDA gives, under bf16 and fp16 autocast alike. Sanity: the reference really is
    CUDA's policy, not CPU's (softmax: fp32 on CUDA, the low precision on CPU)."""
    ref = autocast_reference[dtype]
    assert ref["cuda"]["softmax"] == "torch.float32" and ref["cpu"]["softmax"] == dtype
    agree = {k: (ref["cuda"][k], ref["emulated"][k]) for k in ref["cuda"]
             if k not in AUTOCAST_GAPS}
    assert all(not c.startswith("error") for c, _ in agree.values()), agree
    assert {k: c for k, (c, e) in agree.items() if c != e} == {}, agree
    assert ref["cuda"]["linear"] == dtype and ref["cuda"]["addcmul"] == "torch.float32"


def test_cuda_autocast_ops_missing_from_the_first_tables(autocast_reference):
    """Same reference as above for ops torch 2.13 registers on AutocastCUDA and not on
    AutocastCPU that the emulation's first tables missed (this test found them): CUDA gives fp32
    (rms_norm and upsample are fp32-listed, vdot promotes); the emulation now agrees."""
    ref = autocast_reference["torch.bfloat16"]
    assert {k: ref["emulated"][k] for k in AUTOCAST_GAPS} == \
        {k: ref["cuda"][k] for k in AUTOCAST_GAPS}


# --- 2. SDPA: the kernel CUDA picks (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp) -------

def _call(dtype=B16, hd=64, heads=12, kv=None, s=512, kv_len=None, **kw) -> SdpaCall:
    return SdpaCall(dtype, hd, hd, heads, kv or heads, s, kv_len or s, **kw)


SDPA_CASES = [
    # (id, target, call, expected kernel, the rule of sdp_utils.cpp that decides it)
    ("a100-bf16", A100, _call(), "flash",
     "priority_order: flash first; check_dtypes_flash_attention: sm80+ takes fp16/bf16"),
    ("a100-fp32", A100, _call(F32), "efficient",
     "flash needs fp16/bf16; mem-efficient takes fp32 on sm80 (alignment 4: 64 % 4 == 0)"),
    ("a100-bf16-mask", A100, _call(has_mask=True), "efficient",
     "check_for_attn_mask: flash takes no attn_mask; mem-efficient does"),
    ("v100-fp16", V100, _call(F16), "efficient",
     "check_flash_attention_hardware_support: [sm80, sm121]; mem-efficient [sm50, sm121]"),
    ("v100-bf16", V100, _call(B16), "math",
     "less_than_sm80_mem_efficient_dtypes = {half, float}: no bf16 before sm80, no flash"),
    ("v100-fp32-hd60", V100, _call(F32, hd=60), "efficient",
     "minimum_gemm_alignment: sm70 fp32 uses no tensor cores, alignment 1"),
    ("a100-fp32-hd62", A100, _call(F32, hd=62), "math",
     "minimum_gemm_alignment: sm80 alignment 4, 62 % 4 != 0; flash needs half"),
    ("a100-gqa-fp32", A100, _call(F32, heads=32, kv=8, enable_gqa=True), "math",
     "flash needs half; mem-efficient has no GQA (torch 2.13 SDPA docs: GQA works only for "
     "flash and math on CUDA)"),
    ("a100-gqa-bf16", A100, _call(heads=32, kv=8, enable_gqa=True), "flash",
     "check_batch_size_and_num_heads_dense<supports_gqa=true> for flash: 32 % 8 == 0"),
    ("a100-gqa-bf16-no-flag", A100, _call(heads=32, kv=8), "math",
     "without enable_gqa the head counts must be equal for every fused kernel"),
    ("sm86-hd256-grad-dropout", SM86, _call(hd=256, dropout=0.1), "efficient",
     "check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89_or_120: d > 224 with "
     "dropout"),
    ("sm86-hd256-grad", SM86, _call(hd=256), "flash",
     "same check: d > 224 is allowed without dropout"),
    ("sm86-hd200-grad", SM86, _call(hd=200), "efficient",
     "same check: 192 < d <= 224 is refused when training"),
    ("sm86-hd200-inference", SM86, _call(hd=200, requires_grad=False), "flash",
     "same check only applies when an input requires grad"),
    ("a100-hd256-grad-dropout", A100, _call(hd=256, dropout=0.1), "flash",
     "the sm86-89 constraint does not apply to sm80"),
    ("a100-fp16-hd96", A100, _call(F16, hd=96), "flash",
     "check_head_dim_size_flash: equal head dims <= 256"),
    ("a100-bf16-hd288", A100, _call(hd=288), "efficient",
     "check_head_dim_size_flash: > 256 refused; mem-efficient alignment 8 (288 % 8 == 0)"),
    ("a100-causal-nonsquare", A100, _call(s=1, kv_len=512, is_causal=True), "efficient",
     "check_flash_causal_non_square_seqlens: is_causal with seqlen_q != seqlen_k"),
    ("h100-cuda13-bf16-hd128", CudaTarget.of((9, 0), "13.0"), _call(hd=128), "cudnn",
     "check_prefer_cudnn_attention: sm90 with cuDNN > 9.15 (CUDA 13 wheels): cuDNN first"),
    ("h100-cuda12.8-bf16-hd128", CudaTarget.of((9, 0), "12.8"), _call(hd=128), "flash",
     "CUDA <= 12.9 wheels ship an older cuDNN: default order, flash first"),
    ("a100-cuda13-bf16-hd128", CudaTarget.of((8, 0), "13.0"), _call(hd=128), "flash",
     "cuDNN is preferred only on sm90/sm10x"),
    ("h100-fp32-mask-strided", CudaTarget.of((9, 0), "13.0"),
     _call(F32, has_mask=True, last_dim_contiguous=False), "math",
     "check_last_dim_stride_equals_1_dense: GPU backends require attn_mask.stride(-1) == 1"),
    ("a100-bf16-qkv-strided", A100, _call(last_dim_contiguous=False), "math",
     "the same check on query, key and value: no fused kernel"),
]


@pytest.mark.parametrize("target,call,expected,rule", [c[1:] for c in SDPA_CASES],
                         ids=[c[0] for c in SDPA_CASES])
def test_sdpa_kernel_rule(target, call, expected, rule):
    """One sdp_utils.cpp rule per case (``select_sdp_backend``, ``can_use_flash_attention``,
    ``can_use_mem_efficient_attention``, ``can_use_cudnn_attention``, ``priority_order``); each
    case's ``rule`` names the check that decides it."""
    assert sdpa_kernel(target, call) == expected, rule


def test_cuda_target_prefers_cudnn_only_on_hopper_with_cuda13():
    """sdp_utils.cpp ``check_prefer_cudnn_attention``: cuDNN > 9.15 on sm90 / sm100 / sm103; "CUDA
    <= 12.9 wheels ship with older cuDNN", so only CUDA 13 wheels qualify."""
    assert CudaTarget.of((9, 0), "13.0").prefers_cudnn is True
    assert CudaTarget.of((10, 0), "13.0").prefers_cudnn is True
    assert CudaTarget.of((9, 0), "12.8").prefers_cudnn is False
    assert CudaTarget.of((8, 0), "13.0").prefers_cudnn is False
    assert CudaTarget.of((8, 9), "13.0").prefers_cudnn is False


def test_cudnn_refuses_dropout_off_the_1_16_grid():
    """sdp_utils.cpp ``check_cudnn_dropout``: cuDNN takes a dropout probability only in steps of
    1/16, so p = 0.1 (1.6 / 16) skips cuDNN and flash runs; p = 0.125 (2 / 16) keeps cuDNN."""
    h100 = CudaTarget.of((9, 0), "13.0")
    assert sdpa_kernel(h100, _call(hd=128, dropout=0.125)) == "cudnn"
    assert sdpa_kernel(h100, _call(hd=128, dropout=0.1)) == "flash"


def _attention(target: CudaTarget, dtype: torch.dtype, mask_layout: str | None
               ) -> tuple[list[str], int, torch.Tensor | None]:
    """One emulated SDPA forward and backward on fake tensors (B=2, H=4, S=256, D=64): the
    kernels picked, the bytes the forward keeps for backward, and the mask's gradient. The mask
    is a learned bias [1, H, S, S] that requires grad, either contiguous or, as T5 builds its
    relative position bias, a permuted [S, S, H] tensor (last-dim stride H)."""
    B, H, S, D = 2, 4, 256, 64
    fm = FakeTensorMode()
    with fm:
        q, k, v = (torch.empty(B, H, S, D, dtype=dtype, requires_grad=True) for _ in range(3))
        bias = None
        if mask_layout == "contiguous":
            bias = torch.zeros(1, H, S, S, dtype=dtype, requires_grad=True)
        elif mask_layout == "permuted":
            bias = torch.zeros(S, S, H, dtype=dtype, requires_grad=True)
    mt = MemTracker()
    mt.track_external(q, k, v, *([bias] if bias is not None else []))
    with fm, mt, emulate_cuda(target) as ops:
        mask = bias.permute(2, 0, 1).unsqueeze(0) if mask_layout == "permuted" else bias
        before = mt.get_tracker_snapshot("current")[torch.device("cpu")]["Total"]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        kept = mt.get_tracker_snapshot("current")[torch.device("cpu")]["Total"] - before
        out.sum().backward()
    return ops.kernels, kept, bias.grad if bias is not None else None


def test_a_mask_whose_last_dim_is_strided_runs_the_math_kernel_on_cuda():
    """sdp_utils_cpp.h ``check_last_dim_stride_equals_1_dense``: CUDA's fused kernels need
    ``attn_mask.stride(-1) == 1`` (the CPU does not). transformers <= 5.17 passes T5's permuted
    relative position bias as the mask, so T5 with SDPA runs the math kernel on a GPU: measured on
    an H200 (bench/results/gpu, t5-220m: allocated 22-31% above the efficient-kernel estimate)."""
    h100 = CudaTarget.of((9, 0), "13.0")
    kernels, kept, grad = _attention(h100, F32, "permuted")
    assert kernels == ["math"]
    assert kept >= 2 * 4 * 256 * 256 * 4  # the fp32 attention matrix (softmax output)
    assert grad is not None and grad.shape == (256, 256, 4)
    kernels, kept, grad = _attention(h100, F32, "contiguous")
    assert kernels == ["efficient"]
    assert kept < 2 * 4 * 256 * 256 * 4 / 3  # no attention matrix: output + log-sum-exp
    # attention_backward.cu: a bias that requires grad gets grad_bias (the learned bias learns)
    assert grad is not None and grad.shape == (1, 4, 256, 256)


def test_math_attention_computes_half_inputs_in_fp32():
    """attention.cpp ``_scaled_dot_product_attention_math``: fp16/bf16 inputs are upcast to fp32
    unless ``torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True)`` (off by default), so
    the attention matrix it keeps is fp32 whatever the input dtype: a bf16 call keeps at least
    the fp32 softmax output, more than half of what an fp32 call keeps."""
    assert not torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()
    _, kept16, _ = _attention(A100, B16, "permuted")
    _, kept32, _ = _attention(A100, F32, "permuted")
    assert kept16 >= 2 * 4 * 256 * 256 * 4
    assert kept16 > 0.6 * kept32


# --- 3. the acceptance test: attention dropout on a fused kernel ---------------------------

def _bert(name: str, layers: int, attn: str, **overrides):
    cfg = with_layers(load_bundled_config(name), layers)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    cls = resolve_model(cfg, task="sequence-classification", attn_implementation=attn).model_cls
    return cls, cfg


def _trace(cls, cfg, target, attn, batch, seq, **kw):
    return trace_step(cls, cfg, task="sequence-classification", micro_batch=batch, seq_len=seq,
                      attn_implementation=attn, target=target, **kw)


def test_bert_base_attention_dropout_costs_no_attention_matrix_on_a100():
    """sdp_utils.cpp: fp32 on sm80 runs the memory-efficient kernel, whose autograd formula
    (derivatives.yaml ``_scaled_dot_product_efficient_attention``) keeps output + log-sum-exp +
    RNG state, dropout or not: the A100 trace with attention dropout 0.1 is the one with 0, to
    the RNG state's bytes. On this CPU, dropout > 0 takes ``_scaled_dot_product_attention_math``,
    which keeps per layer the softmax output, Dropout.cpp ``_dropout_impl``'s fp32 noise and the
    dropped probabilities (3 x B*H*S*S*4 bytes), instead of the CPU flash kernel's log-sum-exp
    (B*H*S*4 bytes)."""
    B, S, L = 8, 512, 2
    peaks = {}
    for p in (0.0, 0.1):
        cls, cfg = _bert("bert-base-uncased", L, "sdpa", attention_probs_dropout_prob=p)
        H = cfg.num_attention_heads  # 12
        for name, target in (("a100", A100), ("cpu", None)):
            r = _trace(cls, cfg, target, "sdpa", B, S)
            peaks[name, p] = (r.peak, r.weights + r.inputs)
            if target is not None:
                assert r.sdpa_kernels == ("efficient",) * L
    a100_0, a100_1 = peaks["a100", 0.0][0], peaks["a100", 0.1][0]
    # measured 2026-11-28: identical traces (657,538,168 B each); was within 10%. The kernel's
    # RNG state (philox seed and offset, two int64) is all dropout could add
    assert abs(a100_1 - a100_0) <= 64
    (cpu_0, held), (cpu_1, _) = peaks["cpu", 0.0], peaks["cpu", 0.1]
    assert cpu_1 - held > 1.5 * (cpu_0 - held)
    expected = L * (3 * B * H * S * S * 4 - B * H * S * 4)  # 603,586,560 bytes
    assert cpu_1 - cpu_0 == pytest.approx(expected, rel=0.01)
    # none of the 3 x L attention-sized tensors the math path keeps is in the A100 trace
    assert a100_1 < cpu_1 - expected


# --- 4. dropout: CUDA's fused kernel keeps a 1-byte mask -------------------------------------------

def _dropout_bytes(target: CudaTarget | None) -> tuple[str, int]:
    fm = FakeTensorMode()
    with fm:
        x = torch.empty(64, 1024, requires_grad=True)
    mt = MemTracker()
    mt.track_external(x)
    with fm, mt, emulate_cuda(target):
        before = mt.get_tracker_snapshot("current")[torch.device("cpu")]["Total"]
        y = F.dropout(x, 0.1, True)
        after = mt.get_tracker_snapshot("current")[torch.device("cpu")]["Total"]
        kind = type(y.grad_fn).__name__
    return kind, after - before


def test_cuda_dropout_keeps_a_bool_mask_cpu_keeps_fp32_noise():
    """aten/src/ATen/native/Dropout.cpp: on CUDA with 0 < p < 1 (``is_fused_kernel_acceptable``)
    ``dropout`` is ``native_dropout``: output + a bool mask saved for backward, 4 + 1 bytes per
    fp32 element. On CPU ``_dropout_impl`` multiplies by a noise tensor of the input's dtype,
    which ``MulBackward0`` keeps: 4 + 4 bytes per element."""
    n = 64 * 1024
    assert _dropout_bytes(CudaTarget()) == ("NativeDropoutBackward0", n * (4 + 1))
    assert _dropout_bytes(None) == ("MulBackward0", n * (4 + 4))


# --- 5. mixed precision: CUDA keeps the fp32 softmax ------------------------------------------------

def _forward_peaks(attn_dropout: float, hidden_dropout: float, layers: int) -> dict[str, int]:
    cls, cfg = _bert("bert-large-uncased", layers, "eager",
                     attention_probs_dropout_prob=attn_dropout, hidden_dropout_prob=hidden_dropout)
    return {name: _trace(cls, cfg, target, "eager", 4, 512, amp="bf16").phases["forward"]
            for name, target in (("a100", A100), ("cpu", None))}


def test_amp_eager_attention_keeps_fp32_softmax_on_cuda():
    """bert-large, eager attention, bf16 AMP, B=4, S=512 (H=16, hidden 1024); A = B*H*S*S.

    Without dropout, per layer: CUDA's autocast runs softmax in fp32 (AT_FORALL_FP32_SET_OPT_DTYPE)
    and keeps that 4-byte output for softmax's backward, plus the bf16 copy the next matmul casts
    and saves (lower_precision_fp): 6 bytes per attention element; CPU's autocast leaves softmax in
    bf16 and both ops keep that one 2-byte tensor: +4 bytes x A per layer, so +8 x A at 2 layers.

    With bert's default dropout 0.1, per layer the attention dropout keeps on CUDA the bool mask
    (Dropout.cpp native_dropout) beside the fp32 softmax output and the bf16 matmul copy:
    4 + 1 + 2 = 7 bytes; on CPU the bf16 softmax output, the bf16 noise and the dropped bf16
    probabilities: 2 + 2 + 2 = 6; the two hidden dropouts on [B, S, 1024] keep 1 byte (mask) on
    CUDA against 2 (noise): -2 x B*S*1024 = -A/4. Per layer: +A - A/4 = 0.75 x A. The 2-layer
    forward peak differs by at least the fp32-vs-bf16 softmax output (2 bytes x A per layer) and
    at most 2.5 times that. Per-layer figures are the slope between 2 and 3 traced layers."""
    A = 4 * 16 * 512 * 512
    no_drop = {n: _forward_peaks(0.0, 0.0, n) for n in (2, 3)}
    diff2 = no_drop[2]["a100"] - no_drop[2]["cpu"]
    slope = (no_drop[3]["a100"] - no_drop[2]["a100"]) - (no_drop[3]["cpu"] - no_drop[2]["cpu"])
    assert slope == pytest.approx(4 * A, rel=0.01)
    assert diff2 == pytest.approx(2 * 4 * A, rel=0.01)

    drop = {n: _forward_peaks(0.1, 0.1, n) for n in (2, 3)}
    diff2 = drop[2]["a100"] - drop[2]["cpu"]
    slope = (drop[3]["a100"] - drop[2]["a100"]) - (drop[3]["cpu"] - drop[2]["cpu"])
    assert slope == pytest.approx(0.75 * A, rel=0.01)
    softmax_fp32_extra = 2 * A * (4 - 2)
    assert softmax_fp32_extra <= diff2 <= 2.5 * softmax_fp32_extra


# --- 6. CUDA context by version, NCCL buffers --------------------------------------------------------

def test_context_follows_cuda_version_and_module_loading():
    """torch/cuda/__init__.py ``_lazy_init`` sets CUDA_MODULE_LOADING=LAZY, which CUDA honours from
    11.7 on; before 11.7, or with CUDA_MODULE_LOADING=EAGER, every kernel loads at context
    creation (docs/anchors.md: 1343 MiB on a V100 with CUDA 11.2). Lazy: measured on an H200
    with CUDA 13.0 (bench/results/gpu, the fit file): 523.6 MiB at init + up to 240 MiB of
    kernels a training step loads."""
    eager, lazy = 1343 * MiB, 524 * MiB + 240 * MiB
    assert (CONTEXT_EAGER_LOADING, CONTEXT_LAZY_INIT + LAZY_TRAINING_KERNELS) == (eager, lazy)
    for version, is_lazy in (("11.2", False), ("11.6", False), ("11.7", True), ("12.8", True),
                             ("12.8.1", True)):
        rt = cuda_runtime(version, env={})
        assert (rt.lazy_loading, rt.context, rt.source) == \
            (is_lazy, lazy if is_lazy else eager, "given"), version
    assert cuda_runtime("12.8", env={"CUDA_MODULE_LOADING": "EAGER"}).context == eager
    assert cuda_runtime("12.8", env={"CUDA_MODULE_LOADING": "lazy"}).context == lazy
    assert cuda_runtime("11.2", env={"CUDA_MODULE_LOADING": "LAZY"}).context == eager
    assert parse_cuda_version(" 12.8 ") == (12, 8)


def test_default_cuda_version_is_this_torch_else_the_pypi_wheel():
    """Without ``cuda_version``: the installed torch's CUDA (``torch.version.cuda``), else the CUDA
    of the default PyPI torch wheel, 13.0 since torch 2.11 (pytorch/pytorch#190355)."""
    rt = cuda_runtime(None, env={})
    if torch.version.cuda is None:  # this CPU build
        assert (rt.version, rt.source, rt.lazy_loading) == ("13.0", "default torch wheel", True)
        assert DEFAULT_WHEEL_CUDA == "13.0"
    else:
        major, minor = torch.version.cuda.split(".")[:2]
        assert (rt.version, rt.source) == (f"{int(major)}.{int(minor)}", "this torch")


@pytest.mark.parametrize("bad", ["twelve", "12", "", "12.x", "1.2.3.4"])
def test_bad_cuda_version_names_the_value(bad):
    """The documented form is major.minor ("12.8"); anything else is a ConfigError quoting it,
    from the runtime and from estimate_memory alike."""
    with pytest.raises(ConfigError, match=f"got {bad!r}"):
        cuda_runtime(bad, env={})
    with pytest.raises(ConfigError, match=f"got {bad!r}"):
        mk.estimate_memory(LlamaConfig(**TINY_LLAMA), {}, seq_len=64, device="A100-80GB",
                           cuda_version=bad)


def test_estimate_context_differs_by_exactly_the_loading_mode(clean_cuda_env):
    """Same model, same A100, CUDA 11.2 vs 12.8: the trace and the allocator replay are the same
    (sm80 prefers no cuDNN on either), so allocated and reserved agree and NVML-visible memory
    differs by the eager context less the lazy one: 1343 - (524 + 240) = 579 MiB."""
    cfg = LlamaConfig(**TINY_LLAMA)
    args = {"per_device_train_batch_size": 4, "bf16": True}
    old = mk.estimate_memory(cfg, args, seq_len=128, device="A100-80GB", cuda_version="11.2")
    new = mk.estimate_memory(cfg, args, seq_len=128, device="A100-80GB", cuda_version="12.8")
    assert (old.cuda_version, new.cuda_version) == ("11.2", "12.8")
    assert (old.peak_allocated, old.peak_reserved) == (new.peak_allocated, new.peak_reserved)
    assert old.device_used - new.device_used == 579 * MiB
    assert (old.breakdown["context"], new.breakdown["context"]) == (1343 * MiB, 764 * MiB)


def test_nccl_buffers_by_hand():
    """NCCL environment-variable docs: NCCL_BUFFSIZE defaults to 4 MiB per channel and peer; per
    rank: channels x 2 ring peers x buffsize x 2 protocols (Simple + LL128), 16 channels over
    NVLink, 4 over PCIe: 16*2*4*2 = 256 MiB and 4*2*4*2 = 64 MiB. One rank has no communicator."""
    assert nccl_buffers(1, "nvlink4", env={}) == 0
    assert nccl_buffers(2, "nvlink4", env={}) == 256 * MiB
    assert nccl_buffers(8, "pcie5", env={}) == 64 * MiB
    assert nccl_buffers(2, None, env={}) == 64 * MiB
    assert nccl_buffers(2, "nvlink4", env={"NCCL_BUFFSIZE": str(1 * MiB)}) == 64 * MiB
    assert nccl_buffers(2, "nvlink3", env={}) > nccl_buffers(2, "pcie4", env={})


def test_ddp_estimate_adds_nccl_to_the_context(clean_cuda_env):
    """H100-80GB (NVLink 4, catalog) with 2 data-parallel ranks on the default CUDA (13.0 here,
    lazy loading): context = 524 + 240 MiB + 256 MiB of NCCL buffers; one GPU: no NCCL."""
    cfg = LlamaConfig(**TINY_LLAMA)
    args = {"per_device_train_batch_size": 4, "bf16": True}
    two = mk.estimate_memory(cfg, args, seq_len=128, device="H100-80GB", num_gpus=2)
    one = mk.estimate_memory(cfg, args, seq_len=128, device="H100-80GB")
    assert two.breakdown["context"] == 764 * MiB + 256 * MiB
    assert one.breakdown["context"] == 764 * MiB


# --- 8. allocator replay of a step --------------------------------------------------------------------

def test_step_events_builds_two_optimizer_steps_from_one_trace():
    """_estimate/allocation.py's Trainer step: the weights (prefix) once; the traced body per step
    with its own handles; AdamW state (``state_ratio`` 2.0: exp_avg + exp_avg_sq, each 1x the
    parameter) created lazily at the first ``optimizer.step()`` (torch.optim initialises state on
    the first step); ``zero_grad(set_to_none=True)`` frees the gradients at each step's end."""
    events = [(ALLOC, "w1", 1 * MiB), (ALLOC, "w2", 256 * KiB), (MARK, "micro0", 0),
              (ALLOC, "act", 3 * MiB), (ALLOC, "grad", 1 * MiB), (FREE, "act", 0)]
    got = list(step_events(events, (1 * MiB,), state_ratio=2.0, transient_ratio=0.0))
    assert got == [
        (ALLOC, "w1", 1 * MiB), (ALLOC, "w2", 256 * KiB),
        (ALLOC, (1, "act"), 3 * MiB), (ALLOC, (1, "grad"), 1 * MiB), (FREE, (1, "act"), 0),
        (ALLOC, ("state", 0, 0), 1 * MiB), (ALLOC, ("state", 0, 1), 1 * MiB),
        (FREE, (1, "grad"), 0),
        (ALLOC, (2, "act"), 3 * MiB), (ALLOC, (2, "grad"), 1 * MiB), (FREE, (2, "act"), 0),
        (FREE, (2, "grad"), 0),
    ]

    # c10/cuda/CUDACachingAllocator.cpp, step by step (sizes are already multiples of 512 B):
    #   w1 1 MiB, w2 256 KiB: small pool (<= 1 MiB) -> one 2 MiB segment S1, 768 KiB left
    #   act 3 MiB: large pool, < 10 MiB -> a 20 MiB segment L1, split (17 MiB left)
    #   grad 1 MiB: no small block >= 1 MiB -> 2 MiB segment S2 (1 MiB left); allocated 5.25 MiB
    #   free act: L1 whole again
    #   state 1 MiB: best fit = S2's 1 MiB remainder; state 1 MiB: only 768 KiB free -> S3
    #   free grad. Step 2: act in L1, grad in S2's freed 1 MiB: allocated 1 + 0.25 + 2 + 3 + 1
    # reserved: S1 + L1 + S2 + S3 = 2 + 20 + 2 + 2 MiB
    stats = replay_step(events, (1 * MiB,), state_ratio=2.0, transient_ratio=0.0)
    assert (stats.peak_allocated, stats.peak_reserved) == (7 * MiB + 256 * KiB, 26 * MiB)


def test_reserved_minus_allocated_by_hand_for_a_large_and_an_unsplit_block():
    """CUDACachingAllocator.cpp's rounding rules, worked by hand for a known sequence:
      w 512 B: small pool (<= 1 MiB) -> one 2 MiB segment, 2 MiB - 512 B of it unused;
      big 10 MiB + 1 B: ``round_size`` -> 10 MiB + 512 B; >= 10 MiB (kMinLargeAlloc) ->
        ``get_allocation_size`` rounds the segment up to 2 MiB (kRoundLarge): 12 MiB, split
        (``should_split``: the 2 MiB - 512 B left is more than kSmallSize, 1 MiB);
      mid 1 MiB + 1 B -> 1 MiB + 512 B: large pool, best fit is big's remainder, which is not
        split again (what would be left, 1 MiB - 1 KiB, is under kSmallSize): mid's block is the
        whole remainder, 2 MiB - 512 B, and ``allocated_bytes`` counts blocks.
    allocated 512 + (10 MiB + 512) + (2 MiB - 512) = 12 MiB + 512 B; reserved 2 + 12 = 14 MiB;
    reserved - allocated = 2 MiB - 512 B, the small segment's unused part. Step 2 reuses both
    segments (the large one merged whole again)."""
    events = [(ALLOC, "w", 512), (MARK, "micro0", 0), (ALLOC, "big", 10 * MiB + 1),
              (ALLOC, "mid", MiB + 1), (FREE, "big", 0), (FREE, "mid", 0)]
    stats = replay_step(events, (512,), state_ratio=0.0, transient_ratio=0.0)
    assert (stats.peak_allocated, stats.peak_reserved) == (12 * MiB + 512, 14 * MiB)
    assert stats.peak_reserved - stats.peak_allocated == 2 * MiB - 512


def test_cuda_estimate_reserves_more_than_it_allocates_cpu_does_not(clean_cuda_env):
    """The caching allocator reserves whole segments (2 MiB small, 20 MiB for 1-10 MiB requests,
    CUDACachingAllocator.cpp ``get_allocation_size``) and keeps them cached, so a CUDA step's
    reserved exceeds its allocated by the fragmentation the breakdown reports; a CPU has no
    caching allocator: reserved == allocated, no fragmentation."""
    cfg = LlamaConfig(**TINY_LLAMA)
    args = {"per_device_train_batch_size": 4, "bf16": True}
    gpu = mk.estimate_memory(cfg, args, seq_len=128, device="A100-80GB", cuda_version="12.8")
    assert gpu.peak_reserved > gpu.peak_allocated
    assert gpu.breakdown["fragmentation"] > 0  # (its size by hand: the test below)
    cpu = mk.estimate_memory(cfg, {"per_device_train_batch_size": 4}, seq_len=128, device="cpu")
    assert cpu.peak_reserved == cpu.peak_allocated == cpu.device_used
    assert cpu.breakdown["fragmentation"] == cpu.breakdown["context"] == 0

