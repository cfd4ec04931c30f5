"""Which device we plan for: ``probe_device`` (this machine) and ``get_device`` (the catalog).

Data flow: ``probe_device() / get_device() -> DeviceInfo -> estimate_memory / plan_training``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import platform
from dataclasses import dataclass, field
from typing import Any

import psutil

from .._errors import HfMemkitError, excerpt
from .catalog import GpuSpec, catalog, lookup
from .nvml import NvmlFacts, nvml_handle, query, visible_entries  # noqa: F401  (nvml_handle: callers import it here)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DeviceInfo:
    """One device a training run can be planned for (one GPU of a node, or the CPU)."""

    name: str = field(metadata={"help": "Device name, e.g. 'A100-80GB' or 'NVIDIA A100-SXM4-80GB'."})
    kind: str = field(metadata={"help": "'cuda', 'cpu' or 'mps'."})
    total_memory: int = field(metadata={"help": "Bytes of device memory (system RAM on CPU)."})
    free_memory: int | None = field(
        default=None, metadata={"help": "Bytes free now; None when unknown (catalog entries)."}
    )
    compute_capability: tuple[int, int] | None = field(
        default=None, metadata={"help": "CUDA (major, minor); None off CUDA."}
    )
    supports_bf16: bool = field(default=False, metadata={"help": "bf16 usable for training."})
    supports_tf32: bool = field(default=False, metadata={"help": "TF32 tensor-core matmuls."})
    supports_fp16_tensor_cores: bool = field(
        default=False, metadata={"help": "fp16 tensor cores (Volta and newer)."}
    )
    count: int = field(default=1, metadata={"help": "Devices of this kind visible (or planned)."})
    index: int | None = field(default=None, metadata={"help": "Device index when probed."})
    mig: bool = field(default=False, metadata={"help": "A MIG slice of a larger GPU."})
    source: str = field(
        default="catalog", metadata={"help": "'nvml', 'torch.cuda', 'mps', 'psutil' or 'catalog'."}
    )
    catalog_name: str | None = field(
        default=None, metadata={"help": "The matching catalog entry (peak TFLOP/s, bandwidth)."}
    )
    peak_tflops: dict[str, float] = field(
        default_factory=dict, metadata={"help": "Dense peak TFLOP/s by math mode (catalog)."}
    )
    memory_bandwidth: float | None = field(default=None, metadata={"help": "Bytes/s (catalog)."})
    interconnect: str | None = field(default=None, metadata={"help": "'nvlink4', 'pcie4', ..."})
    interconnect_bandwidth: float | None = field(
        default=None, metadata={"help": "Bidirectional GPU-to-GPU bytes/s (catalog)."}
    )
    driver_version: str | None = field(default=None, metadata={"help": "NVIDIA driver, if probed."})
    own_memory: int | None = field(default=None, metadata={
        "help": "Bytes this process already held on the device when probed (its CUDA context "
                "and the caching allocator's segments; NVML's process list, else torch's "
                "reserved). free_memory + own_memory is what this process's run may use; "
                "None off a probed CUDA device."})
    others_memory: int | None = field(default=None, metadata={
        "help": "Bytes other processes held on the device when probed (NVML's process list; "
                "None where NVML does not list them, e.g. MIG without root): tenants the "
                "budget leaves their memory to."})
    cuda_memory: int | None = field(default=None, metadata={
        "help": "Bytes CUDA hands to a process (torch's total_memory, cudaMemGetInfo's total): "
                "total_memory less what the driver reserves; None where not known."})
    vendor: str | None = field(default=None, metadata={
        "help": "'nvidia' (CUDA), 'amd' (ROCm: kind 'cuda', HIP underneath), 'apple' (MPS); "
                "None on CPU or when unknown."})

    def __post_init__(self):
        if self.kind not in ("cuda", "cpu", "mps"):
            raise HfMemkitError(f"DeviceInfo.kind `{self.kind}` is not one of cuda, cpu, mps")
        if self.total_memory <= 0:
            raise HfMemkitError(
                f"DeviceInfo.total_memory must be a positive number of bytes, got {self.total_memory}"
            )
        if self.count < 1:
            raise HfMemkitError(f"DeviceInfo.count must be at least 1, got {self.count}")

    def replace(self, **changes: Any) -> DeviceInfo:
        """A copy with some fields changed, e.g. ``dev.replace(total_memory=8 * GiB)``."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        if d["compute_capability"] is not None:
            d["compute_capability"] = list(d["compute_capability"])
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DeviceInfo:
        d = dict(d)
        if d.get("compute_capability") is not None:
            d["compute_capability"] = tuple(d["compute_capability"])
        return cls(**d)


