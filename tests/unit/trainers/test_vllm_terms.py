"""A colocated vLLM engine's memory (``hf_memkit._trainers.rl.vllm``), term by term against vLLM's
rules as its code writes them. Every expected number is worked out by hand here, from the rule
cited beside it, never read back from the function under test."""

from __future__ import annotations

import math
import warnings

import pytest
from transformers import DeepseekV3Config, LlamaConfig, MistralConfig

from hf_memkit._errors import ConfigError
from hf_memkit._trainers.rl.vllm import (
    CUDA_GRAPH_BYTES,
    VllmSettings,
    colocated_vllm,
    cuda_graph_count,
    cudagraph_capture_sizes,
    derived_max_model_len,
    kv_bytes_per_token,
)
from hf_memkit._units import GiB, MiB
from tests.helpers import require

# Llama-3.1-8B's config.json, as built here without a download.
LLAMA_8B = LlamaConfig(
    hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072,
    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
BF16 = 2
PER_TOKEN_8B = 2 * 32 * 8 * 128 * BF16    # K and V x layers x kv heads x head_dim x bytes


def _settings(**kw) -> VllmSettings:
    base = {"gpu_memory_utilization": 0.3, "max_model_len": 2048, "max_num_seqs": 8}
    return VllmSettings(**{**base, **kw})


def _engine(settings: VllmSettings, **kw):
    """Llama-3.1-8B on an 80 GiB GPU with the terms fixed by hand: 16 GiB of weights, a 1 GiB
    activation peak, no graphs, unless a test says otherwise."""
    base = {"total_memory": 80 * GiB, "weight_bytes": 16 * GiB, "dtype_itemsize": BF16,
            "activation_peak": 1 * GiB, "cuda_graphs": False}
    return colocated_vllm(LLAMA_8B, settings, **{**base, **kw})


# --- KV bytes per token: FullAttentionSpec.page_size_bytes / block_size, summed over layers ----

def test_kv_bytes_per_token_llama_3_1_8b():
    assert kv_bytes_per_token(LLAMA_8B, dtype_itemsize=BF16) == 131072


def test_tensor_parallel_halves_kv_heads_and_replicates_below_one_head():
    assert kv_bytes_per_token(LLAMA_8B, dtype_itemsize=BF16, tensor_parallel_size=2) == 65536
    # 8 KV heads over 16 ranks: ModelConfig.get_num_kv_heads keeps max(1, 8 // 16) = 1 per rank
    assert kv_bytes_per_token(LLAMA_8B, dtype_itemsize=BF16,
                              tensor_parallel_size=16) == 2 * 32 * 1 * 128 * BF16


def test_head_dim_is_read_before_hidden_over_heads():
    cfg = LlamaConfig(hidden_size=1024, num_attention_heads=16, num_key_value_heads=4,
                      head_dim=128, num_hidden_layers=2)     # 1024 // 16 would be 64
    assert kv_bytes_per_token(cfg, dtype_itemsize=BF16) == 2 * 2 * 4 * 128 * BF16


def test_mla_caches_one_latent_per_token_on_every_rank():
    cfg = DeepseekV3Config()          # 61 layers, kv_lora_rank 512, qk_rope_head_dim 64
    want = 61 * (512 + 64) * BF16     # MLAAttentionSpec: no K/V pair, one "head"
    assert kv_bytes_per_token(cfg, dtype_itemsize=BF16) == want
    assert kv_bytes_per_token(cfg, dtype_itemsize=BF16, tensor_parallel_size=8) == want


def test_fp8_kv_cache_dtype_takes_one_byte_per_element():
    m = _engine(_settings(kv_cache_dtype="fp8"))
    assert m.kv_bytes_per_token == 2 * 32 * 8 * 128 * 1


# --- the share, the KV cache, the demand --------------------------------------------------------

def test_share_minus_weights_and_activations_is_the_kv_cache():
    m = _engine(_settings())
    share = math.ceil(80 * GiB * 0.3)                # request_memory: ceil(total * utilization)
    assert m.share == m.startup_free_needed == share == 24 * GiB
    left = share - 16 * GiB - 1 * GiB                # determine_available_memory
    block = 16 * PER_TOKEN_8B                        # 16-token block over all 32 layers: 2 MiB
    assert block == 2 * MiB
    assert m.kv_cache == left // block * block == 7 * GiB
    assert m.kv_capacity_tokens == (7 * GiB // block - 1) * 16 == 57328   # null block kept back
    assert m.weights == 16 * GiB and m.refusals == ()


def test_kv_cache_is_floored_to_whole_blocks():
    m = _engine(_settings(), activation_peak=1 * GiB + 3 * MiB)
    assert m.kv_cache == 7 * GiB - 4 * MiB           # 7 GiB - 3 MiB holds 3582 whole 2 MiB blocks


def test_demand_is_whole_blocks_per_sequence():
    m = _engine(_settings(max_num_seqs=64), tokens_per_seq=1000)
    assert m.tokens_per_seq == 1000
    assert m.kv_demand_tokens == 64 * 63 * 16        # ceil(1000 / 16) = 63 blocks each
    assert m.kv_demand == 64 * 63 * 16 * PER_TOKEN_8B


def test_demand_without_tokens_per_seq_is_max_model_len_and_is_capped_by_it():
    assert _engine(_settings()).kv_demand_tokens == 8 * 2048
    assert _engine(_settings(), tokens_per_seq=5000).tokens_per_seq == 2048


def test_demand_above_the_cache_is_a_preemption_note_naming_both():
    m = _engine(_settings(max_num_seqs=64), tokens_per_seq=2048)
    # 64 x 2048 = 131,072 tokens (16 GiB) against 57,328 tokens (7 GiB)
    note = next(n for n in m.notes if "preempt" in n)
    assert "57,328 tokens" in note and "7.00 GiB" in note
    assert "131,072" in note and "16.00 GiB" in note
    assert "does not run out of memory" in note
    assert not any("preempt" in n for n in _engine(_settings(max_num_seqs=2)).notes)


# --- start-up refusals ---------------------------------------------------------------------------

def test_startup_refuses_when_free_memory_is_below_the_request():
    refused = _engine(_settings(), free_at_startup=20 * GiB).refusals
    assert len(refused) == 1 and "less than desired GPU memory utilization" in refused[0]
    assert "24.00 GiB" in refused[0] and "20.00 GiB" in refused[0]
    assert _engine(_settings(), free_at_startup=24 * GiB).refusals == ()   # free < requested only


def test_no_memory_left_for_the_cache_is_refused():
    m = _engine(_settings(), weight_bytes=24 * GiB)
    assert m.kv_cache == 0 and m.kv_capacity_tokens == 0
    assert any("no available memory for the cache blocks" in r for r in m.refusals)


def test_default_max_model_len_of_llama_3_1_does_not_fit_one_request():
    m = _engine(_settings(max_model_len=None))
    assert m.max_model_len == 131072                 # llama3 rope: factor not applied
    # one request: 131072 / 16 = 8192 blocks + the null block, x 2 MiB > 7 GiB available
    refusal = next(r for r in m.refusals if "one request" in r)
    assert "131,072 tokens" in refusal and f"{8193 * 2 / 1024:.2f} GiB" in refusal


def test_more_sequences_than_batched_tokens_is_refused():
    m = _engine(_settings(max_num_seqs=5000))
    assert any("max_num_batched_tokens (4096) must be greater than or equal to max_num_seqs "
               "(5000)" in r for r in m.refusals)


def test_max_model_len_above_the_derived_one_is_refused():
    cfg = LlamaConfig(max_position_embeddings=4096, num_hidden_layers=2)
    m = colocated_vllm(cfg, _settings(max_model_len=8192), total_memory=80 * GiB,
                       weight_bytes=GiB, dtype_itemsize=BF16, activation_peak=0)
    assert any("derived max_model_len (4096)" in r for r in m.refusals)


def test_derived_max_model_len_applies_the_rope_factor_except_llama3():
    assert derived_max_model_len(LLAMA_8B) == 131072
    linear = LlamaConfig(max_position_embeddings=4096,
                         rope_scaling={"rope_type": "linear", "factor": 2.0})
    assert derived_max_model_len(linear) == 8192
    yarn = LlamaConfig(max_position_embeddings=131072,
                       rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                     "original_max_position_embeddings": 32768})
    assert derived_max_model_len(yarn) == 131072     # original 32768 x 4
    assert derived_max_model_len(LlamaConfig(max_position_embeddings=4096)) == 4096


# --- CUDA graphs ---------------------------------------------------------------------------------

def test_capture_sizes_follow_set_cudagraph_sizes():
    assert cudagraph_capture_sizes(8, 4096) == [1, 2, 4, 8, 16]           # top = 2 x 8
    big = cudagraph_capture_sizes(300, 4096)                              # top = min(600, 512)
    assert len(big) == 3 + 31 + 17 and big[-1] == 512 and 248 in big and 264 not in big
    assert cudagraph_capture_sizes(8, 8)[-1] == 8                         # capped by tokens


def test_graph_count_is_piecewise_sizes_plus_full_decode_sizes():
    assert cuda_graph_count(_settings()) == 5 + 4    # FULL only for sizes <= max_num_seqs = 8
    assert cuda_graph_count(_settings(enforce_eager=True)) == 0


def test_graphs_come_out_of_the_share_when_profiled():
    m = _engine(_settings(), cuda_graphs=True)
    graphs = 9 * CUDA_GRAPH_BYTES
    assert m.cuda_graphs == graphs
    assert m.kv_cache == (7 * GiB - graphs) // (2 * MiB) * (2 * MiB)
    assert any("approximation" in n and "9 graphs" in n for n in m.notes)


def test_unprofiled_graphs_are_captured_outside_the_share():
    m = _engine(_settings(profile_cudagraphs=False), cuda_graphs=True, cuda_graph_bytes=300 * MiB)
    assert m.cuda_graphs == 300 * MiB and m.kv_cache == 7 * GiB
    assert m.awake == 24 * GiB + 300 * MiB            # the share, plus the graphs beside it


def test_enforce_eager_captures_no_graph():
    m = colocated_vllm(LLAMA_8B, _settings(enforce_eager=True), total_memory=80 * GiB,
                       weight_bytes=16 * GiB, dtype_itemsize=BF16, activation_peak=GiB)
    assert m.cuda_graphs == 0


# --- activations ---------------------------------------------------------------------------------

def test_untraced_activation_peak_is_the_documented_approximation():
    m = colocated_vllm(LLAMA_8B, _settings(), total_memory=80 * GiB, weight_bytes=16 * GiB,
                       dtype_itemsize=BF16, cuda_graphs=False)
    forward = 4096 * BF16 * (3 * 4096 + 3 * 14336)                  # 4096 batched tokens
    sampler = 4096 * 4096 * BF16 + 8 * 128256 * (BF16 + 3 * 4)      # 8 rows of logits
    assert m.activation_peak == max(forward, sampler) == 452984832
    assert any(n.startswith("activation_peak") and "approximation" in n for n in m.notes)
    assert not any(n.startswith("activation_peak") for n in _engine(_settings()).notes)


# --- awake, asleep -------------------------------------------------------------------------------

def test_awake_is_the_whole_engine_while_generating():
    m = _engine(_settings(), cuda_graphs=True, cuda_graph_bytes=200 * MiB, non_torch=100 * MiB)
    kv = (24 * GiB - 16 * GiB - 1 * GiB - 200 * MiB - 100 * MiB) // (2 * MiB) * (2 * MiB)
    assert m.kv_cache == kv
    assert m.awake == 16 * GiB + kv + 1 * GiB + 200 * MiB + 100 * MiB


def test_without_sleep_mode_weights_and_kv_stay_through_training():
    m = _engine(_settings(), cuda_graphs=True, cuda_graph_bytes=200 * MiB)
    assert m.asleep == 16 * GiB + m.kv_cache + 200 * MiB and m.asleep_host == 0


def test_sleep_level_2_discards_weights_and_kv():
    m = _engine(_settings(enable_sleep_mode=True), cuda_graphs=True, cuda_graph_bytes=200 * MiB,
                non_torch=50 * MiB)
    assert m.asleep == 200 * MiB + 50 * MiB and m.asleep_host == 0   # TRL: sleep(level=2)


def test_sleep_level_1_offloads_weights_to_host():
    m = _engine(_settings(enable_sleep_mode=True, sleep_level=1), cuda_graphs=True,
                cuda_graph_bytes=200 * MiB)
    assert m.asleep == 200 * MiB and m.asleep_host == 16 * GiB


def test_tensor_parallel_splits_the_weights():
    m = _engine(_settings(tensor_parallel_size=2))
    assert m.weights == 8 * GiB
    assert m.kv_bytes_per_token == PER_TOKEN_8B // 2


def test_sliding_window_is_said_to_be_an_upper_bound():
    cfg = MistralConfig(num_hidden_layers=2)
    m = colocated_vllm(cfg, _settings(), total_memory=80 * GiB, weight_bytes=GiB,
                       dtype_itemsize=BF16, activation_peak=0)
    assert any("sliding-window" in n for n in m.notes)


# --- settings ------------------------------------------------------------------------------------

def test_bad_settings_are_reported_together():
    with pytest.raises(ConfigError) as exc:
        VllmSettings(gpu_memory_utilization=1.5, max_model_len=0, max_num_seqs=0,
                     kv_cache_dtype="int3")
    msg = str(exc.value)
    assert "4 problem(s)" in msg
    assert "gpu_memory_utilization=1.5" in msg and "max_num_seqs=0" in msg
    assert "max_model_len=0" in msg and "`int3`" in msg


def _trl_config(cls_name: str, **kw):
    trl = require("trl")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return getattr(trl, cls_name)(output_dir="unused", use_cpu=True, bf16=False,
                                      report_to=[], **kw)


@pytest.mark.parametrize("cls_name", ["GRPOConfig", "RLOOConfig"])
def test_from_trl_reads_the_defaults(cls_name):
    cfg = _trl_config(cls_name)
    s = VllmSettings.from_trl(lambda f: getattr(cfg, f),
                              per_device_train_batch_size=cfg.per_device_train_batch_size,
                              steps_per_generation=cfg.steps_per_generation)
    assert s.gpu_memory_utilization == 0.3 and s.max_model_len is None
    assert s.tensor_parallel_size == 1 and s.enable_sleep_mode is False
    assert s.max_num_seqs == cfg.per_device_train_batch_size * 1 * 1 == 8
    assert s.max_num_batched_tokens == 4096 and s.enforce_eager is False
    assert s.kv_cache_dtype == "auto" and s.sleep_level == 2


def test_from_trl_reads_explicit_values():
    cfg = _trl_config("GRPOConfig", per_device_train_batch_size=4, gradient_accumulation_steps=4,
                      num_generations=4, vllm_gpu_memory_utilization=0.5,
                      vllm_max_model_length=2048, vllm_tensor_parallel_size=2,
                      vllm_enable_sleep_mode=True)
    assert cfg.steps_per_generation == 4             # GRPOConfig: defaults to grad accumulation
    s = VllmSettings.from_trl(lambda f: getattr(cfg, f), per_device_train_batch_size=4,
                              steps_per_generation=cfg.steps_per_generation)
    assert s.max_num_seqs == 4 * 2 * 4               # batch x TP x steps_per_generation
    assert (s.gpu_memory_utilization, s.max_model_len) == (0.5, 2048)
    assert s.tensor_parallel_size == 2 and s.enable_sleep_mode is True
