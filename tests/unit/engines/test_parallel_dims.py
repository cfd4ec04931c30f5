"""Parallel dimensions (``_engines.dims``): read from accelerate's own ``ParallelismConfig``,
checked by the same rules accelerate enforces, and one rank's model under transformers'
tensor-parallel plan counted against the plan applied by hand to the full model."""

from __future__ import annotations

import itertools
import math
import warnings

import pytest
import torch
from accelerate.parallelism_config import ParallelismConfig
from accelerate.utils import TorchContextParallelConfig
from transformers import LlamaConfig, Phi3Config, Qwen3Config

import hf_memkit as mk
from hf_memkit._engines.dims import ParallelDims, dims_problems, read_dims
from hf_memkit._errors import ConfigError
from hf_memkit._model.spec import resolve_model
from hf_memkit._model.tensor_parallel import narrowed, tp_problems

LLAMA = LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, vocab_size=4000,
                    tie_word_embeddings=False, max_position_embeddings=8192)
FSDP = {"fsdp": "full_shard", "fsdp_config": {"version": 2}}


def est(args, **kw):
    kw.setdefault("seq_len", 2048)
    kw.setdefault("device", "H100-80GB")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return mk.estimate_memory(LLAMA, {"per_device_train_batch_size": 1, "bf16": True, **args},
                                  **kw)


@pytest.mark.parametrize("sizes", [
    dict(cp_size=4), dict(dp_shard_size=2, cp_size=2), dict(tp_size=2, dp_shard_size=4),
    dict(dp_replicate_size=2, dp_shard_size=2, tp_size=2), dict(sp_size=8)])
def test_read_dims_derives_what_accelerate_derives(sizes):
    pc = ParallelismConfig(**sizes)
    for given in (pc, dict(sizes)):
        dims = read_dims(given)
        assert dims.total == pc.total_size
        assert dims.data_parallel == pc.data_parallel_size
        assert dims.non_data_parallel == pc.non_data_parallel_size
        # FSDP shards over accelerate's joint dp_shard_cp mesh
        assert dims.shard_group == math.prod(pc._sizes[d] for d in ("dp_shard", "cp"))


def test_cp_strategy_read_from_the_handler_and_flat():
    pc = ParallelismConfig(cp_size=2, cp_handler=TorchContextParallelConfig(
        cp_comm_strategy="alltoall"))
    assert read_dims(pc).cp_comm == "alltoall"
    assert read_dims({"cp_size": 2, "cp_comm_strategy": "alltoall"}).cp_comm == "alltoall"
    with pytest.raises(ConfigError, match="cp_comm_strategy='ring' is not one of allgather"):
        read_dims({"cp_size": 2, "cp_comm_strategy": "ring"})
    with pytest.raises(ConfigError, match="no field 'cp'"):
        read_dims({"cp": 2})
    with pytest.raises(ConfigError, match="tp_size=0"):
        read_dims({"tp_size": 0})


def test_the_rules_accelerate_enforces_are_refused_where_accelerate_refuses():
    """Every combination of degrees in {1, 2}: accelerate's ``ParallelismConfig`` raises exactly
    where ``dims_problems`` names one of its two constructor rules (CP with SP, TP/CP with
    replicate-only DP)."""
    for rep, shard, tp, cp, sp in itertools.product((1, 2), repeat=5):
        sizes = dict(dp_replicate_size=rep, dp_shard_size=shard, tp_size=tp, cp_size=cp,
                     sp_size=sp)
        try:
            ParallelismConfig(**sizes)
            refused = False
        except ValueError:
            refused = True
        dims = read_dims(sizes)
        ours = [p for p in dims_problems(dims, processes=dims.total, engine="fsdp")
                if "mutually exclusive" in p or "replicate-only" in p]
        assert bool(ours) == refused, sizes


