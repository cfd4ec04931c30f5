"""The bundled GPU catalog: one ``register(GpuSpec(...))`` per card (docs/style.md §2).

Figures are dense (no 2:4 sparsity) peak tensor throughput from each vendor datasheet, in
TFLOP/s. ``memory`` is the total the driver reports (``nvidia-smi`` / NVML ``total``; ROCm's
``totalGlobalMem``; on Apple silicon ``torch.mps.recommended_max_memory()``), which is what a
plan must fit in; it is a little below the marketing "GB" figure. Bandwidths are in
bytes/s (decimal GB/s × 1e9, as datasheets quote them); interconnect bandwidth is the
datasheet's total bidirectional figure per GPU.

``vendor`` says which runtime a card trains under: ``nvidia`` (CUDA), ``amd`` (ROCm: torch's
``cuda`` device, HIP underneath; ``compute_capability`` is the gfx major.minor torch reports, e.g.
(9, 4) for gfx942) or ``apple`` (MPS: no compute capability, unified memory).

CUDA context size is *not* here: it depends on driver and CUDA version, not on the card; it
belongs to the estimator's CUDA model, and ``probe_device`` can measure it on a real GPU.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from .._registry import Registry
from .._units import GiB, MiB

VENDORS = ("nvidia", "amd", "apple")


@dataclass(frozen=True)
class GpuSpec:
    name: str = field(metadata={"help": "Canonical catalog name, e.g. 'A100-80GB'."})
    memory: int = field(metadata={"help": "Total device memory in bytes as NVML reports it."})
    compute_capability: tuple[int, int] | None = field(metadata={
        "help": "CUDA (major, minor); on ROCm the gfx (major, minor) torch reports; None on MPS."})
    tflops: dict[str, float] = field(
        metadata={"help": "Dense peak TFLOP/s by math mode: fp32, tf32, fp16, bf16 (0 = none)."}
    )
    memory_bandwidth: float = field(metadata={"help": "HBM/GDDR bandwidth, bytes/s."})
    interconnect: str = field(metadata={
        "help": "GPU-to-GPU link: 'nvlink2..5', 'xgmi' (AMD Infinity Fabric), 'pcie3/4/5' or "
                "'none' (Apple silicon: one GPU)."})
    interconnect_bandwidth: float = field(
        metadata={"help": "Bidirectional GPU-to-GPU bandwidth per GPU, bytes/s (datasheet)."}
    )
    aliases: tuple[str, ...] = field(default=(), metadata={"help": "Other accepted names."})
    source: str = field(default="", metadata={"help": "Where the figures come from (URLs)."})
    vendor: str = field(default="nvidia", metadata={
        "help": "'nvidia' (CUDA), 'amd' (ROCm, torch's cuda device) or 'apple' (MPS)."})
    cuda_memory: int | None = field(default=None, metadata={
        "help": "Bytes CUDA hands to a process: torch's total_memory, the 'total capacity' of "
                "its out-of-memory message; NVML's total less what the driver and firmware "
                "reserve. None where no measurement is published (the budget then assumes "
                "``_estimate.budget.DRIVER_RESERVE``)."})

    def __post_init__(self) -> None:
        if self.vendor not in VENDORS:
            raise ValueError(f"GpuSpec {self.name}: vendor `{self.vendor}` is not one of "
                             f"{', '.join(VENDORS)}")
        if (self.compute_capability is None) != (self.vendor == "apple"):
            raise ValueError(f"GpuSpec {self.name}: a compute capability is given for CUDA and "
                             "ROCm cards and only for them")

    @property
    def kind(self) -> str:
        """The torch device type it trains as: ``mps`` on Apple silicon, else ``cuda`` (ROCm
        builds of torch expose AMD GPUs as ``cuda`` devices)."""
        return "mps" if self.vendor == "apple" else "cuda"

    @property
    def supports_bf16(self) -> bool:
        if self.vendor != "nvidia":  # MI200+ matrix cores; MPS on macOS 14+
            return self.tflops.get("bf16", 0) > 0
        # bf16 tensor cores arrived with Ampere (sm_80); Volta/Turing emulate it slowly.
        return self.compute_capability >= (8, 0)

    @property
    def supports_tf32(self) -> bool:
        # TF32 is an Ampere (sm_80) tensor-core mode; transformers allows tf32=True on CUDA
        # builds only (is_torch_tf32_available: torch.version.cuda), so never on ROCm or MPS.
        return self.vendor == "nvidia" and self.compute_capability >= (8, 0)

    @property
    def supports_fp16_tensor_cores(self) -> bool:
        if self.vendor != "nvidia":
            return self.vendor == "amd"  # CDNA matrix cores; Apple GPUs have none
        # fp16 tensor cores arrived with Volta (sm_70).
        return self.compute_capability >= (7, 0)


def normalize_gpu_name(name: str) -> str:
    """Case- and punctuation-insensitive key; drops vendor words NVML, ROCm and macOS put in
    front. Names are matched whole, never as substrings: ``B300`` is not ``GB300``, ``H20`` is
    not ``H200`` (each is a key of its own)."""
    key = name.lower()
    key = re.sub(r"\b(nvidia|tesla|geforce|quadro|amd|instinct|apple)\b", "", key)
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
    aliases=("Tesla T4", "T4-16GB"), source="NVIDIA T4 datasheet, https://www.nvidia.com/en-us/data-center/tesla-t4/"
           "; nvidia-smi totals: https://github.com/modal-labs/modal-client/pull/2797",
    # torch's total in its OOM messages: 14.56 GiB on GCP and Colab drivers of 2025-26 (14.75
    # before): github.com/hpcaitech/Open-Sora/issues/697, github.com/Zheng-Chong/CatVTON/issues/133
    cuda_memory=int(14.56 * GiB),
))
# --- Volta ------------------------------------------------------------------------------------
# NVIDIA V100 datasheet (SXM2): FP32 15.7 TF, tensor 125 TF, 900 GB/s, NVLink 300 GB/s.
# 16160 MiB is the nvidia-smi total of anchor hf_perf_cuda_context_overhead (docs/anchors.md).
register(GpuSpec(
    "V100-SXM2-16GB", 16160 * MiB, (7, 0),
    {"fp32": 15.7, "tf32": 0.0, "fp16": 125.0, "bf16": 0.0},
    900 * GB_S, "nvlink2", 300 * GB_S,
    aliases=("V100", "V100-16GB", "Tesla V100-SXM2-16GB"),
    source="NVIDIA V100 datasheet, https://images.nvidia.com/content/technologies/volta/pdf/volta-v100-datasheet-update-us-1165301-r5.pdf",
    # torch's total in its OOM messages: 15.78 GiB: github.com/kchengiva/Shift-GCN/issues/34
    cuda_memory=int(15.78 * GiB),
))
register(GpuSpec(
    "V100-32GB", 32510 * MiB, (7, 0),
    {"fp32": 15.7, "tf32": 0.0, "fp16": 125.0, "bf16": 0.0},
    900 * GB_S, "nvlink2", 300 * GB_S,
    aliases=("V100-SXM2-32GB", "Tesla V100-SXM2-32GB", "V100S", "V100-PCIE-32GB"),
    source="NVIDIA V100 datasheet (SXM2 32GB), https://images.nvidia.com/content/technologies/volta/pdf/volta-v100-datasheet-update-us-1165301-r5.pdf",
    # torch's total in its OOM messages: 31.74 GiB: github.com/haotian-liu/LLaVA/issues/812
    cuda_memory=int(31.74 * GiB),
))
# --- Ampere -----------------------------------------------------------------------------------
# NVIDIA A10 datasheet: FP32 31.2, TF32 62.5, BF16/FP16 125 TF dense, 600 GB/s, PCIe Gen4.
# AWS's A10G is an A10 variant with no separate NVIDIA datasheet; A10 figures are used.
register(GpuSpec(
    "A10G", 22731 * MiB, (8, 6),
    {"fp32": 31.2, "tf32": 62.5, "fp16": 125.0, "bf16": 125.0},
    600 * GB_S, "pcie4", 64 * GB_S,
    aliases=("A10", "A10G-24GB"),
    source="NVIDIA A10 datasheet, https://www.nvidia.com/en-us/data-center/products/a10-gpu/",
    # torch's total in its OOM messages: 21.98-21.99 GiB: github.com/zai-org/CogVLM/issues/236
    cuda_memory=int(21.98 * GiB),
))
# GeForce RTX 3090 (GA102 whitepaper, appendix): FP32 35.6; tensor FP16/BF16 with FP32
# accumulate 71 TF dense (the 142 TF figure is FP16-accumulate); TF32 35.6; 936 GB/s.
register(GpuSpec(
    "RTX-3090", 24576 * MiB, (8, 6),
    {"fp32": 35.6, "tf32": 35.6, "fp16": 71.0, "bf16": 71.0},
    936 * GB_S, "pcie4", 64 * GB_S,
    aliases=("RTX3090", "GeForce RTX 3090", "3090"),
    source="NVIDIA Ampere GA102 GPU architecture whitepaper, https://www.nvidia.com/content/"
           "PDF/nvidia-ampere-ga-102-gpu-architecture-whitepaper-v2.pdf (appendix)",
    # torch's total in its OOM messages: 23.69-23.70 GiB: github.com/ucwxb/GraphAvatar/issues/4,
    # github.com/GaoLii/DSP/issues/10
    cuda_memory=int(23.69 * GiB),
))
# Laptop RTX 3080 Ti 16 GB (GA103, anchors sdpa_pythia410m_*, docs/anchors.md): ~ 2/3 of a
# desktop 3080 Ti; NVIDIA publishes no tensor TFLOP/s for laptop parts, figures scale the GA102
# whitepaper by SM count and boost clock (58 SMs at ~1.26 GHz): FP32 ~18.7, FP16/BF16 (FP32
# acc) ~37.
register(GpuSpec(
    "RTX-3080Ti-Laptop-16GB", 16384 * MiB, (8, 6),
    {"fp32": 18.7, "tf32": 18.7, "fp16": 37.4, "bf16": 37.4},
    512 * GB_S, "pcie4", 32 * GB_S,
    aliases=("rtx3080ti-16GB", "RTX 3080 Ti Laptop GPU"),
    source="scaled from the GA102 whitepaper (https://www.nvidia.com/content/PDF/nvidia-"
           "ampere-ga-102-gpu-architecture-whitepaper-v2.pdf); laptop TGP-dependent",
))
# NVIDIA A100 datasheet: FP32 19.5, TF32 156, BF16/FP16 312 TF dense; 40GB SXM 1555 GB/s,
# 80GB SXM 2039 GB/s; NVLink 600 GB/s.
register(GpuSpec(
    "A100-40GB", 40960 * MiB, (8, 0),
    {"fp32": 19.5, "tf32": 156.0, "fp16": 312.0, "bf16": 312.0},
    1555 * GB_S, "nvlink3", 600 * GB_S,
    aliases=("A100-SXM4-40GB", "A100-PCIE-40GB", "A100 40GB"),
    source="NVIDIA A100 datasheet, https://www.nvidia.com/en-us/data-center/a100/ (datasheet); nvidia-smi totals: https://github.com/modal-labs/modal-client/pull/2797",
    # torch's total in its OOM messages: 39.39-39.59 GiB by driver:
    # github.com/TianheWu/CoSeR/issues/10, github.com/raoyongming/DenseCLIP/issues/52
    cuda_memory=int(39.39 * GiB),
))
register(GpuSpec(
    "A100-80GB", 81920 * MiB, (8, 0),
    {"fp32": 19.5, "tf32": 156.0, "fp16": 312.0, "bf16": 312.0},
    2039 * GB_S, "nvlink3", 600 * GB_S,
    aliases=("A100", "A100-SXM4-80GB", "A100 80GB PCIe", "A100-80GB-PCIe"),
    source="NVIDIA A100 datasheet, https://www.nvidia.com/en-us/data-center/a100/ (datasheet); nvidia-smi totals: https://github.com/modal-labs/modal-client/pull/2797",
    # torch's total in its OOM messages: 79.14 GiB on 2025 drivers (79.35 in 2023-24):
    # github.com/OSU-NLP-Group/TableLlama/issues/10, github.com/wbfwonderful/Vad-R1/issues/11
    cuda_memory=int(79.14 * GiB),
))
# --- Ada Lovelace -----------------------------------------------------------------------------
# NVIDIA L4 datasheet: FP32 30.3, TF32 60, BF16/FP16 121 TF dense (242 sparse), 300 GB/s.
register(GpuSpec(
    "L4", 23034 * MiB, (8, 9),
    {"fp32": 30.3, "tf32": 60.0, "fp16": 121.0, "bf16": 121.0},
    300 * GB_S, "pcie4", 64 * GB_S,
    aliases=("L4-24GB",),
    source="NVIDIA L4 datasheet, https://www.nvidia.com/en-us/data-center/l4/; nvidia-smi totals: https://github.com/modal-labs/modal-client/pull/2797",
    # torch's total in its OOM messages: 21.95-22.05 GiB in vLLM's CI logs (the card inferred from
    # its size): github.com/vllm-project/vllm/pull/12626
    cuda_memory=int(21.95 * GiB),
))
# NVIDIA L40S datasheet: FP32 91.6, TF32 183, BF16/FP16 362 TF dense (733 sparse), 864 GB/s.
register(GpuSpec(
    "L40S", 46068 * MiB, (8, 9),
    {"fp32": 91.6, "tf32": 183.0, "fp16": 362.0, "bf16": 362.0},
    864 * GB_S, "pcie4", 64 * GB_S,
    aliases=("L40S-48GB",),
    source="NVIDIA L40S datasheet, https://www.nvidia.com/en-us/data-center/l40s/; nvidia-smi totals: https://github.com/modal-labs/modal-client/pull/2797",
    # torch's total in its OOM messages: 44.39-44.42 GiB: github.com/stepfun-ai/Step-
    # Video-T2V/issues/8
    cuda_memory=int(44.39 * GiB),
))
# GeForce RTX 4090 (Ada whitepaper, appendix): FP32 82.6; FP16/BF16 tensor with FP32
# accumulate 165.2 TF dense; TF32 82.6; 1008 GB/s.
register(GpuSpec(
    "RTX-4090", 24564 * MiB, (8, 9),
    {"fp32": 82.6, "tf32": 82.6, "fp16": 165.2, "bf16": 165.2},
    1008 * GB_S, "pcie4", 64 * GB_S,
    aliases=("RTX4090", "GeForce RTX 4090", "4090"),
    source="NVIDIA Ada GPU architecture whitepaper, https://images.nvidia.com/aem-dam/"
           "Solutions/geforce/ada/nvidia-ada-gpu-architecture.pdf (appendix)",
    # torch's total in its OOM messages: 23.61-23.68 GiB, 23.64 most often: github.com/ali-
    # vilab/VGen/issues/104, github.com/tloen/llama-int8/issues/7
    cuda_memory=int(23.61 * GiB),
))
# --- Hopper -----------------------------------------------------------------------------------
# NVIDIA H100 datasheet, SXM5: FP32 67, TF32 494.7, BF16/FP16 989.4 TF dense, 3.35 TB/s,
# NVLink 900 GB/s. PCIe: FP32 51, TF32 378, BF16/FP16 756 TF dense, 2.0 TB/s, PCIe Gen5 128 GB/s.
register(GpuSpec(
    "H100-80GB", 81559 * MiB, (9, 0),
    {"fp32": 67.0, "tf32": 494.7, "fp16": 989.4, "bf16": 989.4},
    3350 * GB_S, "nvlink4", 900 * GB_S,
    aliases=("H100", "H100-SXM", "H100-SXM5-80GB", "H100 80GB HBM3", "H100-SXM-80GB"),
    source="NVIDIA H100 datasheet (SXM5), https://www.nvidia.com/en-us/data-center/h100/"
           "; nvidia-smi totals: https://github.com/modal-labs/modal-client/pull/2797",
    # torch's total in its OOM messages: 79.11-79.21 GiB: github.com/vllm-project/vllm/issues/27508,
    # github.com/nvidia-cosmos/cosmos-transfer2.5/issues/113
    cuda_memory=int(79.11 * GiB),
))
register(GpuSpec(
    "H100-PCIe-80GB", 81559 * MiB, (9, 0),
    {"fp32": 51.0, "tf32": 378.0, "fp16": 756.0, "bf16": 756.0},
    2000 * GB_S, "pcie5", 128 * GB_S,
    aliases=("H100-PCIe", "H100 PCIe"),
    source="NVIDIA H100 datasheet (PCIe), https://www.nvidia.com/en-us/data-center/h100/",
))
# NVIDIA H200 datasheet (SXM): 141 GB HBM3e at 4.8 TB/s; compute as H100 SXM; NVLink 900 GB/s.
register(GpuSpec(
    "H200", 143771 * MiB, (9, 0),
    {"fp32": 67.0, "tf32": 494.7, "fp16": 989.4, "bf16": 989.4},
    4800 * GB_S, "nvlink4", 900 * GB_S,
    aliases=("H200-141GB", "H200-SXM", "H200 SXM"),
    source="NVIDIA H200 datasheet, https://www.nvidia.com/en-us/data-center/h200/",
    # torch's total in its OOM messages: 139.72-139.81 GiB; bench/results/gpu's H200 measured 139.80
    # GiB (torch 2.11, driver 580)
    cuda_memory=int(139.72 * GiB),
))
# --- Hopper, export variant -------------------------------------------------------------------
# NVIDIA publishes no H20 datasheet (github.com/sunkx109/GPUs-Specs/issues/2); the figures are
# those NVIDIA gave OEMs and the press reported: FP32 44, TF32 74, BF16/FP16 148 TF dense,
# 96 GB HBM3 at 4.0 TB/s, NVLink 900 GB/s. A measured bf16 GEMM reaches 142 TF (below).
register(GpuSpec(
    "H20", 97871 * MiB, (9, 0),
    {"fp32": 44.0, "tf32": 74.0, "fp16": 148.0, "bf16": 148.0},
    4000 * GB_S, "nvlink4", 900 * GB_S,
    aliases=("H20-96GB", "NVIDIA H20"),
    source="no public datasheet (https://github.com/sunkx109/GPUs-Specs/issues/2): press figures; "
           "bf16 GEMM 142 TF measured in https://github.com/zzc0721/torch-performance-test-data/"
           "issues/77; total: nvidia-smi 'NVIDIA H20, 97871 MiB' in public run logs",
    # torch's total in its OOM messages: 95.00 GiB: github.com/modelscope/DiffSynth-
    # Studio/issues/1238
    cuda_memory=int(95.0 * GiB),
))
# --- Blackwell (data center) ------------------------------------------------------------------
# Per-GPU dense figures: HGX B200 at 1000 W and GB200 at 1200 W (glennklockwood.com tables of
# NVIDIA's GTC24 figures); 8 TB/s HBM3e (the CUDA-reported bus gives 7.7 TB/s, pytorch/ao#4002);
# NVLink 5: 1.8 TB/s per GPU. Totals: nvidia-smi 'NVIDIA B200, 183359 MiB' and
# 'NVIDIA GB200, 189471 MiB' (public nvidia-smi logs; GB200 has more usable HBM than B200).
register(GpuSpec(
    "B200", 183359 * MiB, (10, 0),
    {"fp32": 80.0, "tf32": 1100.0, "fp16": 2250.0, "bf16": 2250.0},
    8000 * GB_S, "nvlink5", 1800 * GB_S,
    aliases=("B200-180GB", "B200-SXM", "HGX B200", "B200 SXM6"),
    source="https://glennklockwood.com/garden/processors/B200 (HGX B200 table, 1000 W); "
           "https://www.nvidia.com/en-us/data-center/hgx/ (HGX B200 specs); "
           "https://github.com/pytorch/ao/pull/4002 (bandwidth); total from nvidia-smi",
    # torch's total in its OOM messages: 178.35-178.36 GiB on 8 x B200 (repository logs)
    cuda_memory=int(178.35 * GiB),
))
register(GpuSpec(
    "GB200", 189471 * MiB, (10, 0),
    {"fp32": 90.0, "tf32": 1250.0, "fp16": 2500.0, "bf16": 2500.0},
    8000 * GB_S, "nvlink5", 1800 * GB_S,
    aliases=("GB200-NVL72", "GB200 NVL72", "GB200-186GB"),
    source="https://glennklockwood.com/garden/processors/B200 (GB200 table, 1200 W); "
           "https://www.nvidia.com/en-us/data-center/gb200-nvl72/ (specs, per GPU = rack / 72); "
           "total from nvidia-smi",
))
# Blackwell Ultra (sm_103): HGX B300 as B200 in bf16 (2.25 PF dense), GB300 2.5 PF dense at
# 1400 W; 288 GB HBM3e at 8 TB/s. Totals: nvidia-smi 'NVIDIA B300 SXM6 AC, 275040 MiB' and
# 'NVIDIA GB300, 284208 MiB' (public nvidia-smi logs). The names are matched whole: B300 is
# not GB300 (tests/unit/device/test_catalog_entries.py).
register(GpuSpec(
    "B300", 275040 * MiB, (10, 3),
    {"fp32": 75.0, "tf32": 1100.0, "fp16": 2250.0, "bf16": 2250.0},
    8000 * GB_S, "nvlink5", 1800 * GB_S,
    aliases=("B300-SXM6-AC", "B300 SXM6 AC", "HGX B300", "B300-288GB"),
    source="https://glennklockwood.com/garden/processors/B300 (HGX B300 table); "
           "https://verda.com/blog/gb300-nvl72-architecture (per-GPU specs table, dense); "
           "total from nvidia-smi",
))
register(GpuSpec(
    "GB300", 284208 * MiB, (10, 3),
    {"fp32": 80.0, "tf32": 1250.0, "fp16": 2500.0, "bf16": 2500.0},
    8000 * GB_S, "nvlink5", 1800 * GB_S,
    aliases=("GB300-NVL72", "GB300 NVL72", "GB300-288GB"),
    source="https://verda.com/blog/gb300-nvl72-architecture (per-GPU specs table, dense); "
           "https://www.nvidia.com/en-us/data-center/gb300-nvl72/; total from nvidia-smi",
))
# --- Blackwell (workstation, GeForce) ---------------------------------------------------------
# RTX Blackwell whitepaper, appendix A: RTX 5090 FP32 104.8, FP16/BF16 tensor with FP32
# accumulate 209.5 TF dense (GeForce halves FP32-accumulate), TF32 104.8; 1792 GB/s GDDR7.
register(GpuSpec(
    "RTX-5090", 32607 * MiB, (12, 0),
    {"fp32": 104.8, "tf32": 104.8, "fp16": 209.5, "bf16": 209.5},
    1792 * GB_S, "pcie5", 128 * GB_S,
    aliases=("RTX5090", "GeForce RTX 5090", "5090"),
    source="https://images.nvidia.com/aem-dam/Solutions/geforce/blackwell/nvidia-rtx-blackwell-"
           "gpu-architecture.pdf (appendix A, RTX 5090); total: nvidia-smi '32607MiB' in "
           "https://github.com/noonghunna/club-3090/issues/617",
    # torch's total in its OOM messages: 31.36-31.37 GiB: github.com/Wan-Video/Wan2.1/issues/465
    cuda_memory=int(31.36 * GiB),
))
# RTX PRO 6000 Blackwell (Workstation and Server Edition, 600 W; the 300 W Max-Q is slower):
# datasheet FP32 125 TF and FP4 4 PF with sparsity; NVIDIA gives no dense bf16 figure. Assumed:
# the pro card runs FP32 accumulate at full rate, so dense bf16 = FP4 sparse / 8 = 500 TF
# (188 SMs x 1024 FLOP/clk x 2.6 GHz agrees); TF32 = a quarter of it; 1792 GB/s GDDR7.
register(GpuSpec(
    "RTX-PRO-6000", 97887 * MiB, (12, 0),
    {"fp32": 125.0, "tf32": 125.0, "fp16": 500.0, "bf16": 500.0},
    1792 * GB_S, "pcie5", 128 * GB_S,
    aliases=("RTX PRO 6000 Blackwell", "RTX PRO 6000 Blackwell Workstation Edition",
             "RTX PRO 6000 Blackwell Server Edition", "RTX-PRO-6000-Blackwell"),
    source="https://www.nvidia.com/en-us/products/workstations/professional-desktop-gpus/"
           "rtx-pro-6000/ (specs: FP32, FP4 sparse; dense bf16 derived, see comment); total: "
           "nvidia-smi 'NVIDIA RTX PRO 6000 Blackwell Workstation Edition, 97887 MiB'",
    # torch's total in its OOM messages: 94.97 GiB: github.com/antirez/ds4/issues/431
    cuda_memory=int(94.97 * GiB),
))
# --- AMD Instinct (ROCm: torch's cuda device; compute capability = gfx major.minor) -----------
# MI300X (gfx942): 304 CUs at 2.1 GHz: BF16/FP16 1307.4, TF32 653.7, FP32 matrix 163.4 TF dense;
# 5.3 TB/s HBM3; Infinity Fabric 7 links x 128 GB/s. Bare metal reports 192 GiB less 16 MiB
# (rocminfo pool 201310208 KB); a cloud VF (Azure ND MI300X v5) reports totalGlobalMem
# 205822885888 B, 304 MiB less: its own entry, so a VF is never planned with the bare total.
register(GpuSpec(
    "MI300X", 196592 * MiB, (9, 4),
    {"fp32": 163.4, "tf32": 653.7, "fp16": 1307.4, "bf16": 1307.4},
    5300 * GB_S, "xgmi", 896 * GB_S, vendor="amd",
    aliases=("AMD Instinct MI300X", "MI300X-192GB"),
    source="https://www.amd.com/en/products/accelerators/instinct/mi300/mi300x.html (specs); "
           "total: rocminfo in https://github.com/stas00/ml-engineering/blob/master/compute/"
           "accelerator/amd/debug.md (Pool 1 Size)",
))
register(GpuSpec(
    "MI300X-VF", 205822885888, (9, 4),
    {"fp32": 163.4, "tf32": 653.7, "fp16": 1307.4, "bf16": 1307.4},
    5300 * GB_S, "xgmi", 896 * GB_S, vendor="amd",
    aliases=("AMD Instinct MI300X VF", "MI300X VF"),
    source="https://www.amd.com/en/products/accelerators/instinct/mi300/mi300x.html (specs); "
           "total: totalGlobalMem of 'AMD Instinct MI300X VF' in a public gpu benchmark report "
           "(hipcc 6.4, 2025-08-08)",
))
# MI325X: MI300X's compute (gfx942, 304 CUs) with 256 GB HBM3E at 6 TB/s. No reported total
# found: assumed 256 GiB less 16 MiB, as MI300X reports 192 GiB less 16 MiB.
register(GpuSpec(
    "MI325X", 262128 * MiB, (9, 4),
    {"fp32": 163.4, "tf32": 653.7, "fp16": 1307.4, "bf16": 1307.4},
    6000 * GB_S, "xgmi", 896 * GB_S, vendor="amd",
    aliases=("AMD Instinct MI325X", "MI325X-256GB"),
    source="https://www.amd.com/en/products/accelerators/instinct/mi300/mi325x.html (specs); "
           "total not published: 256 GiB - 16 MiB assumed (MI300X's reserve)",
))
# MI355X (gfx950, CDNA 4): 256 CUs at 2.4 GHz, 4096 bf16 FLOP/clk/CU: 2516.6 TF dense; FP32
# 157.3; no TF32 (CDNA 4 dropped it); 288 GB HBM3E at 8 TB/s; Infinity Fabric 7 x 153.6 GB/s.
# No reported total found: 288 GiB less 16 MiB assumed.
register(GpuSpec(
    "MI355X", 294896 * MiB, (9, 5),
    {"fp32": 157.3, "tf32": 0.0, "fp16": 2516.6, "bf16": 2516.6},
    8000 * GB_S, "xgmi", 1075 * GB_S, vendor="amd",
    aliases=("AMD Instinct MI355X", "MI355X-288GB"),
    source="https://www.amd.com/en/products/accelerators/instinct/mi350/mi355x.html (specs); "
           "per-CU rate: AMD ISSCC 2026 (8192 FP8 FLOP/clk/CU); total not published: 288 GiB - "
           "16 MiB assumed (MI300X's reserve)",
))
# --- Apple silicon (MPS: unified memory) ------------------------------------------------------
# The training budget is Metal's recommendedMaxWorkingSetSize (torch.mps.recommended_max_memory),
# 3/4 of RAM on these configurations under macOS 14/15 (macOS 26 gives more; set
# iogpu.wired_limit_mb to raise it). fp16 runs at the FP32 rate on Apple GPUs; M2 has no bf16
# ALUs (MPS converts, macOS 14+): bf16 assumed at the FP32 rate at best. One GPU: no link.
register(GpuSpec(
    "M2-Max-96GB", 73728 * MiB, None,
    {"fp32": 13.6, "tf32": 0.0, "fp16": 13.6, "bf16": 13.6},
    400 * GB_S, "none", 0.0, vendor="apple",
    aliases=("Apple M2 Max 96GB", "M2-Max"),
    source="recommendedMaxWorkingSetSize = 73728 MB on an M2 Max 96 GB: https://github.com/"
           "ggml-org/llama.cpp/issues/3213; https://www.apple.com/newsroom/2023/01/ (M2 Max: "
           "38-core GPU 13.6 TFLOPS, 400 GB/s)",
))
register(GpuSpec(
    "M2-Ultra-192GB", 147456 * MiB, None,
    {"fp32": 27.2, "tf32": 0.0, "fp16": 27.2, "bf16": 27.2},
    800 * GB_S, "none", 0.0, vendor="apple",
    aliases=("Apple M2 Ultra 192GB", "M2-Ultra"),
    source="max_recommended 144 GB on M2 Ultra 192 GB: https://github.com/raullenchai/Rapid-MLX/"
           "pull/183 (3/4 of RAM, as llama.cpp#3213 on M2 Max); https://www.apple.com/newsroom/"
           "2023/06/ (M2 Ultra: 76-core GPU 27.2 TFLOPS, 800 GB/s)",
))
