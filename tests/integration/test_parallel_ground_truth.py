"""Two real gloo ranks on this CPU (torchrun) under tensor parallelism and DeepSpeed Ulysses
sequence parallelism, measured per rank by ``hf_memkit.testing.groundtruth_dist`` (ranks in
``hf_memkit.testing._parallel_worker``), checked against facts computed here by hand from the
config and against a single-process run of the same model on the same data; and context
parallelism's known failure on CPU pinned (the day torch handles it, this says so)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap

import pytest

from hf_memkit._run.synthetic import SyntheticTextDataset, tiny_llama_config
from hf_memkit.testing.groundtruth_dist import measure_distributed_peak
from hf_memkit.testing.models import spec_model
from tests.helpers import BENCH, require

pytestmark = pytest.mark.slow

STEPS, LR = 4, 3e-3


def _tp_case() -> dict:
    """bench/_dist_cases.py's cheapest TP case (fp32, seq 256 x 4), 4 steps on learnable
    counting sequences at a learning rate high enough for the updates to move the loss."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    import _dist_cases

    spec = next(c for c in _dist_cases.parallel_cases() if c["name"] == "tp-fp32")
    spec = {k: v for k, v in spec.items() if k != "name"}
    spec.update(steps=STEPS, learnable=True, args={**spec["args"], "learning_rate": LR})
    return spec


@pytest.fixture(scope="module")
def tp():
    spec = _tp_case()
    return spec, measure_distributed_peak(spec, nproc=2)


def _hand_local_params(cfg: dict, world: int) -> dict[str, int]:
    """One TP rank's parameter elements under Llama's plan, from the config alone: q/k/v/gate/up
    colwise (out features split), o/down rowwise (in features split), embed_tokens vocab-split,
    lm_head colwise (vocab split), every RMSNorm weight whole on each rank."""
    h, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    kv = cfg["num_key_value_heads"] * (h // cfg["num_attention_heads"])
    per_layer = (h * h + 2 * kv * h) // world + h * h // world + 2 * inter * h // world \
        + inter * h // world
    norms = (2 * cfg["num_hidden_layers"] + 1) * h
    local = cfg["num_hidden_layers"] * per_layer + 2 * vocab * h // world + norms
    full = cfg["num_hidden_layers"] * (2 * h * h + 2 * kv * h + 3 * inter * h) \
        + 2 * vocab * h + norms
    return {"local": local, "full": full, "embed_local": vocab * h // world,
            "embed_full": vocab * h}


def test_tp_shards_parameters_as_the_plan_implies(tp):
    spec, res = tp
    hand = _hand_local_params(spec["config"], 2)
    for rk in res["ranks"]:
        assert rk["world_size"] == 2
        assert rk["local_param_bytes"] == 4 * hand["local"]            # fp32
        assert rk["full_param_bytes"] == 4 * hand["full"]
        layout = rk["tp"]
        styles = {k.rsplit(".", 1)[-1]: v for k, v in layout["plan"].items()}
        assert {styles[m] for m in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")} == {
            "colwise"}
        assert styles["o_proj"] == styles["down_proj"] == "rowwise"
        assert styles["embed_tokens"] == "embedding_rowwise"
        assert styles["lm_head"] == "colwise_gather_output"
        assert layout["embed_tokens_sharded"] and layout["lm_head_sharded"]
        p = layout["params"]
        assert p["model.layers.0.self_attn.q_proj.weight"]["placements"] == ["Shard(dim=0)"]
        assert p["model.layers.0.mlp.down_proj.weight"]["placements"] == ["Shard(dim=1)"]
        n_layers = spec["config"]["num_hidden_layers"]
        assert len(layout["plain_params"]) == 2 * n_layers + 1      # the RMSNorm weights
        assert all("norm" in name for name in layout["plain_params"])


def test_tp_gradients_and_optimizer_state_are_local_shards(tp):
    spec, res = tp
    hand = _hand_local_params(spec["config"], 2)
    n_params = 9 * spec["config"]["num_hidden_layers"] + 3
    for rk in res["ranks"]:
        local = rk["local_param_bytes"]
        layout = rk["tp"]
        assert layout["grads_dtensor"] + layout["grads_plain"] == n_params
        assert layout["grads_plain"] == 2 * spec["config"]["num_hidden_layers"] + 1
        # every gradient is its parameter's local shard except embed_tokens': the vocab-parallel
        # embedding's backward leaves a Replicate DTensor of the whole [vocab, hidden] table
        assert rk["local_grad_bytes"] == local + 4 * (hand["embed_full"] - hand["embed_local"])
        # AdamW exp_avg + exp_avg_sq on the local shards (DTensors where the parameter is one),
        # plus one scalar step per parameter
        assert 2 * local <= rk["local_optimizer_bytes"] <= 2 * local + 8 * n_params
        assert layout["optimizer_state_dtensor"] == 2 * layout["grads_dtensor"]
        # the Trainer's create_optimizer puts the plain and the DTensor parameters in separate
        # groups, which the fused kernel needs (it refuses a mix)
        assert rk["optimizer_impl"] == "fused"
        assert sorted(layout["param_groups"]) == sorted([layout["grads_dtensor"],
                                                         layout["grads_plain"]])
        states = local + rk["local_grad_bytes"] + rk["local_optimizer_bytes"]
        assert rk["peak"] > states
        assert all(s["peak"] >= s["alive_open"] for s in rk["steps"])
    peaks = [rk["peak"] for rk in res["ranks"]]
    assert max(peaks) < 1.05 * min(peaks)                            # the same shapes


def test_tp_ranks_train_one_model_in_lockstep(tp):
    _, res = tp
    r0, r1 = res["ranks"]
    assert r0["data_digest"] == r1["data_digest"]        # TP ranks share their batches
    assert r0["losses"] == r1["losses"]                  # one model, one loss
    assert r0["param_digest"] == r1["param_digest"]      # the gathered weights agree
    losses = r0["losses"]
    # finite and near ln(vocab) at the start; whether this model learns is the next test's
    # reference run's business (a 8192-token vocabulary does not visibly learn in 4 steps)
    assert len(losses) == STEPS and all(0 < x < 20 for x in losses)


def test_tp_losses_match_a_single_process_run(tp):
    """The same weights (seed 0), data and optimizer on one process, no parallelism: TP must
    compute the same training run up to float summation order."""
    import torch
    import transformers

    spec, res = tp
    with tempfile.TemporaryDirectory() as workdir:
        model = spec_model(spec, workdir)
    model.train()
    args = transformers.TrainingArguments(output_dir="unused", use_cpu=True, report_to=[],
                                          optim=spec["args"]["optim"], learning_rate=LR)
    cls, kw = transformers.Trainer.get_optimizer_cls_and_kwargs(args, model)
    opt = cls(model.parameters(), **kw)
    mb = spec["args"]["per_device_train_batch_size"]
    ds = SyntheticTextDataset(vocab_size=spec["config"]["vocab_size"], seq_len=spec["seq_len"],
                              num_samples=mb * STEPS, seed=1)
    ref = []
    for step in range(STEPS):
        items = [ds[i] for i in range(step * mb, (step + 1) * mb)]
        batch = {k: torch.stack([x[k] for x in items]) for k in items[0]}
        loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), spec["args"]["max_grad_norm"])
        opt.step()
        opt.zero_grad(set_to_none=True)
        ref.append(float(loss.detach()))
    assert res["ranks"][0]["losses"] == pytest.approx(ref, abs=2e-3, rel=0)


