"""What the environment of the process that trains changes in a CUDA estimate: the allocator
options (PYTORCH_CUDA_ALLOC_CONF), the cuBLAS workspace (CUBLAS_WORKSPACE_CONFIG) and which SDPA
kernel torch tries first (the runtime cuDNN, TORCH_CUDNN_SDPA_DEPRIORITIZED)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import LlamaConfig

import hf_memkit as mk
from hf_memkit._estimate.budget import cuda_capacity, memory_budget
from hf_memkit._units import GiB, KiB, MiB

LLAMA = LlamaConfig(hidden_size=128, intermediate_size=344, num_hidden_layers=3,
                    num_attention_heads=4, num_key_value_heads=2, vocab_size=4000,
                    tie_word_embeddings=False)
ARGS = {"per_device_train_batch_size": 2, "bf16": True}
# read by the estimate besides those the shared `clean_cuda_env` clears
MORE_VARS = ("CUBLAS_WORKSPACE_CONFIG", "CUBLASLT_WORKSPACE_SIZE",
             "TORCH_CUBLASLT_UNIFIED_WORKSPACE", "TORCH_CUDNN_SDPA_DEPRIORITIZED")


@pytest.fixture
def env(clean_cuda_env, monkeypatch):
    for var in MORE_VARS:
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def est(device="A100-80GB", **kw):
    return mk.estimate_memory(LLAMA, ARGS, seq_len=128, device=device, cuda_version="12.8", **kw)


# --- PYTORCH_CUDA_ALLOC_CONF --------------------------------------------------------------------

def test_per_process_memory_fraction_shrinks_the_budget(env):
    a100 = mk.get_device("A100-80GB")                     # 80 GiB
    assert memory_budget(a100, headroom=0.05).bytes == int(0.95 * cuda_capacity(a100)[0])
    env.setenv("PYTORCH_CUDA_ALLOC_CONF", "per_process_memory_fraction:0.5")
    b = memory_budget(a100, headroom=0.05)
    half = int(0.5 * cuda_capacity(a100)[0])      # torch's fraction of what CUDA hands out
    assert b.bytes == half
    assert "per_process_memory_fraction:0.5" in b.basis and "PYTORCH_CUDA_ALLOC_CONF" in b.basis
    # an explicit max_memory above the fraction cannot lift torch's limit either
    assert memory_budget(a100, max_memory="70GiB").bytes == half
    assert memory_budget(a100, max_memory="30GiB") == (30 * GiB, "max_memory")
    e = est()
    assert e.budget == half and "per_process_memory_fraction" in e.budget_basis
    # a fraction under what the step needs: it does not fit, though the card is far larger
    env.setenv("PYTORCH_CUDA_ALLOC_CONF", "per_process_memory_fraction:0.005")   # 410 MiB
    assert est().fits is False


def test_cuda_malloc_async_claims_no_caching_allocator_fragmentation(env):
    native = est()
    assert native.breakdown["fragmentation"] > 0        # what the caching allocator adds here
    env.setenv("PYTORCH_CUDA_ALLOC_CONF", "backend:cudaMallocAsync,max_split_size_mb:128")
    e = est()
    assert e.breakdown["fragmentation"] == 0 and e.peak_reserved == e.peak_allocated
    assert e.peak_allocated == native.peak_allocated
    assert not any("caching-allocator model" in n for n in e.notes)
    note = next(n for n in e.notes if n.startswith("backend:cudaMallocAsync"))
    assert "NOT modelled" in note and "lower bound" in note
    assert "max_split_size_mb:128" in note                 # torch ignores it under this backend
    assert e.margin_terms["cudaMallocAsync pool"] > 0      # the pool's unknown overhead: widened
    assert e.margin > native.margin


def test_allocator_options_not_modelled_are_named_never_called_defaults(env):
    env.setenv("PYTORCH_CUDA_ALLOC_CONF", "garbage_collection_threshold:0.6,"
                                          "expandable_segments:True")
    e = est()
    assert not any("defaults" in n for n in e.notes)
    assert any("expandable_segments:True" in n and "caching-allocator model" in n
               for n in e.notes)
    assert any("NOT modelled" in n and "garbage_collection_threshold:0.6" in n for n in e.notes)


def test_roundup_power2_divisions_adds_its_rounding_to_allocated(env):
    plain = est()
    env.setenv("PYTORCH_CUDA_ALLOC_CONF", "roundup_power2_divisions:2")
    e = est()
    extra = e.peak_allocated - plain.peak_allocated
    # rounding a request up to the next half power of two adds less than a third of it
    assert 0 < extra < (plain.breakdown["activations"] + plain.breakdown["temporaries"]) / 3
    assert e.breakdown["temporaries"] - plain.breakdown["temporaries"] == extra
    assert any("roundup_power2_divisions" in n and "caching-allocator model" in n
               for n in e.notes)


# --- CUBLAS_WORKSPACE_CONFIG --------------------------------------------------------------------

# torch's default on sm80 (CublasHandlePool.cpp): ":4096:2:16:8" = 8 MiB + 128 KiB per thread
DEFAULT_SM80 = 4096 * KiB * 2 + 16 * KiB * 8


@pytest.mark.parametrize("config, per_thread", [
    (":4096:8", 4096 * KiB * 8),            # 32 MiB, the Hopper default
    (":16:8", 16 * KiB * 8),                # 128 KiB, the deterministic-algorithms setting
    (":4096:2:16:8", DEFAULT_SM80),         # torch's default spelled out: no change
])
def test_cublas_workspace_config_sets_the_workspace_term(env, config, per_thread):
    plain = est()
    env.setenv("CUBLAS_WORKSPACE_CONFIG", config)
    e = est()
    # two workspaces: the forward thread's and the autograd thread's
    assert e.peak_allocated - plain.peak_allocated == 2 * (per_thread - DEFAULT_SM80)
    assert any(n.startswith(f"CUBLAS_WORKSPACE_CONFIG={config}") for n in e.notes)


def test_cublas_workspaces_parse_as_torch():
    from hf_memkit._cuda.runtime import cublas_workspaces

    assert cublas_workspaces((8, 0), {}).per_thread == (DEFAULT_SM80,)
    assert cublas_workspaces((9, 0), {}).per_thread == (32 * MiB + 128 * KiB,)
    assert cublas_workspaces((9, 0), {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}).per_thread == (
        32 * MiB,)
    # a separate cuBLASLt workspace only when torch does not unify them
    split = {"TORCH_CUBLASLT_UNIFIED_WORKSPACE": "0", "CUBLASLT_WORKSPACE_SIZE": "4096"}
    assert cublas_workspaces((8, 0), split).per_thread == (DEFAULT_SM80, 4 * MiB)
    assert cublas_workspaces((8, 0), {"CUBLASLT_WORKSPACE_SIZE": "4096"}).per_thread == (
        DEFAULT_SM80,)
    with pytest.warns(UserWarning, match=r"CUBLAS_WORKSPACE_CONFIG='4096'.*keeps its default"):
        assert cublas_workspaces((8, 0), {"CUBLAS_WORKSPACE_CONFIG": "4096"}).per_thread == (
            DEFAULT_SM80,)


# --- cuDNN attention ----------------------------------------------------------------------------

def _cudnn(monkeypatch, version: int | None, cuda: str = "12.8"):
    """This process's torch as a CUDA ``cuda`` build whose runtime cuDNN is ``version``."""
    monkeypatch.setattr(torch.version, "cuda", cuda)
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: version is not None)
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: version)