def test_bad_degrees_name_the_rule_and_the_nearest_valid_ones():
    with pytest.raises(ConfigError) as e:
        est({**FSDP, "parallelism_config": {"cp_size": 2}}, num_gpus=8)
    assert "must equal the number of processes (8)" in str(e.value)
    assert "dp_shard_size=4" in str(e.value)
    with pytest.raises(ConfigError, match="context parallelism on FSDP2"):
        est({"parallelism_config": {"cp_size": 2}}, num_gpus=2)
    with pytest.raises(ConfigError, match="runs on DeepSpeed"):
        est({**FSDP, "parallelism_config": {"sp_size": 2}}, num_gpus=2)
    with pytest.raises(ConfigError, match=r"tp_size=3 does not divide .*use tp_size in \[2, 4\]"):
        est({"parallelism_config": {"tp_size": 3}}, num_gpus=3)
    with pytest.raises(ConfigError, match="with attn_implementation='eager'.*use 'sdpa'"):
        est({**FSDP, "parallelism_config": {"cp_size": 2}}, num_gpus=2,
            attn_implementation="eager")
    with pytest.raises(ConfigError, match="TRL refuses it"):
        est({**FSDP, "parallelism_config": {"cp_size": 2}, "packing": True}, num_gpus=2,
            trainer="sft")


def test_rank_sequence_is_padded_to_the_ring_and_ulysses_multiples():
    assert ParallelDims(cp=4).rank_seq(1001) == 252      # padded to 1008 (8 = 2 x cp) / 4
    assert ParallelDims(cp=4).rank_seq(1024) == 256
    assert ParallelDims(sp=4).rank_seq(1001) == 251      # padded to 1004 / 4
    assert ParallelDims(dp_shard=8).rank_seq(1001) == 1001


def _tp_shard_by_hand(model, tp):
    """Elements one rank holds when the plan transformers itself assembles for the model
    (``model._tp_plan``: the config's, the head's and the auto-added embedding) is applied by
    hand: colwise splits a Linear's rows (out features), rowwise its columns, the gathered head
    and the vocab-parallel embedding their rows; anything not in the plan is whole."""
    total, plan = 0, model._tp_plan
    for name, p in model.named_parameters():
        module = name.rsplit(".", 1)[0]
        style = next((s for k, s in plan.items() if _matches(k, module)), None)
        if style in ("colwise", "colwise_gather_output", "embedding_rowwise"):
            total += p.shape[0] // tp * math.prod(p.shape[1:])
        elif style == "rowwise":
            total += p.shape[0] * (p.shape[1] // tp)
        else:
            total += p.numel()
    return total


def _matches(key, module):
    k, m = key.split("."), module.split(".")
    return len(k) == len(m) and all(a in ("*", b) for a, b in zip(k, m, strict=True))


@pytest.mark.parametrize("config", [LLAMA, Qwen3Config(
    hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=96, vocab_size=3000, tie_word_embeddings=False)])
@pytest.mark.parametrize("tp", [2])
def test_one_tp_rank_holds_the_plan_applied_by_hand(config, tp):
    spec = resolve_model(config, dtype=torch.bfloat16)
    assert not tp_problems(spec, tp)
    rank = narrowed(spec, tp)
    assert "model.embed_tokens" in spec.meta._tp_plan
    expected = _tp_shard_by_hand(spec.meta, tp)
    weights, trainable = rank.states()
    assert sum(p.numel for p in trainable) == expected
    assert weights == 2 * expected + sum(b.numel() * b.element_size()
                                         for b in rank.meta.buffers())
    attn = rank.meta.model.layers[0].self_attn
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // 4
    assert attn.q_proj.out_features == config.num_attention_heads // tp * head_dim


def test_plans_tp_cannot_reproduce_are_refused():
    phi3 = resolve_model(Phi3Config(hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                                    num_attention_heads=4, num_key_value_heads=4,
                                    vocab_size=500, pad_token_id=0, bos_token_id=1,
                                    eos_token_id=2))
    assert "does not model" in tp_problems(phi3, 2)[0]
    gpt2 = resolve_model("gpt2")
    assert "has no tensor-parallel plan" in tp_problems(gpt2, 2)[0]


def test_per_rank_estimates_shrink_with_each_dimension():
    plain = est(FSDP, num_gpus=2)
    cp = est({**FSDP, "parallelism_config": {"cp_size": 2}}, num_gpus=2)
    tp = est({"parallelism_config": {"tp_size": 2}}, num_gpus=2)
    hsdp = est({**FSDP, "parallelism_config": {"dp_replicate_size": 2, "dp_shard_size": 2}},
               num_gpus=4)
    assert cp.model_states == plain.model_states          # FSDP over dp_shard x cp = 2 ranks
    assert cp.breakdown["activations"] < 0.6 * plain.breakdown["activations"]
    assert cp.setup.parallel.cp == 2 and cp.setup.sharding.world_size == 2
    assert hsdp.setup.sharding.world_size == 2 and hsdp.setup.sharding.replicas == 2
    assert hsdp.model_states == plain.model_states
    assert "HSDP: 2 replicas" in hsdp.setup.sharding.label()
    assert tp.setup.sharding.engine == "none" and tp.peak_allocated < est({}).peak_allocated


LONG = LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, vocab_size=4000,
                   tie_word_embeddings=False, max_position_embeddings=65536)


