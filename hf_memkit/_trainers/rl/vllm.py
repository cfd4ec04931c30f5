"""A colocated vLLM engine's GPU memory, from vLLM's own rules, as pure arithmetic.

TRL's ``GRPOTrainer``/``RLOOTrainer`` with ``use_vllm=True, vllm_mode="colocate"`` build a
``vllm.LLM`` inside the training process, on the training GPU (TRL 1.16,
``trl/generation/vllm_generation.py``: ``VLLMGeneration.__init__``). TRL passes
``gpu_memory_utilization``, ``max_model_len`` (``vllm_max_model_length``), ``max_num_seqs``
(``per_device_train_batch_size * vllm_tensor_parallel_size * steps_per_generation``,
``trl/trainer/grpo_trainer.py``: ``GRPOTrainer.__init__``), ``max_num_batched_tokens=4096``,
``tensor_parallel_size``, ``enable_sleep_mode`` and ``quantization="bitsandbytes"`` for a 4-bit
bnb policy. It passes no ``dtype``, ``enforce_eager``, ``kv_cache_dtype`` or ``block_size``, so
vLLM's defaults hold: the checkpoint's dtype (TRL passes ``model.name_or_path``: vLLM loads the
checkpoint from disk), CUDA graphs on, KV cache in the model dtype, 16-token blocks. TRL 1.16
accepts vLLM 0.22 to 0.31 (``trl/import_utils.py``: ``is_vllm_available``).

vLLM's v1 engine sizes itself at start-up, in this order:

1. ``requested = ceil(total_memory * gpu_memory_utilization)``; the engine refuses to start when
   free memory is below it (``vllm/v1/worker/utils.py``: ``request_memory``, called from
   ``vllm/v1/worker/gpu_worker.py``: ``Worker.init_device``). In colocation the trainer's own
   tensors are already resident, so they count against free memory, not against the share.
2. It loads its weights and runs ``GPUModelRunner.profile_run``: one dummy forward of
   ``max_num_batched_tokens`` tokens (attention skipped) and the sampler over
   ``min(max_num_seqs, max_num_batched_tokens)`` rows (``vllm/v1/worker/gpu_model_runner.py``:
   ``profile_run``, ``_dummy_run``, ``_dummy_sampler_run``). ``memory_profiling``
   (``vllm/utils/mem_utils.py``) charges the drop in free memory (weights + persistent + non-torch)
   plus the transient torch peak above what stays allocated.
3. It also captures the CUDA graphs once into a throwaway pool and subtracts that estimate
   (``GPUModelRunner.profile_cudagraph_memory``, gated by
   ``VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS`` in ``vllm/envs.py``: added off by default in vllm
   PR #30515, on by default since v0.21.0 as vLLM's start-up log says, "CUDA graph memory
   profiling is enabled (default since v0.21.0)").
   ``available_kv = requested - non_kv_cache_memory - cudagraph_estimate``
   (``Worker.determine_available_memory``).
4. ``num_blocks = available // page_size // num_layers`` (``vllm/v1/core/kv_cache_utils.py``:
   ``get_num_blocks``), one block kept back as the null block (``vllm/v1/core/block_pool.py``:
   ``BlockPool``); start-up fails when nothing is left or one ``max_model_len`` request does not fit
   (``check_enough_kv_cache_memory``).
5. The real graphs are captured after the KV cache (``Worker.compile_or_warm_up_model`` ->
   ``GPUModelRunner.capture_model``, logged as "Graph capturing finished in X secs, took Y GiB").

So the engine's footprint is about its share whatever the split inside it: an error in the
activation or graph terms moves bytes between them and the KV cache, not the total.
Not modelled: sliding-window/hybrid KV specs (treated as full attention), encoder/multimodal
profiling, speculative decoding, LoRA in vLLM, pipeline parallelism.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..._errors import ConfigError
from ..._units import MiB, format_bytes

TRL_MAX_NUM_BATCHED_TOKENS = 4096   # VLLMGeneration.__init__ passes this literal to LLM(...)
TRL_SLEEP_LEVEL = 2                 # VLLMGeneration: self.llm.sleep(level=2)
DEFAULT_BLOCK_SIZE = 16             # vllm/config/cache.py: CacheConfig.DEFAULT_BLOCK_SIZE
MAX_DEFAULT_CAPTURE_SIZE = 512      # vllm/config/vllm.py: VllmConfig._set_cudagraph_sizes
# Approximation, not a vLLM rule: bytes one captured CUDA graph keeps. vLLM logs 0.31 GiB for 11
# PIECEWISE graphs ("Graph capturing finished in 8 secs, took 0.31 GiB") and "Estimated CUDA graph
# memory: 0.36 GiB total" for 16 (gpustack/runner PR #251, vLLM 0.27.1); vllm issue #50780 measures
# "the real FULL graphs cost ~24 MiB each". Pass cuda_graph_bytes= from a real log to override.
CUDA_GRAPH_BYTES = 24 * MiB
MAX_LEN_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length",
                "model_max_length", "max_target_positions", "max_sequence_length",
                "max_seq_length", "seq_len")   # vllm/config/model.py: _get_and_verify_max_len
UNSCALED_ROPE = ("su", "longrope", "llama3")     # rope types whose factor vLLM does not apply
KV_CACHE_DTYPES = {"auto": None, "bfloat16": 2, "float16": 2, "fp8": 1, "fp8_e4m3": 1,
                   "fp8_e5m2": 1, "fp8_inc": 1}  # vllm/config/cache.py: CacheDType

SOURCES = (
    "trl/generation/vllm_generation.py: VLLMGeneration.__init__ (LLM kwargs, sleep(level=2))",
    "trl/trainer/grpo_trainer.py: GRPOTrainer.__init__ (max_num_seqs)",
    "vllm/v1/worker/utils.py: request_memory (start-up free-memory rule)",
    "vllm/v1/worker/gpu_worker.py: Worker.determine_available_memory",
    "vllm/utils/mem_utils.py: memory_profiling",
    "vllm/v1/worker/gpu_model_runner.py: GPUModelRunner.profile_run / _dummy_sampler_run",
    "vllm/v1/worker/gpu_model_runner.py: GPUModelRunner.profile_cudagraph_memory / capture_model",
    "vllm/envs.py: VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS",
    "vllm/config/vllm.py: VllmConfig._set_cudagraph_sizes",
    "vllm/v1/core/kv_cache_utils.py: get_num_blocks / check_enough_kv_cache_memory",
    "vllm/v1/kv_cache_interface.py: FullAttentionSpec / MLAAttentionSpec page_size_bytes",
    "vllm/config/model.py: ModelConfig.get_num_kv_heads / _get_and_verify_max_len",
    "vllm/config/cache.py: CacheConfig.DEFAULT_BLOCK_SIZE",
    "vllm/config/scheduler.py: SchedulerConfig._verify_args",
    "vllm/device_allocator/cumem.py: CuMemAllocator.sleep; gpu_worker.py: Worker.sleep",
)


_REQUIRED = object()


def _help(text: str, default: Any = _REQUIRED) -> Any:
    """A dataclass field with its ``help`` (docs/style.md §3)."""
    if default is _REQUIRED:
        return field(metadata={"help": text})
    return field(default=default, metadata={"help": text})


@dataclass(frozen=True)
class VllmSettings:
    """What TRL passes to ``vllm.LLM`` in colocate mode (``VLLMGeneration.__init__``)."""

    gpu_memory_utilization: float = _help(
        "vllm_gpu_memory_utilization: the fraction of total GPU memory vLLM may use (TRL 0.3)")
    max_model_len: int | None = _help(
        "vllm_max_model_length; None: vLLM derives it from the model config")
    max_num_seqs: int = _help(
        "per_device_train_batch_size * vllm_tensor_parallel_size * steps_per_generation")
    max_num_batched_tokens: int = _help("TRL passes 4096", TRL_MAX_NUM_BATCHED_TOKENS)
    tensor_parallel_size: int = _help("vllm_tensor_parallel_size", 1)
    enable_sleep_mode: bool = _help("vllm_enable_sleep_mode", False)
    enforce_eager: bool = _help("TRL does not pass it: vLLM's default False", False)
    kv_cache_dtype: str = _help("TRL does not pass it: 'auto' is the model dtype", "auto")
    block_size: int = _help("tokens per KV block; TRL does not pass it", DEFAULT_BLOCK_SIZE)
    sleep_level: int = _help("level TRL passes to llm.sleep()", TRL_SLEEP_LEVEL)
    profile_cudagraphs: bool = _help(
        "VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS (default 1 since vLLM 0.21): graphs come out "
        "of the share", True)

    def __post_init__(self) -> None:
        problems = []
        if not 0 < self.gpu_memory_utilization <= 1:
            problems.append(f"gpu_memory_utilization={self.gpu_memory_utilization} must be in "
                            "(0, 1] (vllm/config/cache.py: CacheConfig); e.g. 0.3")
        for name in ("max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size",
                     "block_size"):
            if getattr(self, name) < 1:
                problems.append(f"{name}={getattr(self, name)} must be a positive integer")
        if self.max_model_len is not None and self.max_model_len < 1:
            problems.append(f"max_model_len={self.max_model_len} must be positive or None")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            problems.append(f"kv_cache_dtype `{self.kv_cache_dtype}` unknown; known: "
                            + ", ".join(KV_CACHE_DTYPES))
        if self.sleep_level not in (1, 2):
            problems.append(f"sleep_level={self.sleep_level} must be 1 or 2 (Worker.sleep)")
        if problems:
            raise ConfigError(problems, source="VllmSettings")

    @classmethod
    def from_trl(cls, get: Callable[[str], Any], *, per_device_train_batch_size: int,
                 steps_per_generation: int) -> VllmSettings:
        """The settings a GRPOConfig/RLOOConfig gives; ``get(field)`` reads one of its fields.

        ``steps_per_generation`` is the resolved value (GRPOConfig.__post_init__ sets it to
        ``gradient_accumulation_steps`` when unset); max_num_seqs follows GRPOTrainer.__init__."""
        tp = int(get("vllm_tensor_parallel_size"))
        return cls(
            gpu_memory_utilization=float(get("vllm_gpu_memory_utilization")),
            max_model_len=get("vllm_max_model_length"),
            max_num_seqs=per_device_train_batch_size * tp * steps_per_generation,
            tensor_parallel_size=tp,
            enable_sleep_mode=bool(get("vllm_enable_sleep_mode")),
        )


@dataclass(frozen=True)
class VllmMemory:
    """Bytes a colocated vLLM engine holds on one GPU (see the module docstring for the rules)."""

    share: int = _help("ceil(gpu_memory_utilization * total_memory): vLLM's budget")
    weights: int = _help("its copy of the weights on this GPU (weight_bytes / TP)")
    activation_peak: int = _help("profile_run's transient peak at max_num_batched_tokens")
    non_torch: int = _help("non-torch increase during start-up (NCCL, workspaces)")
    cuda_graphs: int = _help("CUDA graph memory (0 with enforce_eager)")
    kv_cache: int = _help("KV cache allocated: whole blocks of what the share leaves")
    kv_capacity_tokens: int = _help("tokens the KV cache holds (null block excluded)")
    kv_demand: int = _help("bytes for max_num_seqs sequences of tokens_per_seq, in blocks")
    kv_demand_tokens: int = _help("tokens of that demand, rounded up to whole blocks per sequence")
    kv_bytes_per_token: int = _help("KV bytes per token over all layers on this GPU")
    max_model_len: int = _help("max_model_len vLLM runs with (given or derived)")
    tokens_per_seq: int = _help("tokens one sequence may hold for the demand")
    awake: int = _help("resident while generating: weights + KV + activations + non-torch + graphs")
    asleep: int = _help("resident after sleep (the training step); awake minus activations "
                        "without sleep mode")
    asleep_host: int = _help("pinned host bytes sleep keeps (level 1 offloads the weights)")
    startup_free_needed: int = _help("free memory vLLM needs at start-up (request_memory)")
    refusals: tuple[str, ...] = _help("why vLLM would refuse to start; empty if it starts")
    notes: tuple[str, ...] = _help("warnings and approximations, with their numbers")
    sources: tuple[str, ...] = _help("the vLLM/TRL functions these rules follow", SOURCES)


def _text(config: Any) -> Any:
    get_text = getattr(config, "get_text_config", None)
    return get_text() if callable(get_text) else config


def is_mla(config: Any) -> bool:
    """DeepSeek-style latent attention (``kv_lora_rank``): vLLM's ``use_mla``."""
    return getattr(_text(config), "kv_lora_rank", None) is not None


