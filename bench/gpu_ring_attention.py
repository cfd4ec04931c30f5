"""Context parallelism's ring-attention buffers on a real CUDA GPU, against
``hf_memkit._cuda.collectives.ring_buffers``.

A multi-GPU ring cannot be had here; what one rank allocates can. torch's ring functions
(``_templated_ring_attention`` and its backward) run on one GPU as rank ``cp - 1`` of torch's
fake process group: the collectives return at once, but every buffer they and the CUDA kernels
allocate is real device memory. The peak allocated during each call, beyond the plain local
kernel's own peak, is what one rank adds per layer. The CPU test
(tests/unit/estimate/test_ring_attention_buffers.py) checks the same on fake tensors with the
kernels' meta functions; this adds the kernels' real workspaces and the caching allocator.

    python bench/gpu_ring_attention.py [--out DIR] [--quick]

Without a CUDA GPU it says so and exits 0. Results: ``ring_attention_<gpu>_<date>.json``.
``--quick``: cp=2 with each exchange, the shorter shape only; needs ``--out`` (never
``bench/results/``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch
from _quick import add_flag, guard

from hf_memkit._cuda.collectives import ring_buffers

SHAPES = [dict(batch=1, heads=32, kv_heads=8, head_dim=128, seq=32768),
          dict(batch=1, heads=16, kv_heads=16, head_dim=64, seq=16384)]
CASES = [(2, "allgather"), (4, "allgather"), (8, "allgather"), (2, "alltoall"), (4, "alltoall"),
         (8, "alltoall")]
QUICK_CASES = [(2, "allgather"), (2, "alltoall")]


def _peak(fn):
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base, out


def one(shape: dict, cp: int, comm: str) -> dict:
    import torch.distributed.tensor.experimental._context_parallel._attention as A

    A._cp_options.enable_load_balance = True
    A._cp_options.rotate_method = (A._RotateMethod.ALL_TO_ALL if comm == "alltoall"
                                   else A._RotateMethod.ALL_GATHER)
    aten, group = torch.ops.aten, torch.distributed.group.WORLD
    b, h, kv, d, sl = (shape["batch"], shape["heads"], shape["kv_heads"], shape["head_dim"],
                       shape["seq"] // cp)
    q = torch.randn(b, h, sl, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, kv, sl, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    fwd, out = _peak(lambda: A._templated_ring_attention(
        group, 2, aten._scaled_dot_product_flash_attention, q, k, v, is_causal=True,
        dropout_p=0.0, scale=None))
    go, seed, offset = torch.randn_like(out[0]), out[6], out[7]
    bwd, _ = _peak(lambda: A._templated_ring_attention_backward(
        group, 2, aten._scaled_dot_product_flash_attention_backward.default, go, "grad_out",
        q, k, v, out[0], out[1], is_causal=True, cum_seq_q=None, cum_seq_k=None, max_q=sl,
        max_k=sl, dropout_p=0.0, philox_seed=seed, philox_offset=offset, scale=None))
    pf, ro = _peak(lambda: aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True))
    pb, _ = _peak(lambda: aten._scaled_dot_product_flash_attention_backward(
        go, q, k, v, ro[0], ro[1], None, None, sl, sl, 0.0, True, ro[6], ro[7]))
    ours = ring_buffers(batch=b, local_seq=sl, heads=h, kv_heads=kv, head_dim=d, itemsize=2,
                        cp=cp, comm=comm)
    measured = {"forward": fwd - pf, "backward": bwd - pb}
    return {"shape": shape, "cp": cp, "comm": comm, "measured": measured, "estimated": ours,
            "error": {k: ours[k] / measured[k] - 1 for k in ours if measured[k]}}


def main(argv: list[str] | None = None) -> int:
    """Measure each case on the GPU; print the errors and write the results file.

    Args:
        argv: the command line (default ``sys.argv[1:]``).

    Returns:
        The exit status: 0 (also without a GPU, after saying so).
    """
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None,
                    help="directory of the results file (default bench/results/gpu)")
    add_flag(ap)
    a = ap.parse_args(argv)
    guard(a.quick, a.out, "--out")
    a.out = a.out or Path(__file__).parent / "results" / "gpu"
    if not torch.cuda.is_available():
        print("no CUDA GPU here: nothing measured")
        return 0
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    rows = []
    shapes = SHAPES[1:] if a.quick else SHAPES
    for cp, comm in QUICK_CASES if a.quick else CASES:
        dist.init_process_group("fake", store=FakeStore(), rank=cp - 1, world_size=cp)
        try:
            rows += [one(shape, cp, comm) for shape in shapes]
        finally:
            dist.destroy_process_group()
    for r in rows:
        print(f"cp={r['cp']} {r['comm']:9s} seq={r['shape']['seq']:6d} "
              f"fwd {r['measured']['forward'] / 2**20:8.1f} MiB (ours {r['error']['forward']:+.1%})"
              f"  bwd {r['measured']['backward'] / 2**20:8.1f} MiB "
              f"(ours {r['error']['backward']:+.1%})")
    name = torch.cuda.get_device_name().replace(" ", "-")
    a.out.mkdir(parents=True, exist_ok=True)
    path = a.out / f"ring_attention_{name}_{datetime.date.today()}.json"
    path.write_text(json.dumps({"device": name, "torch": torch.__version__, "rows": rows},
                               indent=2) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
