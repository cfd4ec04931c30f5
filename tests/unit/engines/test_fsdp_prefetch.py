"""FSDP2's forward prefetch on CUDA (issue 45), against a hand count made from the config alone.

FSDP2's implicit forward prefetching (torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py,
the note above ``FSDPCommContext`` and ``get_all_gather_streams``: "Use separate streams for
implicit prefetching") overlaps the next layer's all-gather, on ``all_gather_stream``, with the
current layer's compute: on CUDA two decoder layers are unsharded at once in the forward. A
CPU (gloo, no separate stream) gathers them one at a time. So, all else equal, the CUDA
forward holds exactly one more decoder layer's unsharded parameters, in the
``MixedPrecisionPolicy``'s ``param_dtype`` (bf16 under ``bf16=True``: 2 bytes each).

The comparison is a double difference so that what a CPU trace and a CUDA trace do differently
(kernels, autocast) cancels: FULL_SHARD (``reshard_after_forward=True``) against
SHARD_GRAD_OP (every layer stays gathered, the same on both devices), on each device.
"""

from __future__ import annotations

import warnings

import pytest
from transformers import LlamaConfig

import hf_memkit as mk
from tests.helpers import llama_counts

TINY = LlamaConfig(hidden_size=128, intermediate_size=344, num_hidden_layers=4,
                   num_attention_heads=4, num_key_value_heads=2, vocab_size=2000,
                   tie_word_embeddings=False, attention_dropout=0.0)


def _forward(device: str, reshard: bool) -> int:
    args = {"per_device_train_batch_size": 1, "bf16": True, "fsdp": True,
            "fsdp_config": {"version": 2, "reshard_after_forward": reshard}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        e = mk.estimate_memory(TINY, args, seq_len=64, device=device, num_gpus=2)
    return e.phase_peaks["forward"]


def test_fsdp2_on_cuda_holds_one_more_gathered_layer_in_the_forward():
    k = llama_counts(TINY)
    # one decoder layer: q, k, v, o, gate, up, down and its two RMSNorm weights
    layer = sum(a * b for a, b in k["linears"]) + 2 * TINY.hidden_size
    assert layer == 181_504
    full_shard_saves = {dev: _forward(dev, False) - _forward(dev, True)
                        for dev in ("H100-80GB", "cpu")}
    # the CUDA FULL_SHARD forward holds the prefetched layer too: it saves one layer less
    extra = full_shard_saves["cpu"] - full_shard_saves["H100-80GB"]
    assert extra == pytest.approx(2 * layer, abs=1024), (extra, 2 * layer, full_shard_saves)
