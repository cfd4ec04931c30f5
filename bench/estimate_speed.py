"""Wall time and peak RSS of estimating Llama-3.1-70B from its bundled config.

Setup (issue #3): bf16 AMP, AdamW, seq 4096, micro-batch 1, gradient checkpointing, planned for
one H100-80GB. Runs in a fresh process so the RSS figures are this estimate's own; the first
estimate in a process pays one-time costs (imports are excluded from the time, not from RSS).
Traces kept on disk are off (``HF_MEMKIT_NO_CACHE=1``): every estimate traces.

Bar: <= 5 s and <= 1 GiB peak RSS on this machine (2 cores).

    python bench/estimate_speed.py [--repeat 3] [--json PATH] [--quick]

``--quick``: one estimate; the bar is reported, not gated (one run on a busy machine is not a
measurement).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from _quick import add_flag, guard

CHILD = r"""
import json, resource, time, warnings
warnings.filterwarnings("ignore")
t_import = time.perf_counter()
import hf_memkit as mk
mk.estimate_memory  # names import on first use (torch, transformers): inside the import time
t_import = time.perf_counter() - t_import
rss_after_import = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
args = dict(bf16=True, optim="adamw_torch", per_device_train_batch_size=1,
            gradient_checkpointing=True)
times = []
for _ in range(REPEAT):
    t0 = time.perf_counter()
    e = mk.estimate_memory("Llama-3.1-70B", args, seq_len=4096, device="H100-80GB")
    times.append(time.perf_counter() - t0)
print(json.dumps({"times": times, "import_s": t_import, "rss_after_import": rss_after_import,
                  "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "device_used": e.device_used, "traced_layers": list(e.traced_layers)}))
"""


def main(argv: list[str] | None = None) -> int:
    """Time the estimate in a fresh process; print the figures and write ``--json``.

    Args:
        argv: the command line (default ``sys.argv[1:]``).

    Returns:
        The exit status: 1 where the bar is missed (not under ``--quick``), else 0.
    """
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", help="write the child's figures and the verdict here")
    add_flag(ap)
    a = ap.parse_args(argv)
    guard(a.quick, a.json, "--json")
    if a.quick:
        a.repeat = 1
    out = subprocess.run([sys.executable, "-c", CHILD.replace("REPEAT", str(a.repeat))],
                         capture_output=True, text=True, check=True,
                         env=dict(os.environ, TRANSFORMERS_VERBOSITY="error",
                                  HF_MEMKIT_NO_CACHE="1"))  # each estimate traces
    r = json.loads(out.stdout.strip().splitlines()[-1])
    gib = 1024**3
    first, rest = r["times"][0], r["times"][1:]
    print(f"Llama-3.1-70B, bf16 AMP, AdamW, seq 4096, micro-batch 1, checkpointing, H100-80GB: "
          f"device_used {r['device_used'] / gib:.1f} GiB (traced layers {r['traced_layers']})")
    print(f"first estimate {first:.2f} s" + (f", then {min(rest):.2f} s" if rest else "")
          + f" (import {r['import_s']:.1f} s, not counted)")
    print(f"peak RSS {r['peak_rss'] / gib:.2f} GiB for the whole process "
          f"({r['rss_after_import'] / gib:.2f} GiB after importing torch/transformers, so the "
          f"estimate adds {(r['peak_rss'] - r['rss_after_import']) / gib:.2f} GiB)")
    ok = first <= 5.0 and r["peak_rss"] <= gib
    print("bar (<= 5 s, <= 1 GiB):", "met" if ok else "MISSED")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({**r, "quick": a.quick, "bar_met": ok}, f, indent=1)
    return 0 if ok or a.quick else 1


if __name__ == "__main__":
    sys.exit(main())