# ----------------------------------------------------------------------------------------------
# The catalog: planning for hardware you do not have
# ----------------------------------------------------------------------------------------------


def list_devices() -> list[str]:
    """`list[str]`: the canonical names of the bundled GPU catalog, sorted (aliases are
    accepted by `get_device`)."""
    return sorted(catalog())


def _from_spec(spec: GpuSpec, **extra: Any) -> DeviceInfo:
    fields = dict(
        name=spec.name,
        kind=spec.kind,
        total_memory=spec.memory,
        free_memory=None,
        compute_capability=spec.compute_capability,
        supports_bf16=spec.supports_bf16,
        supports_tf32=spec.supports_tf32,
        supports_fp16_tensor_cores=spec.supports_fp16_tensor_cores,
        source="catalog",
        catalog_name=spec.name,
        peak_tflops=dict(spec.tflops),
        memory_bandwidth=spec.memory_bandwidth,
        interconnect=spec.interconnect,
        interconnect_bandwidth=spec.interconnect_bandwidth,
        vendor=spec.vendor,
        cuda_memory=spec.cuda_memory,
    )
    fields.update(extra)
    return DeviceInfo(**fields)


def get_device(name: str, *, count: int = 1) -> DeviceInfo:
    """A catalog GPU by name (case-insensitive, common aliases), e.g. `get_device("a100")`.

    Args:
        name (`str`):
            A catalog name or alias (`list_devices()`); `"cpu"` gives this machine's CPU, as
            `probe_device` would. A `DeviceInfo` is returned as it is.
        count (`int`, *optional*, defaults to 1):
            The number of such GPUs (`DeviceInfo.count`); not used for `"cpu"`.

    Returns:
        `DeviceInfo`: the catalog's facts (`free_memory` unknown: `None`), or this CPU's.

    Raises:
        HfMemkitError: For an unknown name; the message lists the known ones.
    """
    if isinstance(name, DeviceInfo):
        return name
    if str(name).lower() == "cpu":
        return probe_cpu()
    spec = lookup(str(name))
    if spec is None:
        raise HfMemkitError(
            f"unknown GPU `{excerpt(name)}`; known: {', '.join(list_devices())} "
            "(aliases such as 'a100' or 'NVIDIA A100-SXM4-80GB' work too; see `hf-memkit devices`)"
        )
    return _from_spec(spec, count=count)


def resolve_device(device: DeviceInfo | str | None) -> DeviceInfo:
    """``DeviceInfo`` as given, a catalog name, ``"cpu"``, or ``None`` for ``probe_device()``."""
    if device is None:
        return probe_device()
    if isinstance(device, DeviceInfo):
        return device
    if isinstance(device, str):
        return get_device(device)
    raise HfMemkitError(
        f"device must be a DeviceInfo, a catalog name such as 'A100-80GB', 'cpu' or None; "
        f"got {type(device).__name__}"
    )


# ----------------------------------------------------------------------------------------------
# Probing this machine
# ----------------------------------------------------------------------------------------------


def probe_device(index: int | None = None) -> DeviceInfo:
    """Describe a device of this machine: CUDA (NVML, else `torch.cuda`), else MPS, else the CPU.

    Never raises for a missing driver: a machine without CUDA gets its CPU (or MPS) described.
    Creates no CUDA context where NVML can answer (`torch.cuda.mem_get_info` would make one
    of 0.3-0.5 GiB on the device it reads).

    Args:
        index (`int`, *optional*):
            The CUDA device. `None`: this process's device (`local_device_index`), which under
            torchrun is the rank's own GPU, never GPU 0 for every rank.

    Returns:
        `DeviceInfo`: the device, with its free memory now where it can be read.

    Raises:
        HfMemkitError: When CUDA device `index` does not exist.
    """
    import torch  # here, not at module level: `hf-memkit devices` and `--help` need no torch

    if index is not None and (not isinstance(index, int) or isinstance(index, bool) or index < 0):
        raise HfMemkitError(f"CUDA device index {index!r} is not a device index; give an "
                            "integer >= 0 (0 is the first device CUDA shows), or None for this "
                            "process's own")
    if _cuda_available():
        count = torch.cuda.device_count()
        if index is None:
            index = local_device_index(count)
        if not 0 <= index < count:
            raise HfMemkitError(
                f"CUDA device index {index} does not exist; this machine shows {count} "
                f"device(s): 0..{count - 1}"
            )
        return _probe_cuda(index, count)
    if _mps_available():
        return _probe_mps()
    return probe_cpu()