def test_cudnn_preference_follows_the_runtime_cudnn_not_the_cuda_major():
    from hf_memkit._cuda.target import CudaTarget

    # a CUDA 12.8 torch with cuDNN 9.16 tries cuDNN first on H100; CUDA 13 with 9.14 does not
    assert CudaTarget.of((9, 0), "12.8", cudnn_version=91600, env={}).prefers_cudnn is True
    assert CudaTarget.of((9, 0), "13.0", cudnn_version=91400, env={}).prefers_cudnn is False
    assert CudaTarget.of((9, 0), "13.0", cudnn_version=91501, env={}).prefers_cudnn is True
    # sm 9.x / 10.x only; a torch built for CUDA < 13 only sm90, sm100, sm103
    assert CudaTarget.of((8, 0), "12.8", cudnn_version=91600, env={}).prefers_cudnn is False
    assert CudaTarget.of((10, 3), "12.8", cudnn_version=91600, env={}).prefers_cudnn is True
    assert CudaTarget.of((10, 1), "12.8", cudnn_version=91600, env={}).prefers_cudnn is False
    assert CudaTarget.of((10, 1), "13.0", cudnn_version=91600, env={}).prefers_cudnn is True
    # TORCH_CUDNN_SDPA_DEPRIORITIZED=1 puts it after flash and memory-efficient
    off = {"TORCH_CUDNN_SDPA_DEPRIORITIZED": "1"}
    assert CudaTarget.of((9, 0), "13.0", cudnn_version=91600, env=off).prefers_cudnn is False
    with pytest.warns(UserWarning, match="only 0 or 1"):
        assert CudaTarget.of((9, 0), "13.0", env={"TORCH_CUDNN_SDPA_DEPRIORITIZED": "yes"}
                             ).prefers_cudnn is True
    # a catalog target keeps the documented default: assumed from the CUDA version
    assert CudaTarget.of((9, 0), "13.0", env={}).prefers_cudnn is True
    assert CudaTarget.of((9, 0), "12.8", env={}).prefers_cudnn is False


def test_this_machines_runtime_cudnn_picks_the_sdpa_kernel(env):
    this_h100 = dataclasses.replace(mk.get_device("H100-80GB"), source="nvml")
    catalog = est("H100-80GB")
    assert any("flash SDPA kernel" in n for n in catalog.notes)      # CUDA 12 wheels' cuDNN
    _cudnn(env, 91600)
    e = est(this_h100)
    note = next(n for n in e.notes if n.startswith("attention:"))
    assert "cudnn SDPA kernel" in note and "runtime cuDNN 9.16.0" in note
    env.setenv("TORCH_CUDNN_SDPA_DEPRIORITIZED", "1")
    assert any("flash SDPA kernel" in n for n in est(this_h100).notes)
    # a CUDA other than this torch's is another install: its cuDNN is assumed, not read
    env.delenv("TORCH_CUDNN_SDPA_DEPRIORITIZED")
    _cudnn(env, 91600, cuda="13.0")
    assert any("flash SDPA kernel" in n for n in est(this_h100).notes)