def kv_bytes_per_token(config: Any, *, dtype_itemsize: int, tensor_parallel_size: int = 1) -> int:
    """KV-cache bytes one token takes on one GPU, over all layers.

    Full attention (``vllm/v1/kv_cache_interface.py``: ``FullAttentionSpec.page_size_bytes`` =
    ``2 * block_size * num_kv_heads * head_size * dtype_size``, per layer): K and V, each
    ``num_kv_heads`` heads of ``head_dim``; ``num_kv_heads = max(1, total_kv_heads // TP)``
    (``ModelConfig.get_num_kv_heads``: heads are replicated when fewer than TP ranks).
    ``num_key_value_heads`` defaults to ``num_attention_heads``, ``head_dim`` to
    ``hidden_size // num_attention_heads``. MLA (``MLAAttentionSpec``): one latent of
    ``kv_lora_rank + qk_rope_head_dim`` per token and layer, no K/V pair, replicated on every TP
    rank. Sliding-window layers are counted as full attention."""
    text = _text(config)
    layers = int(text.num_hidden_layers)
    if is_mla(text):
        return layers * (int(text.kv_lora_rank) + int(text.qk_rope_head_dim)) * dtype_itemsize
    heads = int(text.num_attention_heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
    return 2 * layers * max(1, kv_heads // tensor_parallel_size) * head_dim * dtype_itemsize


def derived_max_model_len(config: Any) -> int:
    """``max_model_len`` vLLM derives when none is given (``vllm/config/model.py``:
    ``_get_and_verify_max_len``): the smallest of ``MAX_LEN_KEYS`` in the config (2048 when none),
    times the rope-scaling ``factor`` unless the rope type is su/longrope/llama3 (yarn starts from
    ``original_max_position_embeddings``). vLLM also caps it by the tokenizer's
    ``model_max_length``; that file is not read here."""
    text = _text(config)
    found = [int(v) for k in MAX_LEN_KEYS if (v := getattr(text, k, None)) is not None]
    length = float(min(found)) if found else 2048.0
    rope = getattr(text, "rope_scaling", None) or getattr(text, "rope_parameters", None) or {}
    rope_type = rope.get("rope_type", rope.get("type"))
    if rope_type is not None and rope_type not in UNSCALED_ROPE:
        if rope_type == "yarn" and rope.get("original_max_position_embeddings"):
            length = float(rope["original_max_position_embeddings"])
        length *= float(rope.get("factor") or 1.0)
    return int(length)


def cudagraph_capture_sizes(max_num_seqs: int, max_num_batched_tokens: int) -> list[int]:
    """Default batch sizes vLLM captures (``vllm/config/vllm.py``:
    ``VllmConfig._set_cudagraph_sizes``): ``[1, 2, 4] + range(8, 256, 8) + range(256, top + 1, 16)``
    up to ``top = min(max_num_seqs * 2, 512, max_num_batched_tokens)``."""
    top = min(max_num_seqs * 2, MAX_DEFAULT_CAPTURE_SIZE, max_num_batched_tokens)
    sizes = [s for s in (1, 2, 4) if s <= top]
    sizes += list(range(8, min(top + 1, 256), 8)) + list(range(256, top + 1, 16))
    return sizes


def cuda_graph_count(settings: VllmSettings) -> int:
    """Graphs captured under the default ``cudagraph_mode=FULL_AND_PIECEWISE``: one PIECEWISE graph
    per capture size (mixed prefill-decode) and one FULL graph per uniform-decode size
    ``<= max_num_seqs`` (``vllm/v1/cudagraph_dispatcher.py``:
    ``CudagraphDispatcher.initialize_cudagraph_keys``); 0 with enforce_eager."""
    if settings.enforce_eager:
        return 0
    sizes = cudagraph_capture_sizes(settings.max_num_seqs, settings.max_num_batched_tokens)
    return len(sizes) + sum(1 for s in sizes if s <= settings.max_num_seqs)


def approx_activation_peak(config: Any, settings: VllmSettings, *, dtype_itemsize: int) -> int:
    """An approximation of ``profile_run``'s transient peak, not vLLM's measurement.

    Forward (attention skipped, inference mode, one layer alive at a time): ``T`` =
    max_num_batched_tokens tokens of residual, hidden and down-projection output (3 * hidden) plus
    the MLP's gate_up output and activation (3 * intermediate / TP), in the model dtype. Sampler
    (``_dummy_sampler_run``, after the forward, with its T x hidden output still held): ``R`` =
    min(max_num_seqs, T) rows of full-vocabulary logits (gathered over TP) in the model dtype, plus
    three fp32 copies (the float32 logits, the softmax probabilities, the exponential noise of the
    random sampler). The peak is the larger of the two."""
    text = _text(config)
    hidden = int(text.hidden_size)
    inter = int(getattr(text, "intermediate_size", None) or 4 * hidden)
    tokens = settings.max_num_batched_tokens
    forward = tokens * dtype_itemsize * (3 * hidden + 3 * inter // settings.tensor_parallel_size)
    rows = min(settings.max_num_seqs, tokens)
    sampler = (tokens * hidden * dtype_itemsize
               + rows * int(text.vocab_size) * (dtype_itemsize + 3 * 4))
    return max(forward, sampler)


def _is_sliding(config: Any) -> bool:
    text = _text(config)
    if "sliding_attention" in (getattr(text, "layer_types", None) or ()):
        return True
    return (getattr(text, "sliding_window", None) is not None
            and getattr(text, "use_sliding_window", True) is not False)


@dataclass(frozen=True)
class _Kv:
    """The KV arithmetic of one engine: per-token bytes and the block they come in."""

    per_token: int
    block_size: int

    @property
    def block(self) -> int:
        return self.per_token * self.block_size

    def blocks(self, tokens: int) -> int:
        return -(-tokens // self.block_size)


def _startup_refusals(settings: VllmSettings, *, share: int, total: int,
                      free_at_startup: int | None, derived_len: int) -> list[str]:
    out = []
    if free_at_startup is not None and free_at_startup < share:
        out.append(f"free memory at start-up ({format_bytes(free_at_startup)}/"
                   f"{format_bytes(total)}) is less than desired GPU memory utilization "
                   f"({settings.gpu_memory_utilization}, {format_bytes(share)}) "
                   "(vllm/v1/worker/utils.py: request_memory); lower vllm_gpu_memory_utilization "
                   "or free memory before the trainer builds vLLM")
    if settings.max_num_batched_tokens < settings.max_num_seqs:
        out.append(f"max_num_batched_tokens ({settings.max_num_batched_tokens}) must be greater "
                   f"than or equal to max_num_seqs ({settings.max_num_seqs}) "
                   "(vllm/config/scheduler.py: SchedulerConfig._verify_args); lower "
                   "per_device_train_batch_size * steps_per_generation")
    if settings.max_model_len is not None and settings.max_model_len > derived_len:
        out.append(f"max_model_len ({settings.max_model_len}) is greater than the model's "
                   f"derived max_model_len ({derived_len}) (vllm/config/model.py: "
                   "_get_and_verify_max_len) unless VLLM_ALLOW_LONG_MAX_MODEL_LEN=1")
    return out


def _kv_refusals(available: int, kv: _Kv, max_model_len: int) -> list[str]:
    if available <= 0:
        return [f"no available memory for the cache blocks ({format_bytes(available)} left of "
                "the share) (vllm/v1/core/kv_cache_utils.py: check_enough_kv_cache_memory); "
                "raise vllm_gpu_memory_utilization"]
    needed = (kv.blocks(max_model_len) + 1) * kv.block   # + the null block BlockPool keeps back
    if needed > available:
        return [f"one request of max_model_len {max_model_len:,} tokens needs "
                f"{format_bytes(needed)} of KV cache, more than the {format_bytes(available)} "
                "available (check_enough_kv_cache_memory); set vllm_max_model_length (prompt + "
                "max_completion_length) or raise vllm_gpu_memory_utilization"]
    return []


def _notes(config: Any, settings: VllmSettings, m: dict[str, int], *, traced: bool,
           graphs_measured: bool) -> list[str]:
    notes = []
    if 0 < m["kv_capacity_tokens"] < m["kv_demand_tokens"]:   # no cache at all is a refusal
        notes.append(
            f"vLLM's KV cache holds {m['kv_capacity_tokens']:,} tokens "
            f"({format_bytes(m['kv_cache'])}) but {settings.max_num_seqs} sequences x "
            f"{m['tokens_per_seq']:,} tokens need {m['kv_demand_tokens']:,} "
            f"({format_bytes(m['kv_demand'])}): the scheduler preempts and recomputes requests, "
            "so generation slows; it does not run out of memory")
    if not traced:
        notes.append(f"activation_peak {format_bytes(m['activation_peak'])} is an approximation "
                     "of profile_run (forward at max_num_batched_tokens + sampler), not a trace")
    if m["cuda_graphs"] and not graphs_measured:
        notes.append(f"cuda_graphs {format_bytes(m['cuda_graphs'])} is an approximation: "
                     f"{cuda_graph_count(settings)} graphs x {format_bytes(CUDA_GRAPH_BYTES)} "
                     "(from vLLM's 'Graph capturing finished ... took' logs)")
    if m["cuda_graphs"] and not settings.profile_cudagraphs:
        notes.append("VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=0: graphs are captured after the "
                     "KV cache, outside the share")
    if settings.tensor_parallel_size > 1:
        notes.append("tensor parallel: weights counted as weight_bytes / TP; NCCL buffers are "
                     "in non_torch only if passed")
    if _is_sliding(config) and not is_mla(config):
        notes.append("sliding-window layers are counted as full attention (vLLM's "
                     "SlidingWindowSpec needs less): KV demand is an upper bound")
    if not settings.enable_sleep_mode:
        notes.append("vllm_enable_sleep_mode=False: weights and KV cache stay resident through "
                     "the training step")
    return notes


def colocated_vllm(config: Any, settings: VllmSettings, *, total_memory: int, weight_bytes: int,
                   dtype_itemsize: int, activation_peak: int | None = None,
                   cuda_graphs: bool | None = None, cuda_graph_bytes: int | None = None,
                   tokens_per_seq: int | None = None, non_torch: int = 0,
                   free_at_startup: int | None = None) -> VllmMemory:
    """The memory of the colocated engine on one GPU, by the rules in the module docstring.

    ``weight_bytes``: the policy as vLLM loads it (checkpoint dtype; 4-bit bytes for a bnb
    policy), divided by TP here. ``activation_peak``: a traced no-grad forward peak at
    max_num_batched_tokens, else ``approx_activation_peak``. ``cuda_graphs``: None follows
    ``enforce_eager``; ``cuda_graph_bytes`` a measured capture. ``tokens_per_seq``: prompt +
    max_completion_length for the demand (capped at max_model_len), else max_model_len.
    ``non_torch``: measured non-torch increase (0 by default). ``total_memory``: what
    ``torch.cuda.mem_get_info`` reports (less than the card's nominal size). ``free_at_startup``:
    free bytes when the trainer builds vLLM, to apply the start-up rule."""
    tp = settings.tensor_parallel_size
    kv_itemsize = KV_CACHE_DTYPES[settings.kv_cache_dtype] or dtype_itemsize
    kv = _Kv(kv_bytes_per_token(config, dtype_itemsize=kv_itemsize, tensor_parallel_size=tp),
             settings.block_size)
    derived_len = derived_max_model_len(config)
    max_len = settings.max_model_len or derived_len
    per_seq = min(tokens_per_seq or max_len, max_len)
    share = math.ceil(total_memory * settings.gpu_memory_utilization)
    graphs_on = (not settings.enforce_eager) if cuda_graphs is None else cuda_graphs
    m = {"share": share, "weights": -(-weight_bytes // tp), "non_torch": non_torch,
         "tokens_per_seq": per_seq,
         "activation_peak": activation_peak if activation_peak is not None
         else approx_activation_peak(config, settings, dtype_itemsize=dtype_itemsize),
         "cuda_graphs": 0 if not graphs_on else cuda_graph_bytes if cuda_graph_bytes is not None
         else cuda_graph_count(settings) * CUDA_GRAPH_BYTES}
    available = (share - m["weights"] - m["activation_peak"] - non_torch
                 - (m["cuda_graphs"] if settings.profile_cudagraphs else 0))
    num_blocks = max(available, 0) // kv.block
    m["kv_cache"] = num_blocks * kv.block
    m["kv_capacity_tokens"] = max(num_blocks - 1, 0) * settings.block_size
    m["kv_demand_tokens"] = settings.max_num_seqs * kv.blocks(per_seq) * settings.block_size
    m["kv_demand"] = m["kv_demand_tokens"] * kv.per_token
    resident = m["weights"] + m["kv_cache"] + m["cuda_graphs"] + non_torch
    asleep = m["cuda_graphs"] + non_torch if settings.enable_sleep_mode else resident
    host = m["weights"] if settings.enable_sleep_mode and settings.sleep_level == 1 else 0
    refusals = _startup_refusals(settings, share=share, total=total_memory,
                                 free_at_startup=free_at_startup, derived_len=derived_len)
    refusals += _kv_refusals(available, kv, max_len)
    notes = _notes(config, settings, m, traced=activation_peak is not None,
                   graphs_measured=cuda_graph_bytes is not None)
    return VllmMemory(**m, kv_bytes_per_token=kv.per_token, max_model_len=max_len,
                      awake=resident + m["activation_peak"], asleep=asleep, asleep_host=host,
                      startup_free_needed=share, refusals=tuple(refusals), notes=tuple(notes))
