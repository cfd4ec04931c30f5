"""Wall time of whole plans from bundled configs (issue #4 bar: <= 10 s each on this machine).

    python bench/plan_speed.py
"""

from __future__ import annotations

import subprocess
import sys

CASES = [("Llama-3.1-70B", "H100-80GB", 4096, 16), ("Llama-3.1-8B", "RTX-4090", 2048, 32)]

CHILD = r"""
import sys, time, warnings
warnings.filterwarnings("ignore")
import hf_memkit as mk
model, gpu, seq, target = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
t0 = time.perf_counter()
p = mk.plan_training(model, seq_len=seq, target_batch_size=target, device=gpu)
dt = time.perf_counter() - t0
est = sum(c.estimate is not None for c in p.candidates)
print(f"{dt:.2f}|{p.chosen.label()}|{p.chosen.device_used / 2**30:.1f}|{len(p.candidates)}|{est}")
"""


def main() -> int:
    ok = True
    for model, gpu, seq, target in CASES:
        out = subprocess.run([sys.executable, "-c", CHILD, model, gpu, str(seq), str(target)],
                             capture_output=True, text=True, check=True).stdout.strip()
        dt, label, gib, n, est = out.splitlines()[-1].split("|")
        ok &= float(dt) <= 10
        print(f"{model} on {gpu} (seq {seq}, target batch {target}): {float(dt):.1f} s, "
              f"{n} setups considered, {est} estimated -> {label} ({gib} GiB)")
    print("bar (<= 10 s each):", "met" if ok else "MISSED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