def local_device_index(count: int) -> int:
    """This process's CUDA device: ``LOCAL_RANK`` (torchrun, accelerate, deepspeed set it, and
    each rank trains on that device), else the current device once CUDA is initialised, else
    0. A ``LOCAL_RANK`` past the visible devices (each rank shown one GPU) means device 0."""
    import torch

    local = os.environ.get("LOCAL_RANK", "").strip()
    if local.isdigit():
        return int(local) if int(local) < count else 0
    try:
        if torch.cuda.is_initialized():
            return int(torch.cuda.current_device())
    except Exception:
        pass
    return 0


def pin_one_device(environ: Any = None) -> str | None:
    """Keep a one-process run on one GPU: outside torchrun (no ``WORLD_SIZE`` above 1), set
    ``CUDA_VISIBLE_DEVICES`` to its first entry, or to ``0`` (CUDA's first device) when unset,
    so that transformers does not wrap the model in ``nn.DataParallel`` over every GPU it sees.
    The variable is read as torch reads it (``nvml.visible_entries``): a value that shows one
    device or none is left as it is. Call before CUDA is initialised (CUDA reads the variable
    once). Returns the value set, or None when nothing changed."""
    env = os.environ if environ is None else environ
    if int(env.get("WORLD_SIZE", "1") or 1) > 1:
        return None
    entries = visible_entries(env.get("CUDA_VISIBLE_DEVICES"))   # torch's reading of it
    if entries is not None and len(entries) <= 1:
        return None
    env["CUDA_VISIBLE_DEVICES"] = entries[0] if entries else "0"
    return env["CUDA_VISIBLE_DEVICES"]


_WARNED: set[str] = set()   # keys of the warnings already given in this process

NVML_MISSING = ("nvidia-ml-py is not installed, so NVML readings are lost: the driver version, "
                "MIG detection, what nvidia-smi shows (MemoryCallback's memory/nvml_used_gib, "
                "memory/gpu_util) and calibration residuals; free memory comes from "
                "torch.cuda.mem_get_info. Fix: pip install nvidia-ml-py (or 'hf-memkit[nvml]')")
CUDA_FIX = ("check the driver with `nvidia-smi` and that torch's CUDA build matches it, or plan "
            "for the GPU by name (get_device('A100-80GB'), `hf-memkit plan ... --gpu A100-80GB`)")


def warn_once(key: str, msg: str) -> None:
    """``logger.warning(msg)`` the first time ``key`` is seen in this process, then never again."""
    if key not in _WARNED:
        _WARNED.add(key)
        logger.warning(msg)


def _cuda_available() -> bool:
    import torch

    try:
        return bool(torch.cuda.is_available())
    except Exception as exc:  # a broken driver install must not crash a probe
        warn_once("cuda_available",
                  f"torch.cuda.is_available() raised {type(exc).__name__}: {exc}; treating this "
                  f"machine as having no CUDA GPU: probe_device() describes the CPU (or MPS) and "
                  f"plans for this machine target it; {CUDA_FIX}")
        return False


def _mps_available() -> bool:
    import torch

    try:
        return bool(torch.backends.mps.is_available())
    except Exception:
        return False


def _probe_cuda(index: int, count: int) -> DeviceInfo:
    import torch

    try:
        props = torch.cuda.get_device_properties(index)
    except Exception as exc:  # a broken driver or CUDA install
        return _probe_cuda_without_torch(index, count, exc)
    cc = (int(props.major), int(props.minor))
    nvml = _nvml_query(index, str(props.name))
    if nvml is not None:
        free, total, name, source, own = nvml.free, nvml.total, nvml.name, "nvml", nvml.own
        others = nvml.others
        if own is None:   # NVML does not list this process (MIG without root, a container)
            own = _torch_own(index)
    else:
        free, total = _torch_mem_get_info(index, props)
        name, source, own, others = str(props.name), "torch.cuda", _torch_own(index), None
    spec = lookup(name)
    rocm = getattr(torch.version, "hip", None) is not None  # AMD: cc is the gfx major.minor
    return DeviceInfo(
        name=name,
        kind="cuda",
        total_memory=int(total),
        free_memory=None if free is None else int(free),
        compute_capability=cc,
        # Ampere and newer (torch.cuda.is_bf16_supported agrees); every ROCm GPU torch supports
        supports_bf16=rocm or cc >= (8, 0),
        supports_tf32=not rocm and cc >= (8, 0),  # transformers: tf32 on CUDA builds only
        supports_fp16_tensor_cores=cc >= (7, 0),
        count=count,
        index=index,
        mig=bool(nvml and nvml.mig),
        source=source,
        own_memory=own,
        others_memory=others,
        catalog_name=spec.name if spec else None,
        peak_tflops=dict(spec.tflops) if spec else {},
        memory_bandwidth=spec.memory_bandwidth if spec else None,
        interconnect=spec.interconnect if spec else None,
        interconnect_bandwidth=spec.interconnect_bandwidth if spec else None,
        driver_version=nvml.driver if nvml else None,
        cuda_memory=int(props.total_memory),  # totalGlobalMem: what CUDA hands out
        vendor="amd" if rocm else "nvidia",
    )


