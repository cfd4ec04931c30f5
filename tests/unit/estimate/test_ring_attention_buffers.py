"""The ring-attention buffers of context parallelism (``_estimate.parallel.ring_buffers``)
against torch's own ring attention.

torch's context parallelism does not run on CPU (its dispatcher has no rule for
``aten._scaled_dot_product_flash_attention_for_cpu``), so torch's ring functions
(``_templated_ring_attention`` and its backward) run here on fake tensors over torch's fake
process group, with the CUDA flash kernels' fake implementations, as rank ``cp - 1`` (the
busiest under head-tail load balancing). Every storage they create is tracked; the peak beyond
the plain local kernel's own (its outputs / gradients) is what the estimate adds per layer.
Each case runs in a subprocess: the fake process group is process-wide."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hf_memkit._cuda.collectives import ring_buffers

SHAPE = dict(batch=1, heads=8, kv_heads=2, head_dim=64, seq=4096)

SCRIPT = r"""
import json, sys, weakref
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
import torch.distributed.tensor.experimental._context_parallel._attention as A

cp, comm, b, h, hkv, d, S = json.loads(sys.argv[1])
dist.init_process_group("fake", store=FakeStore(), rank=cp - 1, world_size=cp)
A._cp_options.enable_load_balance = True
A._cp_options.rotate_method = (A._RotateMethod.ALL_TO_ALL if comm == "alltoall"
                               else A._RotateMethod.ALL_GATHER)
aten = torch.ops.aten


class Track(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.live, self.cur, self.peak = set(), 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                key = t.untyped_storage()._cdata
                if key in self.live:
                    continue
                n = t.untyped_storage().nbytes()
                self.live.add(key)
                self.cur += n
                self.peak = max(self.peak, self.cur)
                weakref.finalize(t, self._free, key, n)
        return out

    def _free(self, key, n):
        if key in self.live:
            self.live.discard(key)
            self.cur -= n


def peak(fn):
    tr = Track()
    with tr:
        out = fn()
    return tr.peak, out


sl = S // cp
zero = lambda: torch.empty((), dtype=torch.int64)
with FakeTensorMode():
    q = torch.empty(b, h, sl, d, dtype=torch.bfloat16)
    k = torch.empty(b, hkv, sl, d, dtype=torch.bfloat16)
    v = torch.empty(b, hkv, sl, d, dtype=torch.bfloat16)
    fwd, out = peak(lambda: A._templated_ring_attention(
        dist.group.WORLD, 2, aten._scaled_dot_product_flash_attention, q, k, v,
        is_causal=True, dropout_p=0.0, scale=None))
    o, lse = out[0], out[1]
    go = torch.empty_like(o)
    seed, offset = zero(), zero()
    bwd, _ = peak(lambda: A._templated_ring_attention_backward(
        dist.group.WORLD, 2, aten._scaled_dot_product_flash_attention_backward.default, go,
        "grad_out", q, k, v, o, lse, is_causal=True, cum_seq_q=None, cum_seq_k=None, max_q=sl,
        max_k=sl, dropout_p=0.0, philox_seed=seed, philox_offset=offset, scale=None))
    pf, ro = peak(lambda: aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True))
    pb, _ = peak(lambda: aten._scaled_dot_product_flash_attention_backward(
        go, q, k, v, ro[0], ro[1], None, None, sl, sl, 0.0, True, ro[6], ro[7]))
print(json.dumps({"forward": fwd - pf, "backward": bwd - pb}))
"""


@pytest.mark.parametrize("cp,comm", [(2, "allgather"), (4, "allgather"), (2, "alltoall"),
                                     (4, "alltoall")])
def test_ring_buffers_match_torch_ring_attention(cp, comm):
    s = SHAPE
    arg = json.dumps([cp, comm, s["batch"], s["heads"], s["kv_heads"], s["head_dim"], s["seq"]])
    run = subprocess.run([sys.executable, "-c", SCRIPT, arg], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    measured = json.loads(run.stdout.strip().splitlines()[-1])
    ours = ring_buffers(batch=s["batch"], local_seq=s["seq"] // cp, heads=s["heads"],
                        kv_heads=s["kv_heads"], head_dim=s["head_dim"], itemsize=2, cp=cp,
                        comm=comm)
    assert ours == measured
