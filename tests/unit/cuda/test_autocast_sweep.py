"""The emulation of CUDA's autocast policy (hf_memkit._cuda.autocast) against every op torch
itself registers on ``AutocastCUDA`` that takes one floating tensor (issue 45).

The reference is torch's own ``AutocastCUDA`` kernels (autocast_mode.cpp, ``TORCH_LIBRARY_IMPL(
aten, Autocast, m)`` from the AT_FORALL_* lists of autocast_mode.h; this CPU-only build registers
them too), run on fake CUDA tensors; the op list comes from torch's dispatcher, not from
hf_memkit's tables, so an op dropped from a table (``log1p`` from ``CUDA_FP32_ONLY``: CPU
autocast leaves it in bf16, CUDA computes it in fp32) shows up as a disagreement. In a child
process: fake CUDA tensors can abort the interpreter
(docs/stack-facts.md#fake-cuda-tensors-on-a-cpu-build). The hand-picked cases of several
arguments are in test_cuda_fidelity.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

_SWEEP_CHILD = textwrap.dedent('''
    import contextlib, json
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from hf_memkit._cuda.emulation import cuda_autocast

    NAMES = sorted(torch._C._dispatch_get_registrations_for_dispatch_key("AutocastCUDA"))

    def op_of(name):
        base, _, ov = name.removeprefix("aten::").partition(".")
        packet = getattr(torch.ops.aten, base, None)
        return getattr(packet, ov or "default", None) if packet is not None else None

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
        for name in NAMES:
            op = op_of(name)
            if op is None:
                continue
            with FakeTensorMode(allow_non_fake_inputs=True):
                x = torch.empty(4, 8, dtype=dtype, device=dev)
                try:
                    with policy(dtype):
                        r = op(x)
                except Exception:   # needs more arguments than one tensor
                    continue
            if isinstance(r, torch.Tensor):
                out[name] = str(r.dtype)
        return out

    out = {"registered": len(NAMES)}
    for dtype in (torch.bfloat16, torch.float16):
        out[str(dtype)] = {
            "cuda": run("cuda", real_cuda_autocast, dtype),
            "emulated": run("cpu", emulated, dtype),
            "cpu": run("cpu", lambda d: torch.autocast("cpu", dtype=d), dtype)}
    print("@@" + json.dumps(out))
''')


@pytest.fixture(scope="module")
def sweep():
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "-c", _SWEEP_CHILD], env=env, capture_output=True,
                          text=True, timeout=300)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("@@")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1][2:])


@pytest.mark.parametrize("dtype", ["torch.bfloat16", "torch.float16"])
def test_every_one_tensor_autocast_cuda_op_gets_cudas_dtype(sweep, dtype):
    """Each op torch registers on AutocastCUDA that runs on one fake [4, 8] tensor of the
    autocast dtype (torch 2.13: 22 of its 119 registrations, the fp32-listed unary ops such as
    exp, log, log1p, rsqrt, and the fp32 reductions) gives, in the emulation on CPU fake
    tensors, the dtype CUDA's own kernel gives."""
    ref = sweep[dtype]
    cuda, emulated = ref["cuda"], ref["emulated"]
    assert sweep["registered"] > 100 and len(cuda) >= 20, (sweep["registered"], sorted(cuda))
    # the reference is CUDA's policy, not CPU's: fp32 on CUDA, the low precision on CPU
    for op in ("aten::exp", "aten::log1p"):
        assert cuda[op] == "torch.float32" and ref["cpu"][op] == dtype, op
    assert {k: (v, emulated.get(k)) for k, v in cuda.items() if emulated.get(k) != v} == {}
