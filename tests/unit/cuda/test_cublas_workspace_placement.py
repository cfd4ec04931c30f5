"""Where the cuBLAS workspaces are allocated, and what that does to reserved memory (issue 43,
item 4: reserved 11-12% low on Qwen2 and GPT-2 pure bf16 forward/backward and Qwen2 Adafactor).

torch allocates a thread's cuBLAS workspace through the caching allocator the first time that
thread's handle is used on a stream (aten/src/ATen/cuda/CublasHandlePool.cpp,
``getCUDABlasWorkspace``: one per (handle, stream), kept for the process; handles are per thread),
so the autograd thread's is allocated at the backward's first matmul, after the loss freed the
logits. On the H200 runs (bench/results/gpu) step 1's max_allocated is one workspace (32 MiB +
128 KiB on sm_90) below step 2's, and step 2 reserves one fp32-logits block more than step 1
(GPT-2: +786 MiB; Qwen2: +2374 MiB): the workspace split the freed logits' block, so the next
step's logits need a new segment. The replay used to allocate both workspaces before the step.
"""

from __future__ import annotations

from transformers import GPT2Config

from hf_memkit._cuda.events import ALLOC, FREE, MARK, WORKSPACE_MARKS
from hf_memkit._cuda.runtime import cublas_workspace
from hf_memkit._cuda.target import CudaTarget
from hf_memkit._estimate.allocation import replay_step, step_events
from hf_memkit._model.spec import resolve_model
from hf_memkit._trace.step import trace_step
from hf_memkit._units import KiB, MiB

FORWARD, BACKWARD = WORKSPACE_MARKS
WS = 32 * MiB + 128 * KiB  # sm_90's workspace per thread (":4096:8:16:8")


def _step(marked: bool) -> list:
    """A step shaped like the runs': the logits (100 MiB) freed by the loss, then the head's
    weight gradient (8 MiB) as the backward's first matmul output; the marks where the trace
    puts them (the forward's first matmul is a 4 MiB activation's)."""
    fwd = [(MARK, FORWARD, 0)] if marked else []
    bwd = [(MARK, BACKWARD, 0)] if marked else []
    return [(ALLOC, "w", 512), (MARK, "micro0", 0), (ALLOC, "h", 4 * MiB), *fwd,
            (ALLOC, "logits", 100 * MiB), (FREE, "h", 0), (FREE, "logits", 0),
            (ALLOC, "gw", 8 * MiB), *bwd]


def test_autograd_workspace_splits_the_freed_logits_and_step_2_needs_a_new_segment():
    """CUDACachingAllocator.cpp's rules, by hand (no optimizer; 512 B-multiple sizes):
      w 512 B: small pool, a 2 MiB segment S.
      h 4 MiB: large pool, < 10 MiB (kMinLargeAlloc) -> a 20 MiB segment A, split (16 MiB left);
      forward's workspace 32 MiB + 128 KiB: no free block that large -> a segment rounded up to
        2 MiB (kRoundLarge), 34 MiB, split (1 MiB + 896 KiB left: more than kSmallSize);
      logits 100 MiB: a 100 MiB segment L1; h, logits freed: A and L1 whole again.
      gw 8 MiB: best fit = A (20 MiB), split. Autograd's workspace: best fit = L1 (100 MiB),
        split: 67 MiB + 896 KiB left in L1, and the workspace is never freed.
      gw freed at zero_grad. Step 2: logits 100 MiB: no free block that large -> L2, 100 MiB.
    reserved 2 + 20 + 34 + 100 + 100 = 256 MiB; allocated peaks in step 2 at w + h + both
    workspaces + logits = 512 B + 4 + 2 x (32 MiB + 128 KiB) + 100 MiB."""
    s = replay_step(_step(True), (8 * MiB,), state_ratio=0.0, transient_ratio=0.0,
                    workspaces=(WS, WS), optimizer=False, micro_steps=1)
    assert s.peak_reserved == 256 * MiB
    assert s.peak_allocated == 512 + 4 * MiB + 2 * WS + 100 * MiB


def test_without_marks_the_workspaces_come_first_and_step_2_reuses_the_logits_segment():
    """An old trace (no marks): both workspaces after the weights, each in a 34 MiB segment of
    its own (the first's 1 MiB + 896 KiB remainder is too small for the second). Then
    h 4 MiB -> 20 MiB segment A; logits -> L1 100 MiB; gw 8 MiB -> A (h freed): L1 stays whole
    and step 2's logits reuse it: reserved 2 + 34 + 34 + 20 + 100 = 190 MiB, 66 MiB less than
    with the workspaces where torch allocates them."""
    s = replay_step(_step(False), (8 * MiB,), state_ratio=0.0, transient_ratio=0.0,
                    workspaces=(WS, WS), optimizer=False, micro_steps=1)
    assert s.peak_reserved == 190 * MiB


def test_workspaces_go_at_their_marks_in_step_1_only():
    """The forward thread's workspaces (the first half) at the forward mark, autograd's at the
    backward mark, once: step 2 reuses them."""
    got = list(step_events(_step(True), (8 * MiB,), state_ratio=0.0, transient_ratio=0.0,
                           workspaces=(WS, WS), optimizer=False, micro_steps=1))
    names = [h for op, h, _ in got if op == ALLOC]
    assert names == ["w", (1, "h"), ("cublas", 0), (1, "logits"), (1, "gw"), ("cublas", 1),
                     (2, "h"), (2, "logits"), (2, "gw")]


def test_trace_marks_each_direction_after_its_first_matmul_output():
    """A small fp32 GPT-2 traced for CUDA (batch 2 x 48 tokens = 96 rows, hidden 64, vocab
    400). The forward's first matmul is block 0's c_attn (Conv1D: addmm, 96 x 192 fp32); the
    backward's first is the tied head's weight gradient (400 x 64 fp32), after the loss's
    backward has allocated its logits-sized (96 x 400 fp32) gradients, which need no matmul."""
    cfg = GPT2Config(n_embd=64, n_layer=2, n_head=2, vocab_size=400, n_positions=128)
    spec = resolve_model(cfg, task="causal-lm")
    log = trace_step(spec.model_cls, cfg, task="causal-lm", micro_batch=2, seq_len=48,
                     target=CudaTarget((9, 0))).events
    marks = [(i, h) for i, (op, h, _) in enumerate(log.events) if op == MARK]
    assert [h for _, h in marks] == ["micro0", FORWARD, BACKWARD]
    fwd, bwd = marks[1][0], marks[2][0]
    assert log.events[fwd - 1][::2] == (ALLOC, 96 * 192 * 4)
    assert log.where[fwd][1] is False and log.where[bwd][1] is True
    assert log.events[bwd - 1][::2] == (ALLOC, 400 * 64 * 4)
    loss_grads = [n for (op, _, n), (_, back) in zip(log.events[:bwd], log.where[:bwd],
                                                       strict=True) if op == ALLOC and back]
    assert 96 * 400 * 4 in loss_grads


def test_sm90_workspace_is_the_one_the_runs_show():
    """The step-1 / step-2 max_allocated gap of the H200 fwd-bwd runs is one workspace:
    GPT-2 5_150 - 5_117 MB, Qwen2 14_206 - 14_172 MB (both 33-34 MB), torch's sm_90 default."""
    assert cublas_workspace((9, 0)) // 2 == WS == 33_685_504
