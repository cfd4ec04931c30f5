"""Per-rank memory of sharded training: against DeepSpeed's estimators, the ZeRO paper, and
2-process CPU runs; and the planner's choices for Llama-3.1-70B.

1. Model states (weights + gradients + optimizer state per GPU) of ``estimate_memory`` with a
   DeepSpeed config, for 1.5B (GPT-2 XL), 7B (Llama-2-7b) and 70B (Llama-3.1-70B) at 8 and 64
   GPUs, ZeRO-2 and ZeRO-3 with and without CPU offload, against DeepSpeed's own
   ``estimate_zero2/3_model_states_mem_needs`` (run here on CPU), with ZeRO-3's gradient
   partitions at the 2 bytes DeepSpeed allocates them in (its estimator counts 4). Bar: within 5%.
   DeepSpeed's estimators take the parameter count and the largest module's parameter count;
   both are counted by DeepSpeed's own ``model_to_params`` on the meta model (its total is
   replaced by the plain count, because meta tensors share data_ptr 0).
2. The ZeRO paper's Table 1 (Rajbhandari et al. 2020: 7.5B parameters, 64 GPUs, K = 12) in bytes
   per parameter, for reference: the paper's accounting has no fp32 gradient partitions and no
   gathered layer, DeepSpeed's (which the estimator follows) has both.
3. Measured vs estimated per-rank peak of the 2-process CPU runs in ``bench/_dist_cases.py``
   (DDP through the real Trainer, FSDP2 through accelerate's ``fsdp2_prepare_model``, DeepSpeed
   ZeRO-2/3 on its CPU accelerator; gloo).
   Bar: within 8%. On CPU, "device" and host are one memory, so the offload run holds exactly what
   full shard holds; it is shown against the full-shard estimate and left out of the bar.
4. The planner's choice for Llama-3.1-70B on 8 x H100-80GB and 2 x A100-40GB.

    python bench/sharding.py [--json out.json] [--skip-runs] [--measured dist.json] [--quick]

``--quick``: 1.5B at 8 GPUs against DeepSpeed, the paper's table, ``dist_measure.QUICK``'s run
(from ``--measured`` when it holds it, else run here) and one planner question.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _quick import add_flag, guard  # noqa: E402

import hf_memkit as mk  # noqa: E402
from hf_memkit._units import GiB  # noqa: E402

MODELS = {"1.5B": "gpt2-xl", "7B": "Llama-2-7b-hf", "70B": "Llama-3.1-70B"}
GPUS = (8, 64)
# (label, zero stage, offload_optimizer, offload_param)
ZERO = [("ZeRO-2", 2, False, False), ("ZeRO-2 + opt offload", 2, True, False),
        ("ZeRO-3", 3, False, False), ("ZeRO-3 + opt offload", 3, True, False),
        ("ZeRO-3 + opt+param offload", 3, True, True)]


def _ds_config(stage: int, off_opt: bool, off_param: bool, world: int) -> dict:
    z: dict = {"stage": stage}
    if off_opt:
        z["offload_optimizer"] = {"device": "cpu"}
    if off_param:
        z["offload_param"] = {"device": "cpu"}
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
            "train_batch_size": world, "bf16": {"enabled": True}, "zero_optimization": z}


def _deepspeed_counts(name: str) -> tuple[int, int]:
    import torch
    from deepspeed.runtime.zero.stage3 import model_to_params

    from hf_memkit._model import model_from_config
    from hf_memkit._model import to_config as _to_config

    with torch.device("meta"):
        model = model_from_config(_to_config(name), "causal-lm")
    _, largest = model_to_params(model)
    return mk.profile_model(name).total_params, largest


def vs_deepspeed(console: Console, quick: bool = False) -> list[dict]:
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    rows = []
    table = Table(title="1. per-GPU model states vs DeepSpeed's estimators (GiB)")
    for col in ("model", "GPUs", "setup", "hf_memkit", "DeepSpeed", "error"):
        table.add_column(col, justify="right" if col not in ("model", "setup") else "left")
    for size, name in list(MODELS.items())[:1] if quick else MODELS.items():
        total, largest = _deepspeed_counts(name)
        for n in GPUS[:1] if quick else GPUS:
            nodes, per_node = max(1, n // 8), min(n, 8)
            for label, stage, off_opt, off_param in ZERO:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    est = mk.estimate_memory(
                        name, {"bf16": True, "deepspeed": _ds_config(stage, off_opt, off_param, n),
                               "per_device_train_batch_size": 1}, seq_len=128,
                        device="H100-80GB", num_gpus=n)
                if stage == 2:
                    _, ds = estimate_zero2_model_states_mem_needs(
                        total, num_gpus_per_node=per_node, num_nodes=nodes, cpu_offload=off_opt)
                else:
                    _, ds, _ = estimate_zero3_model_states_mem_needs(
                        total, largest, num_gpus_per_node=per_node, num_nodes=nodes,
                        cpu_offload=off_opt, cpu_offload_params=off_param, zero_init=True)
                # the estimator counts ZeRO-3's gradient partitions at 4 B (fp32); DeepSpeed
                # allocates them as one bf16 buffer, 2 B (stage3.py grad_partitions_flat_buffer
                # in the gradient-accumulation dtype): compared at what it allocates
                alloc = ds - (2 * total / n if stage == 3 and not off_opt else 0)
                err = (est.model_states - alloc) / alloc
                rows.append({"model": name, "size": size, "gpus": n, "setup": label,
                             "ours": est.model_states, "deepspeed": ds,
                             "deepspeed_allocates": alloc, "error": err})
                table.add_row(f"{size} {name}", str(n), label, f"{est.model_states / GiB:.2f}",
                              f"{ds / GiB:.2f}", f"{err:+.2%}")
    console.print(table)
    errs = [abs(r["error"]) for r in rows]
    console.print(f"{len(rows)} cases: median |error| {statistics.median(errs):.2%}, worst "
                  f"{max(errs):.2%}; within 5%: {sum(e <= 0.05 for e in errs)}/{len(errs)}")
    return rows


# ZeRO paper, Table 1 (Psi = 7.5B, N_d = 64, K = 12): GB per GPU
PAPER = {"baseline (DDP)": 120.0, "ZeRO-1 (P_os)": 31.4, "ZeRO-2 (P_os+g)": 16.6,
         "ZeRO-3 (P_os+g+p)": 1.88}


def vs_paper(console: Console) -> list[dict]:
    name = "Llama-2-7b-hf"
    psi = mk.profile_model(name).total_params
    table = Table(title="2. ZeRO paper Table 1 (7.5B, 64 GPUs), bytes per parameter per GPU")
    for col in ("setup", "paper", "hf_memkit (Llama-2-7b)", "difference"):
        table.add_column(col)
    rows = []
    for (label, paper), stage in zip(PAPER.items(), (None, 1, 2, 3), strict=True):
        args = {"bf16": True, "per_device_train_batch_size": 1}
        if stage is not None:
            args["deepspeed"] = _ds_config(stage, False, False, 64)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            est = mk.estimate_memory(name, args, seq_len=128, device="H100-80GB",
                                     num_gpus=64 if stage is not None else 1)
        ours = est.model_states / psi
        # the paper's baseline is 16-bit weights + grads + K=12 of fp32 states; the Trainer's
        # AMP replica keeps fp32 weights (4) + fp32 grads (4) + Adam (8) = 16
        ref = paper * 1e9 / 7.5e9
        rows.append({"setup": label, "paper_bytes_per_param": ref, "ours_bytes_per_param": ours})
        table.add_row(label, f"{ref:.3f}", f"{ours:.3f}", f"{(ours - ref) / ref:+.1%}")
    console.print(table)
    console.print("The paper counts K=12 bytes of fp32 state and no fp32 gradient partitions; "
                  "DeepSpeed's implementation (and its estimators) keep fp32 gradient partitions "
                  "(+4 B/N at ZeRO-1/2, +2 B/N at ZeRO-3) and two gathered copies of the largest "
                  "module at ZeRO-3.")
    return rows


def _our_args(spec: dict) -> dict:
    args = dict(spec["args"])
    args.setdefault("per_device_eval_batch_size", args["per_device_train_batch_size"])
    if spec["mode"] == "fsdp2":
        f = spec["fsdp"]
        args["fsdp"] = True
        args["fsdp_config"] = {"version": f.get("version", 2),
                               "reshard_after_forward": f.get("reshard_after_forward", True),
                               "cpu_offload": bool(f.get("offload")),
                               "transformer_layer_cls_to_wrap": f["transformer_layer_cls_to_wrap"]}
        if f.get("activation_checkpointing"):
            args["fsdp_config"]["activation_checkpointing"] = True
        if f.get("mixed_precision") == "bf16":
            args["bf16"] = True
    if spec["mode"] == "deepspeed":
        import _dist_cases

        mb = args["per_device_train_batch_size"]
        accum = args.get("gradient_accumulation_steps", 1)
        args["deepspeed"] = dict(spec["deepspeed"], train_micro_batch_size_per_gpu=mb,
                                 gradient_accumulation_steps=accum,
                                 train_batch_size=mb * accum * _dist_cases.NPROC)
    return args


def vs_runs(console: Console, measured_path: str | None, quick: bool = False) -> list[dict]:
    import _dist_cases
    from transformers import AutoConfig

    from hf_memkit.testing.groundtruth_dist import measure_distributed_peak

    measured = {}
    if measured_path:
        data = json.loads(Path(measured_path).read_text())
        measured = {r["name"]: r.get("result", r)
                    for r in (data if isinstance(data, list) else data["cases"])}
    table = Table(title=f"3. per-rank peak, {_dist_cases.NPROC} gloo ranks on this CPU (MiB)")
    for col in ("case", "measured (max rank)", "estimated", "error"):
        table.add_column(col)
    rows = []
    from dist_measure import QUICK

    for spec in [c for c in _dist_cases.cases() if not quick or c["name"] in QUICK]:
        t0 = time.perf_counter()
        m = measured.get(spec["name"]) or measure_distributed_peak(spec, nproc=_dist_cases.NPROC)
        cfg = dict(spec["config"])
        config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
        args = _our_args(spec)
        offload = bool(args.get("fsdp_config", {}).get("cpu_offload"))
        if offload:
            # one memory on a CPU: CPUOffloadPolicy moves nothing, the run holds what full shard
            # holds (measured: identical). Compare with the same setup's non-offload estimate;
            # the device-side saving of offload is arithmetic
            # (tests/unit/engines/test_multi_gpu.py), not this.
            args["fsdp_config"] = dict(args["fsdp_config"], cpu_offload=False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            est = mk.estimate_memory(config, args, seq_len=spec["seq_len"], dtype=spec.get("dtype"),
                                     device="cpu", num_gpus=_dist_cases.NPROC)
        pred = est.peak_allocated
        peak = m["peak"]
        err = (pred - peak) / peak
        rows.append({"case": spec["name"], "measured": peak, "estimated": pred, "error": err,
                     "ranks": [r["peak"] for r in m.get("ranks", [])], "offload": offload,
                     "seconds": time.perf_counter() - t0})
        table.add_row(spec["name"] + (" (vs full-shard estimate)" if offload else ""),
                      f"{peak / 2**20:.1f}", f"{pred / 2**20:.1f}", f"{err:+.2%}")
    console.print(table)
    errs = [abs(r["error"]) for r in rows if not r["offload"]]
    console.print(f"{len(errs)} runs (offload row excluded): median |error| "
                  f"{statistics.median(errs):.2%}, worst {max(errs):.2%}; within 8%: "
                  f"{sum(e <= 0.08 for e in errs)}/{len(errs)}")
    return rows


PLANS = (("H100-80GB", 8, "auto", None), ("H100-80GB", 8, "deepspeed", None),
         ("H100-80GB", 8, "auto", "512GiB"), ("A100-40GB", 2, "auto", None),
         ("A100-40GB", 2, "auto", "256GiB"), ("H100-80GB", 16, "auto", None))


def planner_choices(console: Console, quick: bool = False) -> list[dict]:
    table = Table(title="4. planner: Llama-3.1-70B, seq 4096, target batch 64")
    # per GPU: what the step needs (the smallest memory its replay runs in) + its margin, what
    # the plan judges against the budget
    for col in ("hardware", "engine", "chosen", "needs + margin per GPU", "host RAM / node",
                "plan s"):
        table.add_column(col)
    rows = []
    for dev, n, engine, host in PLANS[:1] if quick else PLANS:
        t0 = time.perf_counter()
        label = engine + (f", host RAM {host}" if host else "")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                p = mk.plan_training("Llama-3.1-70B", seq_len=4096, target_batch_size=64,
                                     device=dev, num_gpus=n, engine=engine,
                                     num_nodes=max(1, n // 8), host_memory=host)
        except mk.HfMemkitError as exc:
            rows.append({"hardware": f"{n} x {dev}", "engine": label, "error": str(exc),
                         "seconds": time.perf_counter() - t0})
            table.add_row(f"{n} x {dev}", label, f"no plan: {exc}", "-", "-",
                          f"{time.perf_counter() - t0:.1f}")
            continue
        secs = time.perf_counter() - t0
        host = p.parallel.get("host_memory_per_node", 0)
        engine = label
        est = p.chosen.estimate
        rows.append({"hardware": f"{n} x {dev}", "engine": engine, "chosen": p.chosen.label(),
                     "device_used": p.chosen.device_used, "required": est.required,
                     "margin": est.upper - est.required, "host_per_node": host,
                     "method": p.chosen.method, "seconds": secs})
        table.add_row(f"{n} x {dev}", engine, p.chosen.label(),
                      f"{est.required / GiB:.1f} + {(est.upper - est.required) / GiB:.1f} GiB",
                      f"{host / GiB:.0f} GiB" if host else "-", f"{secs:.1f}")
    console.print(table)
    return rows


def main(argv: list[str] | None = None) -> int:
    """Run the four comparisons; print the tables and write ``--json``.

    Args:
        argv: the command line (default ``sys.argv[1:]``).

    Returns:
        The exit status: 0.
    """
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="write all results here")
    ap.add_argument("--skip-runs", action="store_true", help="skip the 2-process CPU runs")
    ap.add_argument("--measured", help="reuse bench/dist_measure.py --out results")
    add_flag(ap)
    a = ap.parse_args(argv)
    guard(a.quick, a.json, "--json")
    console = Console(width=160)
    out = {"deepspeed": vs_deepspeed(console, a.quick), "paper": vs_paper(console)}
    if not a.skip_runs:
        out["runs"] = vs_runs(console, a.measured, a.quick)
    out["planner"] = planner_choices(console, a.quick)
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
