"""The bundled GPU catalog: one ``register(GpuSpec(...))`` per card (STYLE.md §2).

Figures are dense (no 2:4 sparsity) peak tensor throughput from each vendor datasheet, in
TFLOP/s. ``memory`` is the total the driver reports (``nvidia-smi`` / NVML ``total``), which is
what a plan must fit in; it is a little below the marketing "GB" figure. Bandwidths are in
bytes/s (decimal GB/s × 1e9, as datasheets quote them); interconnect bandwidth is the
datasheet's total bidirectional figure per GPU.

CUDA context size is *not* here: it depends on driver and CUDA version, not on the card; it
belongs to the estimator's CUDA model, and ``probe_device`` can measure it on a real GPU.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from .._registry import Registry
from .._units import MiB


@dataclass(frozen=True)
class GpuSpec:
    name: str = field(metadata={"help": "Canonical catalog name, e.g. 'A100-80GB'."})
    memory: int = field(metadata={"help": "Total device memory in bytes as NVML reports it."})
    compute_capability: tuple[int, int] = field(metadata={"help": "CUDA (major, minor)."})
    tflops: dict[str, float] = field(
        metadata={"help": "Dense peak TFLOP/s by math mode: fp32, tf32, fp16, bf16 (0 = none)."}
    )
    memory_bandwidth: float = field(metadata={"help": "HBM/GDDR bandwidth, bytes/s."})
    interconnect: str = field(metadata={"help": "GPU-to-GPU link: 'nvlink2/3/4' or 'pcie3/4/5'."})
    interconnect_bandwidth: float = field(
        metadata={"help": "Bidirectional GPU-to-GPU bandwidth per GPU, bytes/s (datasheet)."}
    )
    aliases: tuple[str, ...] = field(default=(), metadata={"help": "Other accepted names."})
    source: str = field(default="", metadata={"help": "Where the figures come from."})

    @property
    def supports_bf16(self) -> bool:
        # bf16 tensor cores arrived with Ampere (sm_80); Volta/Turing emulate it slowly.
        return self.compute_capability >= (8, 0)

    @property
    def supports_tf32(self) -> bool:
        # TF32 is an Ampere (sm_80) tensor-core mode.
        return self.compute_capability >= (8, 0)

    @property
    def supports_fp16_tensor_cores(self) -> bool:
        # fp16 tensor cores arrived with Volta (sm_70).
        return self.compute_capability >= (7, 0)


def normalize_gpu_name(name: str) -> str:
    """Case- and punctuation-insensitive key; drops vendor words NVML puts in front."""
    key = name.lower()
    key = re.sub(r"\b(nvidia|tesla|geforce|quadro)\b", "", key)
    return re.sub(r"[^a-z0-9]", "", key)


GPUS: Registry[GpuSpec] = Registry("GPU", " (hf-memkit devices)", normalize=normalize_gpu_name)


def register(spec: GpuSpec) -> GpuSpec:
    return GPUS.register(spec, *spec.aliases)


def lookup(name: str) -> GpuSpec | None:
    canonical = GPUS.canonical(name)
    return GPUS.get(canonical) if canonical else None


def catalog() -> dict[str, GpuSpec]:
    return {spec.name: spec for spec in GPUS}


GB_S = 1e9

# --- Turing -----------------------------------------------------------------------------------
# NVIDIA T4 datasheet (2019): FP32 8.1 TF, mixed FP16/FP32 tensor 65 TF, 320 GB/s, PCIe Gen3 x16.
register(GpuSpec(
    "T4", 15360 * MiB, (7, 5),
    {"fp32": 8.1, "tf32": 0.0, "fp16": 65.0, "bf16": 0.0},
    320 * GB_S, "pcie3", 32 * GB_S,
    aliases=("Tesla T4", "T4-16GB"), source="NVIDIA T4 Tensor Core GPU datasheet",
))
# --- Volta ------------------------------------------------------------------------------------
# NVIDIA V100 datasheet (SXM2): FP32 15.7 TF, tensor 125 TF, 900 GB/s, NVLink 300 GB/s.
# 16160 MiB is the nvidia-smi total in shared/anchors (hf_perf_cuda_context_overhead).
register(GpuSpec(
    "V100-SXM2-16GB", 16160 * MiB, (7, 0),
    {"fp32": 15.7, "tf32": 0.0, "fp16": 125.0, "bf16": 0.0},
    900 * GB_S, "nvlink2", 300 * GB_S,
    aliases=("V100", "V100-16GB", "Tesla V100-SXM2-16GB"),
    source="NVIDIA V100 Tensor Core GPU datasheet",
))
register(GpuSpec(
    "V100-32GB", 32510 * MiB, (7, 0),
    {"fp32": 15.7, "tf32": 0.0, "fp16": 125.0, "bf16": 0.0},
    900 * GB_S, "nvlink2", 300 * GB_S,
    aliases=("V100-SXM2-32GB", "Tesla V100-SXM2-32GB", "V100S", "V100-PCIE-32GB"),
    source="NVIDIA V100 Tensor Core GPU datasheet (SXM2 32GB)",
))
# --- Ampere -----------------------------------------------------------------------------------
# NVIDIA A10 datasheet: FP32 31.2, TF32 62.5, BF16/FP16 125 TF dense, 600 GB/s, PCIe Gen4.
# AWS's A10G is an A10 variant with no separate NVIDIA datasheet; A10 figures are used.
register(GpuSpec(
    "A10G", 22731 * MiB, (8, 6),
    {"fp32": 31.2, "tf32": 62.5, "fp16": 125.0, "bf16": 125.0},
    600 * GB_S, "pcie4", 64 * GB_S,
    aliases=("A10", "A10G-24GB"), source="NVIDIA A10 Tensor Core GPU datasheet",
))
# GeForce RTX 3090 (GA102 whitepaper, appendix): FP32 35.6; tensor FP16/BF16 with FP32
# accumulate 71 TF dense (the 142 TF figure is FP16-accumulate); TF32 35.6; 936 GB/s.
register(GpuSpec(
    "RTX-3090", 24576 * MiB, (8, 6),
    {"fp32": 35.6, "tf32": 35.6, "fp16": 71.0, "bf16": 71.0},
    936 * GB_S, "pcie4", 64 * GB_S,
    aliases=("RTX3090", "GeForce RTX 3090", "3090"),
    source="NVIDIA Ampere GA102 GPU architecture whitepaper",
))
# Laptop RTX 3080 Ti 16 GB (GA103, shared/anchors sdpa_pythia410m_*): ~ 2/3 of a desktop 3080 Ti;
# NVIDIA publishes no tensor TFLOP/s for laptop parts, figures scale the GA102 whitepaper by SM
# count and boost clock (58 SMs at ~1.26 GHz): FP32 ~18.7, FP16/BF16 (FP32 acc) ~37.
register(GpuSpec(
    "RTX-3080Ti-Laptop-16GB", 16384 * MiB, (8, 6),
    {"fp32": 18.7, "tf32": 18.7, "fp16": 37.4, "bf16": 37.4},
    512 * GB_S, "pcie4", 32 * GB_S,
    aliases=("rtx3080ti-16GB", "RTX 3080 Ti Laptop GPU"),
    source="scaled from GA102 whitepaper; laptop TGP-dependent",
))
# NVIDIA A100 datasheet: FP32 19.5, TF32 156, BF16/FP16 312 TF dense; 40GB SXM 1555 GB/s,
# 80GB SXM 2039 GB/s; NVLink 600 GB/s.
register(GpuSpec(
    "A100-40GB", 40960 * MiB, (8, 0),
    {"fp32": 19.5, "tf32": 156.0, "fp16": 312.0, "bf16": 312.0},
    1555 * GB_S, "nvlink3", 600 * GB_S,
    aliases=("A100-SXM4-40GB", "A100-PCIE-40GB", "A100 40GB"),
    source="NVIDIA A100 Tensor Core GPU datasheet",
))
register(GpuSpec(
    "A100-80GB", 81920 * MiB, (8, 0),
    {"fp32": 19.5, "tf32": 156.0, "fp16": 312.0, "bf16": 312.0},
    2039 * GB_S, "nvlink3", 600 * GB_S,
    aliases=("A100", "A100-SXM4-80GB", "A100 80GB PCIe", "A100-80GB-PCIe"),
    source="NVIDIA A100 Tensor Core GPU datasheet",
))
# --- Ada Lovelace -----------------------------------------------------------------------------
# NVIDIA L4 datasheet: FP32 30.3, TF32 60, BF16/FP16 121 TF dense (242 sparse), 300 GB/s.
register(GpuSpec(
    "L4", 23034 * MiB, (8, 9),
    {"fp32": 30.3, "tf32": 60.0, "fp16": 121.0, "bf16": 121.0},
    300 * GB_S, "pcie4", 64 * GB_S,
    aliases=("L4-24GB",), source="NVIDIA L4 Tensor Core GPU datasheet",
))
# NVIDIA L40S datasheet: FP32 91.6, TF32 183, BF16/FP16 362 TF dense (733 sparse), 864 GB/s.
register(GpuSpec(
    "L40S", 46068 * MiB, (8, 9),
    {"fp32": 91.6, "tf32": 183.0, "fp16": 362.0, "bf16": 362.0},
    864 * GB_S, "pcie4", 64 * GB_S,
    aliases=("L40S-48GB",), source="NVIDIA L40S GPU datasheet",
))
# GeForce RTX 4090 (Ada whitepaper, appendix): FP32 82.6; FP16/BF16 tensor with FP32
# accumulate 165.2 TF dense; TF32 82.6; 1008 GB/s.
register(GpuSpec(
    "RTX-4090", 24564 * MiB, (8, 9),
    {"fp32": 82.6, "tf32": 82.6, "fp16": 165.2, "bf16": 165.2},
    1008 * GB_S, "pcie4", 64 * GB_S,
    aliases=("RTX4090", "GeForce RTX 4090", "4090"),
    source="NVIDIA Ada GPU architecture whitepaper",
))
# --- Hopper -----------------------------------------------------------------------------------
# NVIDIA H100 datasheet, SXM5: FP32 67, TF32 494.7, BF16/FP16 989.4 TF dense, 3.35 TB/s,
# NVLink 900 GB/s. PCIe: FP32 51, TF32 378, BF16/FP16 756 TF dense, 2.0 TB/s, PCIe Gen5 128 GB/s.
register(GpuSpec(
    "H100-80GB", 81559 * MiB, (9, 0),
    {"fp32": 67.0, "tf32": 494.7, "fp16": 989.4, "bf16": 989.4},
    3350 * GB_S, "nvlink4", 900 * GB_S,
    aliases=("H100", "H100-SXM", "H100-SXM5-80GB", "H100 80GB HBM3", "H100-SXM-80GB"),
    source="NVIDIA H100 Tensor Core GPU datasheet (SXM5)",
))
register(GpuSpec(
    "H100-PCIe-80GB", 81559 * MiB, (9, 0),
    {"fp32": 51.0, "tf32": 378.0, "fp16": 756.0, "bf16": 756.0},
    2000 * GB_S, "pcie5", 128 * GB_S,
    aliases=("H100-PCIe", "H100 PCIe"), source="NVIDIA H100 Tensor Core GPU datasheet (PCIe)",
))
# NVIDIA H200 datasheet (SXM): 141 GB HBM3e at 4.8 TB/s; compute as H100 SXM; NVLink 900 GB/s.
register(GpuSpec(
    "H200", 143771 * MiB, (9, 0),
    {"fp32": 67.0, "tf32": 494.7, "fp16": 989.4, "bf16": 989.4},
    4800 * GB_S, "nvlink4", 900 * GB_S,
    aliases=("H200-141GB", "H200-SXM", "H200 SXM"), source="NVIDIA H200 Tensor Core GPU datasheet",
))