def _probe_cuda_without_torch(index: int, count: int, exc: Exception) -> DeviceInfo:
    """torch.cuda cannot describe the device: NVML's name and the catalog entry (its compute
    capability), else the CPU; a warning says which and what is lost."""
    nvml = _nvml_query(index, None)
    spec = lookup(nvml.name) if nvml and not nvml.mig else None
    what = f"torch.cuda.get_device_properties({index}) raised {type(exc).__name__}: {exc}"
    if spec is None:
        warn_once("cuda_props", f"{what}; describing the CPU instead (NVML and the GPU catalog "
                                f"could not identify the GPU), so estimates and plans for this "
                                f"machine are for its CPU; {CUDA_FIX}")
        return probe_cpu()
    warn_once("cuda_props", f"{what}; GPU {index} is described from NVML ({nvml.name}) and "
                            f"the catalog entry {spec.name} (compute capability "
                            f"{spec.compute_capability[0]}.{spec.compute_capability[1]}); "
                            f"training on it will likely fail as well: {CUDA_FIX}")
    return _from_spec(spec, name=nvml.name, total_memory=nvml.total, free_memory=nvml.free,
                      count=count, index=index, source="nvml", driver_version=nvml.driver,
                      own_memory=nvml.own)


def _torch_mem_get_info(index: int, props: Any) -> tuple[int | None, int]:
    import torch

    try:
        free, total = torch.cuda.mem_get_info(index)
        return int(free), int(total)
    except Exception as exc:
        logger.warning("torch.cuda.mem_get_info failed (%s); free memory unknown", exc)
        return None, int(props.total_memory)


def _torch_own(index: int) -> int:
    """What this process holds on ``index`` as torch sees it: the allocator's reserved bytes
    (the context's size is unknown to torch: the budget stays on the safe side)."""
    import torch

    try:
        return int(torch.cuda.memory_reserved(index)) if torch.cuda.is_initialized() else 0
    except Exception:
        return 0


def _nvml_query(index: int, cuda_name: str | None) -> NvmlFacts | None:
    """NVML facts for CUDA device ``index`` (``nvml.query``), or None when NVML is missing or
    cannot describe it (a warning says why)."""
    try:
        import pynvml  # nvidia-ml-py
    except ImportError:
        warn_once("nvml_missing", NVML_MISSING)
        return None
    try:
        pynvml.nvmlInit()
    except Exception as exc:
        logger.warning("NVML failed to initialise (%s); using torch.cuda for device memory", exc)
        return None
    try:
        return query(pynvml, index, cuda_name or "")
    except Exception as exc:
        logger.warning("NVML could not describe CUDA device %d (%s: %s); using torch.cuda for "
                       "its memory", index, type(exc).__name__, exc)
        return None
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


def _probe_mps() -> DeviceInfo:
    import torch

    vm = psutil.virtual_memory()
    total = vm.total
    try:  # the GPU's share of unified memory, where torch reports it (torch >= 2.3)
        total = int(torch.mps.recommended_max_memory()) or total
    except Exception:
        pass
    try:
        torch.ones(1, dtype=torch.bfloat16, device="mps")
        bf16 = True
    except Exception:  # macOS < 14 has no bf16 on MPS
        bf16 = False
    return DeviceInfo(
        name="Apple MPS", kind="mps", total_memory=int(total), free_memory=int(vm.available),
        supports_bf16=bf16, source="mps", vendor="apple",
    )


def probe_cpu() -> DeviceInfo:
    """The CPU as a training device: system RAM, and bf16 as torch's CPU autocast offers it."""
    vm = psutil.virtual_memory()
    name = _cpu_model_name() or platform.processor() or platform.machine() or "CPU"
    return DeviceInfo(
        name=name,
        kind="cpu",
        total_memory=int(vm.total),
        free_memory=int(vm.available),
        # torch's CPU autocast runs bf16 on every x86/ARM CPU (natively with AVX512-BF16/AMX,
        # emulated otherwise); TrainingArguments accepts bf16 with use_cpu=True.
        supports_bf16=True,
        count=1,
        index=None,
        source="psutil",
    )


def _cpu_model_name() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None
