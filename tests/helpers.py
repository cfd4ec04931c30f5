"""Shared test helpers: ``FakeGpu`` records for the ``fake_cuda`` fixture (the fakes themselves,
following NVML's and CUDA's rules, are in ``tests/fakes``), the optional-extra rule, and the paths tests read beside them. Fixtures live in ``tests/conftest.py``;
this module holds what tests import by name (``from tests.helpers import A100_80, FakeGpu``)."""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from pathlib import Path

import pytest

from hf_memkit._units import MiB

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent                 # the repository
BENCH = ROOT / "bench"
TEST_RECIPES = TESTS / "recipes"    # recipes that only the tests use


class NetworkAccessError(RuntimeError):
    """A test reached for the network."""


# `make test` (and so CI) installs every extra and sets HF_MEMKIT_STRICT_TESTS: there a missing
# optional package or missing published GPU anchors (docs/anchors.md) is a failure, never a
# silent skip.
STRICT = bool(os.environ.get("HF_MEMKIT_STRICT_TESTS") or os.environ.get("CI"))


def require(module: str):
    """Import an optional extra (peft, bitsandbytes, deepspeed): skipped where it is not
    installed, but a failure under ``make test``, which installs them all."""
    if STRICT:
        return importlib.import_module(module)
    return pytest.importorskip(module)


@dataclass
class FakeGpu:
    name: str                      # as NVML reports it, e.g. "NVIDIA A100-SXM4-80GB"
    total: int
    free: int
    cc: tuple[int, int]
    mig: bool = False
    mig_total: int | None = None   # what CUDA sees inside a MIG slice
    mig_name: str | None = None


A100_80 = FakeGpu("NVIDIA A100-SXM4-80GB", 81920 * MiB, 80000 * MiB, (8, 0))
V100_16 = FakeGpu("Tesla V100-SXM2-16GB", 16160 * MiB, 15000 * MiB, (7, 0))
T4 = FakeGpu("Tesla T4", 15360 * MiB, 15000 * MiB, (7, 5))


# ---------------------------------------------------------------------------------------------
# Hand counts of a Llama's parameters from its config alone (never the estimator's own walk)
# ---------------------------------------------------------------------------------------------

def llama_counts(c) -> dict[str, int]:
    """Parameter counts of a Llama from its config: the linears of one decoder layer
    ((in, out) of q, k, v, o, gate, up, down), the norms and the two embeddings (untied)."""
    h, i = c.hidden_size, c.intermediate_size
    kv = c.num_key_value_heads * (h // c.num_attention_heads)
    linears = [(h, h), (h, kv), (h, kv), (h, h), (h, i), (h, i), (i, h)]
    per_layer = sum(a * b for a, b in linears)
    n_layers = c.num_hidden_layers
    return {"linear": n_layers * per_layer, "norms": (2 * n_layers + 1) * h,
            "embeddings": 2 * c.vocab_size * h, "linears": linears, "layers": n_layers,
            "total": n_layers * per_layer + (2 * n_layers + 1) * h + 2 * c.vocab_size * h}


def lora_count(c, r: int) -> int:
    """LoRA on every linear of every layer: r x (in + out) each."""
    k = llama_counts(c)
    return k["layers"] * sum(r * (a + b) for a, b in k["linears"])


def qlora_hand_count(config, r: int, world: int) -> dict[str, int]:
    """One rank's bytes of FSDP-QLoRA, from the config: NF4 weights 2 per byte; double
    quantization 1 B per 64-weight block + 4 B per 256 blocks (bitsandbytes quantize_4bit with
    nested absmax); the rest of the base in bf16; fp32 adapters."""
    def nested_absmax(n: int) -> int:
        blocks = -(-n // 64)
        return blocks + 4 * -(-blocks // 256)

    k, a = llama_counts(config), lora_count(config, r)
    packed = k["linear"] // 2
    constants = k["layers"] * sum(nested_absmax(i * o) for i, o in k["linears"])
    rest = 2 * (k["embeddings"] + k["norms"])
    return {"packed": packed, "constants": constants, "rest": rest, "adapters": a,
            "sharded": -(-(packed + rest + 4 * a) // world), "states": 4 * a + 8 * a}