def _plan(**kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return mk.plan_training(LONG, device="H100-80GB", **kw)


def test_fewer_sequences_than_ranks_splits_each_sequence(tmp_path):
    from accelerate.commands.config.config_args import ClusterConfig

    plan = _plan(seq_len=16384, target_batch_size=1, num_gpus=2)
    ta = plan.training_args_kwargs
    assert ta["parallelism_config"] == {"dp_shard_size": 1, "cp_size": 2,
                                        "cp_comm_strategy": "allgather"}
    assert ta["fsdp"] and plan.model_kwargs["attn_implementation"] == "sdpa"
    assert plan.estimate.setup.parallel.cp == 2
    assert plan.notes[0].startswith("context parallelism x2 (torch ring attention")
    assert plan.notes[0].endswith("chosen because 1 sequence(s) per step on 2 ranks")
    # the Trainer hands parallelism_config to its Accelerator: accelerate's own object
    with warnings.catch_warnings():   # fp32 cannot run CP on CUDA: the override's re-estimate
        warnings.simplefilter("ignore")
        args = plan.to_training_args(output_dir=str(tmp_path), bf16=False, tf32=False,
                                     use_cpu=True)
    assert isinstance(args.parallelism_config, ParallelismConfig)
    assert args.parallelism_config.cp_size == 2 and args.parallelism_config.total_size == 2
    # the YAML is what `accelerate launch --config_file` reads
    path = tmp_path / "accelerate_config.yaml"
    path.write_text(plan.accelerate_config())
    cfg = ClusterConfig.from_yaml_file(str(path))
    assert cfg.distributed_type == "FSDP" and cfg.num_processes == 2
    assert cfg.parallelism_config["parallelism_config_cp_size"] == 2
    assert cfg.fsdp_config["fsdp_version"] == 2
    assert "--config_file accelerate_config.yaml" in plan.launch_commands()["accelerate_config"]


def test_context_parallelism_only_where_whole_sequences_do_not_fit():
    whole = _plan(seq_len=32768, target_batch_size=2, num_gpus=2, method="full",
                  max_memory="6GiB")
    assert "parallelism_config" not in whole.training_args_kwargs
    split = _plan(seq_len=32768, target_batch_size=2, num_gpus=2, method="full",
                  max_memory="3GiB")
    assert split.training_args_kwargs["parallelism_config"]["cp_size"] == 2
    assert split.chosen.grad_accum == 2        # one data-parallel group takes both sequences
    assert split.estimate.device_used <= split.budget
    with pytest.raises(mk.HfMemkitError, match="context parallelism.*does not fit either"):
        _plan(seq_len=32768, target_batch_size=2, num_gpus=2, method="full", max_memory="2GiB")


def test_a_million_token_sft_of_an_8b_model_plans_on_one_8xh100_node():
    """Issue 27's acceptance: the planner splits each sequence over the 8 GPUs and offloads the
    checkpointed layer inputs; what it hands over is what accelerate and the Trainer take."""
    import yaml

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = mk.plan_training("Llama-3.1-8B", seq_len=1_048_576, target_batch_size=1,
                                device="H100-80GB", num_gpus=8, trainer="sft")
    ta = plan.training_args_kwargs
    assert ta["parallelism_config"]["cp_size"] == 8 and ta["fsdp"]
    assert plan.estimate.setup.parallel.cp == 8
    assert plan.estimate.seq_len == 1_048_576
    assert plan.estimate.upper <= plan.budget
    if "checkpoint_offload" in plan.chosen.techniques:   # the Trainer checkpoints, FSDP does not
        assert ta["activation_checkpointing_kwargs"]["offload"] is True
        assert "activation_checkpointing" not in ta["fsdp_config"]
    cfg = yaml.safe_load(plan.accelerate_config())
    assert cfg["num_processes"] == 8 and cfg["distributed_type"] == "FSDP"
    assert cfg["parallelism_config"]["parallelism_config_cp_size"] == 8


def test_deepspeed_plans_split_sequences_with_ulysses():
    plan = _plan(seq_len=16384, target_batch_size=1, num_gpus=2, engine="deepspeed")
    ta = plan.training_args_kwargs
    assert ta["parallelism_config"] == {"sp_size": 2, "sp_backend": "deepspeed"}
    assert ta["deepspeed"]["zero_optimization"]["stage"] == 3
    assert plan.estimate.setup.parallel.sp == 2 and plan.estimate.setup.sharding.world_size == 2
    assert plan.notes[0].startswith("sequence parallelism x2 (DeepSpeed Ulysses")
    # 3 ranks cannot split 4 heads: no degree is tried, the whole-sequence refusal stands
    with pytest.raises(mk.HfMemkitError, match="not divisible|no sequence-parallel degree"):
        _plan(seq_len=16384, target_batch_size=1, num_gpus=3, engine="deepspeed")


def test_a_split_plan_round_trips_and_pinned_degrees_set_the_batch_rule():
    plan = _plan(seq_len=16384, target_batch_size=1, num_gpus=2)
    again = mk.Plan.from_json(plan.to_json())
    assert again.training_args_kwargs["parallelism_config"]["cp_size"] == 2
    # the user's own degrees: one sequence per step is one per data-parallel group
    pinned = _plan(seq_len=16384, target_batch_size=1, num_gpus=2, **FSDP,
                   parallelism_config={"cp_size": 2})
    assert pinned.chosen.parallel == "pinned" and pinned.chosen.micro_batch == 1
    assert pinned.estimate.setup.parallel.cp == 2
    with pytest.raises(ConfigError, match="not divisible by 2 data-parallel ranks"):
        _plan(seq_len=1024, target_batch_size=3, num_gpus=4, **FSDP,
              parallelism_config={"dp_shard_size": 2, "cp_size": 2})


def test_a_split_that_cannot_fit_is_refused_after_one_search():
    """The most split request (the most ranks, the ring) holds the least per rank: where it does
    not fit, the planner refuses at once instead of searching every degree and strategy; where
    it fits, the smallest degree that fits is still the one chosen, and the most split's search
    is not run twice."""
    from types import SimpleNamespace

    from hf_memkit._errors import HfMemkitError
    from hf_memkit._plan.request import PlanRequest
    from hf_memkit._plan.sequence import plan_split

    req = PlanRequest("Llama-3.1-8B", 4096, 8, "H100-80GB", num_gpus=8)
    tried: list[tuple[int, str]] = []

    def never(sub):
        tried.append((sub.split.cp, sub.split.cp_comm))
        raise HfMemkitError(f"cp {sub.split.cp} {sub.split.cp_comm} does not fit")

    with pytest.raises(HfMemkitError, match="does not fit either: cp 8 alltoall does not fit"):
        plan_split(req, never, HfMemkitError("whole sequences do not fit"))
    assert tried == [(8, "alltoall")]

    tried.clear()

    def from_four(sub):
        tried.append((sub.split.cp, sub.split.cp_comm))
        if sub.split.cp < 4:
            raise HfMemkitError("too long")
        return SimpleNamespace(notes=[], cp=sub.split.cp, comm=sub.split.cp_comm)

    out = plan_split(req, from_four, HfMemkitError("whole sequences do not fit"))
    assert (out.cp, out.comm) == (4, "allgather")
    assert tried == [(8, "alltoall"), (2, "allgather"), (2, "alltoall"), (4, "allgather")]


@pytest.mark.parametrize("pinned, engine, stage", [
    ({"cp_size": 2}, "fsdp", None), ({"sp_size": 2}, "deepspeed", 3),
    ({"cp_size": 2, "dp_shard_size": 2}, "fsdp", None)])
def test_a_pinned_split_is_planned_on_the_engine_that_runs_it(pinned, engine, stage):
    """Issue 47: a pinned cp_size used to ask the user to add FSDP2 (the DDP candidates refused
    it); the planner picks the engine itself, as for its own splits."""
    ranks = 2 * pinned.get("dp_shard_size", 1)
    plan = _plan(seq_len=16384, target_batch_size=ranks, num_gpus=ranks,
                 parallelism_config=pinned)
    ta, dims = plan.training_args_kwargs, plan.estimate.setup.parallel
    assert (dims.cp, dims.sp, dims.dp_shard) == (pinned.get("cp_size", 1),
                                                  pinned.get("sp_size", 1),
                                                  pinned.get("dp_shard_size", 1))
    assert all(ta["parallelism_config"][k] == v for k, v in pinned.items())
    if engine == "fsdp":
        assert ta["fsdp"] and ta["fsdp_config"]["version"] == 2 and "deepspeed" not in ta
    else:
        assert ta["deepspeed"]["zero_optimization"]["stage"] == stage and "fsdp" not in ta
        assert ta["deepspeed"]["train_batch_size"] == plan.chosen.micro_batch * \
            plan.chosen.grad_accum          # one data-parallel rank: both ranks split a sequence


DS = {"deepspeed": {"zero_optimization": {"stage": 3}, "bf16": {"enabled": True}}}


class _AcceleratorState:
    """What ``ParallelismConfig._validate_accelerator`` reads of an ``Accelerator`` (its
    launch: processes and engine), so that accelerate's own rule decides."""

    def __init__(self, processes, engine):
        from accelerate.utils import DistributedType

        self.num_processes, self.multi_device = processes, engine == "ddp"
        self.is_fsdp2, self.is_main_process = engine == "fsdp", True
        self.distributed_type = {"ddp": DistributedType.MULTI_GPU, "fsdp": DistributedType.FSDP,
                                 "deepspeed": DistributedType.DEEPSPEED}[engine]


@pytest.mark.parametrize("engine,args", [("ddp", {}), ("fsdp", FSDP), ("deepspeed", DS)])
def test_all_ones_on_several_processes_is_what_accelerate_makes_of_it(engine, args):
    """accelerate accepts a ParallelismConfig of all ones on 4 processes under every engine
    (``_validate_accelerator``; no device mesh is built) and runs plain data parallelism: DDP
    replicas (it sets dp_replicate_size=4), FSDP2 and ZeRO over every rank. hf_memkit refused it
    ("total size 1 must equal the number of processes")."""
    pc = ParallelismConfig()
    assert pc.build_device_mesh("cpu") is None        # no active dimension: no mesh
    pc._validate_accelerator(_AcceleratorState(4, engine))   # raises where accelerate refuses
    assert pc.dp_replicate_size == (4 if engine == "ddp" else 1)
    e = est({**args, "parallelism_config": {"dp_shard_size": 1}}, num_gpus=4)
    assert e.phase_peaks == est(args, num_gpus=4).phase_peaks
    assert any("all ones on 4 processes" in n for n in e.notes)


@pytest.mark.parametrize("args,sizes", [
    ({}, {"cp_size": 2}), (DS, {"tp_size": 2, "dp_shard_size": 2}),
    (DS, {"dp_replicate_size": 2, "dp_shard_size": 2})])
def test_layouts_accelerate_accepts_and_hf_memkit_does_not_model_say_so(args, sizes):
    engine = "deepspeed" if args else "ddp"
    ParallelismConfig(**sizes)._validate_accelerator(_AcceleratorState(4 if args else 2, engine))
    with pytest.raises(ConfigError) as e:
        est({**args, "parallelism_config": sizes}, num_gpus=4 if args else 2)
    assert "accelerate accepts the layout, but hf_memkit estimates only" in str(e.value)
