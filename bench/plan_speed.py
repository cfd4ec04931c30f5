"""Cost of a whole plan relative to one estimate of the same model, measured in one process.

Bar (docs/quality-bars.md, issue #12): a plan costs at most 5x one estimate of the same model
(goal 3x).
Each case runs in a fresh child process: a warm-up plan (imports, config parsing), then one
``estimate_memory`` of the setup that plan chose, then the timed plan. Both timed calls start
with the same warm process and share no trace cache (``estimate_memory`` builds its own model
spec; every plan builds its own ``TraceCache``; the traces kept on disk are off:
``HF_MEMKIT_NO_CACHE=1``, so both trace).

    python bench/plan_speed.py [--json PATH] [--quick]

``--quick``: the 8B case only, without the warm-up plan; the bar is reported, not gated (a cold
run on a busy machine is not a measurement).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from _quick import add_flag, guard

# (model, GPU, seq_len, target batch, GPUs)
CASES = [("Llama-3.1-70B", "H100-80GB", 2048, 16, 1), ("Llama-3.1-8B", "RTX-4090", 2048, 32, 1),
         ("Llama-3.1-70B", "H100-80GB", 2048, 64, 8)]
QUICK = (("Llama-3.1-8B", "RTX-4090", 2048, 32, 1),)
BAR, GOAL = 5.0, 3.0

CHILD = r"""
import sys, time, warnings
warnings.filterwarnings("ignore")
import hf_memkit as mk
model, gpu, seq, target, gpus = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
if sys.argv[6] == "warm":  # imports, config parsing (--quick: none)
    mk.plan_training(model, seq_len=seq, target_batch_size=target, device=gpu, num_gpus=gpus)
t0 = time.perf_counter()
p = mk.plan_training(model, seq_len=seq, target_batch_size=target, device=gpu, num_gpus=gpus)
plan_s = time.perf_counter() - t0
args = {k: v for k, v in p.training_args_kwargs.items()}
kw = dict(device=gpu, seq_len=seq, num_gpus=p.num_gpus if p.num_gpus > 1 else None,
          dtype=None if p.model_kwargs.get("quantization_config") else p.model_kwargs.get("dtype"),
          attn_implementation=p.model_kwargs.get("attn_implementation"),
          quantization_config=p.model_kwargs.get("quantization_config"),
          peft_config=p.peft_config)
t0 = time.perf_counter()
est = mk.estimate_memory(model, args, **kw)
est_s = time.perf_counter() - t0
assert est.device_used == p.chosen.device_used, (est.device_used, p.chosen.device_used)
n_est = sum(c.estimate is not None for c in p.candidates)
print(f"{plan_s:.3f}|{est_s:.3f}|{p.chosen.label()}|{p.chosen.device_used / 2**30:.1f}|"
      f"{len(p.candidates)}|{n_est}")
"""


def main(argv: list[str] | None = None) -> int:
    """Time each case's plan against one estimate; print the ratios and write ``--json``.

    Args:
        argv: the command line (default ``sys.argv[1:]``).

    Returns:
        The exit status: 1 where the bar is missed (not under ``--quick``), else 0.
    """
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write each case's times and the verdict here")
    add_flag(ap)
    a = ap.parse_args(argv)
    guard(a.quick, a.json, "--json")
    worst, rows = 0.0, []
    for model, gpu, seq, target, gpus in QUICK if a.quick else CASES:
        out = subprocess.run([sys.executable, "-c", CHILD, model, gpu, str(seq), str(target),
                              str(gpus), "cold" if a.quick else "warm"],
                             capture_output=True, text=True, check=True,
                             env=dict(os.environ, HF_MEMKIT_NO_CACHE="1")).stdout.strip()
        plan_s, est_s, label, gib, n, n_est = out.splitlines()[-1].split("|")
        ratio = float(plan_s) / float(est_s)
        worst = max(worst, ratio)
        rows.append({"model": model, "gpu": gpu, "num_gpus": gpus, "seq_len": seq,
                     "target_batch": target, "plan_s": float(plan_s), "estimate_s": float(est_s),
                     "ratio": ratio, "chosen": label, "candidates": int(n),
                     "estimated": int(n_est)})
        print(f"{model} on {gpus} x {gpu} (seq {seq}, target batch {target}): "
              f"plan {float(plan_s):.2f} s, "
              f"one estimate {float(est_s):.2f} s, ratio {ratio:.1f}x; {n} setups considered, "
              f"{n_est} estimated -> {label} ({gib} GiB)")
    verdict = "goal met" if worst <= GOAL else "bar met" if worst <= BAR else "MISSED"
    print(f"plan / estimate, worst case: {worst:.1f}x (bar <= {BAR:g}x, goal <= {GOAL:g}x): "
          f"{verdict}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"quick": a.quick, "cases": rows, "worst": worst,
                       "bar_met": worst <= BAR}, f, indent=1)
    return 0 if worst <= BAR or a.quick else 1


if __name__ == "__main__":
    sys.exit(main())