# --- DeepSpeed Ulysses sequence parallelism through the real Trainer -------------------------

@pytest.fixture(scope="module")
def sp():
    require("deepspeed")
    cfg = tiny_llama_config(num_hidden_layers=2, vocab_size=2048).to_dict()
    spec = {"mode": "sp", "config": cfg, "seq_len": 256, "steps": 3,
            "args": {"per_device_train_batch_size": 1, "optim": "adamw_torch",
                     "max_grad_norm": 1.0},
            "deepspeed": {"zero_optimization": {"stage": 3, "reduce_bucket_size": 100_000,
                                                "stage3_prefetch_bucket_size": 100_000,
                                                "stage3_param_persistence_threshold": 0}}}
    return spec, measure_distributed_peak(spec, nproc=2)


def test_sp_splits_the_sequence_and_zero3_partitions_the_states(sp):
    spec, res = sp
    r0, r1 = res["ranks"]
    for rk in (r0, r1):
        s = rk["sp"]
        assert s["sp_size"] == 2 and s["zero_stage"] == 3 and s["backend"] == "gloo"
        assert "DEEPSPEED" in s["distributed_type"]
        # each rank's model sees its half of every sequence (Ulysses' all-to-all gives the
        # attention the whole sequence over half the heads, inside the attention only)
        assert {tuple(x) for x in s["model_input_shapes"]} == {(1, spec["seq_len"] // 2)}
        full = rk["full_param_bytes"]
        assert rk["local_param_bytes"] == pytest.approx(full / 2, abs=64)   # ZeRO-3 partitions
        assert rk["local_master_bytes"] == rk["local_param_bytes"]  # a separate fp32 master
        assert rk["local_grad_bytes"] == rk["local_param_bytes"]    # the gradient partition
        assert rk["local_optimizer_bytes"] == pytest.approx(2 * rk["local_param_bytes"],
                                                            abs=64)
        assert rk["peak"] > rk["local_param_bytes"] + rk["local_master_bytes"] + rk[
            "local_grad_bytes"] + rk["local_optimizer_bytes"]
    # both ranks train the same sample's two halves: one loss, reduced across the SP group
    assert r0["losses"] == r1["losses"] and len(r0["losses"]) == spec["steps"]
    assert all(0 < x < 20 for x in r0["losses"])
    assert max(r0["peak"], r1["peak"]) < 1.05 * min(r0["peak"], r1["peak"])


# --- the estimate of one rank against these runs ---------------------------------------------

def _estimate(spec: dict, parallel: dict) -> int:
    import warnings

    from transformers import AutoConfig

    import hf_memkit as mk

    cfg = dict(spec["config"])
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    args = {**spec["args"], "parallelism_config": parallel}
    if "deepspeed" in spec:
        args["deepspeed"] = {**spec["deepspeed"], "train_micro_batch_size_per_gpu":
                             args["per_device_train_batch_size"],
                             "gradient_accumulation_steps": 1}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return mk.estimate_memory(config, args, seq_len=spec["seq_len"], device="cpu",
                                  num_gpus=2).peak_allocated


def test_one_tp_rank_is_estimated_within_8_percent(tp):
    spec, res = tp
    # measured 2026-11-28, 2 runs: -5.43%, -5.44% (bench/results/parallel_cpu.json: -5.4%);
    # 8% is 1.5x that, left as it was
    assert _estimate(spec, {"tp_size": 2}) == pytest.approx(res["peak"], rel=0.08)


def test_one_sp_rank_is_estimated_within_6_percent(sp):
    spec, res = sp
    # measured 2026-11-28, 2 runs: +1.65%, +2.82% (the RSS-measured peak varies by a point
    # between runs): about 2x the larger; was 8%
    assert _estimate(spec, {"sp_size": 2}) == pytest.approx(res["peak"], rel=0.06)


# --- context parallelism: does not run on CPU ------------------------------------------------

_CP_PROBE = textwrap.dedent("""
    import json, sys, torch, torch.distributed as dist, transformers
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import set_rotate_method
    from accelerate.big_modeling import _attach_context_parallel_hooks
    from hf_memkit._run.synthetic import SyntheticTextDataset, tiny_llama_config
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM._from_config(tiny_llama_config(num_hidden_layers=1),
                                                       attn_implementation="sdpa")
    _attach_context_parallel_hooks(model)
    out = {}
    for method in ("allgather", "alltoall"):
        set_rotate_method(method)
        ids = torch.randint(0, 512, (1, 64))
        shift = torch.nn.functional.pad(ids, (0, 1), value=-100)[:, 1:].contiguous()
        pos = torch.arange(64).unsqueeze(0).contiguous()
        bufs = [ids, shift, pos]
        try:
            with context_parallel(mesh["cp"], buffers=bufs, buffer_seq_dims=[1, 1, 1],
                                  no_restore_buffers=set(bufs)):
                model(input_ids=ids, position_ids=pos, shift_labels=shift).loss.backward()
            out[method] = "ran"
        except Exception as e:
            out[method] = type(e).__name__ + ": " + str(e)
    # one file per rank: two ranks printing to torchrun's one stdout can interleave a line
    with open(sys.argv[1] + f"/cp_rank{dist.get_rank()}.json", "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()
""")


def test_context_parallel_still_fails_on_cpu(tmp_path):
    """torch 2.13's ring attention has handlers for the CUDA SDPA kernels only; on CPU SDPA
    dispatches to ``_scaled_dot_product_flash_attention_for_cpu``, for which DTensor has no
    sharding strategy. When this test fails because CP ran, add a ``"cp"`` mode."""
    from hf_memkit.testing._parallel_worker import CP_ON_CPU

    script = tmp_path / "cp_probe.py"
    script.write_text(_CP_PROBE)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           "--master_addr", "127.0.0.1", "--master_port", str(_free_port()),
                           str(script), str(tmp_path)], env=env, capture_output=True,
                          text=True, timeout=300)
    ranks = sorted(tmp_path.glob("cp_rank*.json"))
    assert proc.returncode == 0 and len(ranks) == 2, proc.stderr[-3000:]
    for path in ranks:
        result = json.loads(path.read_text())
        for method in ("allgather", "alltoall"):
            assert result[method].startswith(CP_ON_CPU[method]), result[method]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
