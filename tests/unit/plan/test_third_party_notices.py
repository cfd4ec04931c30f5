"""A user's own script sees no third-party notices that hf_memkit's calls trigger (DeepSpeed's
"Setting accelerator to CPU" when a ZeRO config is checked, bitsandbytes' CPU-kernel notice
when peft loads it, torchao's extension notices), and still sees what those libraries log
outside our calls."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import logging, sys
import hf_memkit as mk
from transformers import BitsAndBytesConfig   # the user's imports: what they print is theirs
from peft import LoraConfig
print("-- our calls --", flush=True); print("-- our calls --", file=sys.stderr, flush=True)
mk.plan_training("Llama-3.2-1B", seq_len=512, target_batch_size=8, device="A100-80GB",
                 num_gpus=2, engine="zero2")
mk.estimate_memory("Llama-3.2-1B", {"bf16": True, "per_device_train_batch_size": 1},
                   seq_len=512, device="A100-80GB", peft_config=LoraConfig(r=8),
                   quantization_config=BitsAndBytesConfig(load_in_4bit=True))
mk.estimate_memory("Llama-3.2-1B", {"bf16": True, "optim": "adamw_torch_8bit"}, seq_len=512,
                   device="A100-80GB")
logging.getLogger("DeepSpeed").warning("Setting accelerator to CPU, said by the user's code")
print("done")
"""


def test_our_calls_print_no_third_party_notices_and_leave_the_loggers_as_they_were(tmp_path):
    r = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                       cwd=tmp_path, timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("done"), r.stderr[-3000:]
    # DeepSpeed's logger writes to stdout
    lines = [ln for out in (r.stderr, r.stdout) for ln in out.split("-- our calls --")[1].splitlines()]
    said = [ln for ln in lines if "Setting accelerator to CPU" in ln]
    assert len(said) == 1 and said[0].endswith("Setting accelerator to CPU, said by the user's code")
    for notice in ("Failed to load CPU gemm_4bit_forward", "torchao/_C", "is an Enum subclass"):
        assert not [ln for ln in lines if notice in ln], notice
