"""``stage="forward_backward"`` against a real run: a tiny Llama's forward + backward measured
through RSS in a child process (MALLOC_MMAP_THRESHOLD_ + clear_refs + VmHWM:
docs/stack-facts.md#cpu-ground-truth)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from transformers import LlamaConfig

import hf_memkit as mk
from tests.unit.cuda.test_cuda_fidelity import TINY_LLAMA

_FB_CHILD = textwrap.dedent('''
    import json, sys
    import torch, transformers
    from hf_memkit._device.rss import alive_cpu_tensor_bytes
    from hf_memkit.testing.groundtruth import close_window, open_window

    spec = json.loads(sys.argv[1])
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**spec["config"]))
    model.train()
    ids = torch.randint(0, model.config.vocab_size, (spec["batch"], spec["seq"]))
    peaks = []
    for _ in range(3):  # the first also makes thread pools and kernel caches (not tensors)
        model.zero_grad(set_to_none=True)
        window = open_window(alive_cpu_tensor_bytes())
        model(input_ids=ids, labels=ids).loss.backward()
        peaks.append(close_window(window)["peak"])
    print("@@" + json.dumps({"peaks": peaks,
                             "params": sum(p.numel() for p in model.parameters())}))
''')


def _measure_forward_backward(config: dict, batch: int, seq: int) -> dict:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", HF_HUB_OFFLINE="1",
               TRANSFORMERS_VERBOSITY="error", PYTHONWARNINGS="ignore")
    env.setdefault("OMP_NUM_THREADS", "2")
    proc = subprocess.run([sys.executable, "-c", _FB_CHILD,
                           json.dumps({"config": config, "batch": batch, "seq": seq})],
                          env=env, capture_output=True, text=True, timeout=300)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("@@")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1][2:])


@pytest.mark.slow
def test_forward_backward_stage_has_no_optimizer_state_and_matches_a_real_run():
    """``stage="forward_backward"`` is ``model(**batch).loss.backward()`` with no optimizer.

    Parameters by hand (LlamaForCausalLM, V=1000, h=128, I=344, 2 layers, 4 heads = 4 KV heads):
    embed 1000*128 + per layer (4*128*128 attention + 3*128*344 MLP + 2*128 norms) * 2 + final
    norm 128 + lm_head 1000*128 = 651,904 in 21 tensors. AdamW (torch/optim/adamw.py
    ``_init_group``) keeps exp_avg and exp_avg_sq (8 bytes per fp32 parameter) and a 0-dim fp32
    ``step`` per tensor, which the train estimate carries in every phase and forward_backward
    does not. The estimate's peak is checked against a real forward + backward measured by RSS
    (docs/stack-facts.md#cpu-ground-truth: MALLOC_MMAP_THRESHOLD_=65536, clear_refs + VmHWM,
    plus the tensors alive when the window opens; steady-state iterations 2 and 3)."""
    n_params = 1000 * 128 + 2 * (4 * 128 * 128 + 3 * 128 * 344 + 2 * 128) + 128 + 1000 * 128
    n_tensors = 1 + 2 * 9 + 1 + 1
    cfg = LlamaConfig(**TINY_LLAMA)
    fb = mk.estimate_memory(cfg, {"per_device_train_batch_size": 4}, seq_len=128, device="cpu",
                            stage="forward_backward")
    train = mk.estimate_memory(cfg, {"per_device_train_batch_size": 4, "optim": "adamw_torch"},
                               seq_len=128, device="cpu")
    assert fb.breakdown["optimizer"] == 0 and fb.peak_phase in ("forward", "backward")
    assert train.breakdown["optimizer"] == 8 * n_params + 4 * n_tensors
    assert train.peak_allocated - fb.peak_allocated >= 8 * n_params

    measured = _measure_forward_backward(TINY_LLAMA, batch=4, seq=128)
    assert measured["params"] == n_params == 651_904
    steady = max(measured["peaks"][1:])
    # measured 2026-11-28, 3 runs: -0.17%, +0.11%, +0.03%; 1% is the floor for an RSS-measured
    # figure (its run-to-run spread, 0.3 points here, differs between machines)
    assert fb.peak_allocated == pytest.approx(steady, rel=0.01), (fb.peak_allocated, measured)
