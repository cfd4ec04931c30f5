"""The CUDA target a trace emulates: what of the GPU and its CUDA changes what a step allocates
(``emulation`` traces it; ``sdpa`` picks its attention kernels).

Whether torch tries cuDNN attention first (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp
``check_prefer_cudnn_attention``, torch 2.10 to 2.13): unless ``TORCH_CUDNN_SDPA_DEPRIORITIZED=1``,
when the *runtime* cuDNN (``torch.backends.cudnn.version()``) is newer than 9.15.0 ("cuDNN 9.15.1
required for seq_len not divisible by 128 fix, CUDA <= 12.9 wheels ship with older cuDNN",
pytorch/pytorch#169849) on an sm 9.x / 10.x GPU (a torch built for CUDA < 13: sm90, sm100,
sm103 only). Earlier releases differ: 2.5.0 put cuDNN first on H100 and 2.5.1 took it back
(pytorch/pytorch#138522); 2.9 preferred it on sm90/sm100 from the cuDNN it was built with.
The runtime cuDNN is read where the target is this machine's GPU and this torch's CUDA
(``this_torch_cudnn``); for any other target it is assumed from the CUDA version: torch's
CUDA 13 wheels ship a cuDNN past 9.15 (the bundled cuDNN crossed the threshold with torch 2.11),
its CUDA 12 wheels an older one.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass

PREFER_CUDNN_ABOVE = 91500  # cudnn_version > 91500: cuDNN 9.15.1 and later
DEPRIORITIZED = "TORCH_CUDNN_SDPA_DEPRIORITIZED"


@dataclass(frozen=True)
class CudaTarget:
    """What of a CUDA target changes the trace: its compute capability (SDPA kernel rules) and
    whether torch tries cuDNN attention first there (module docstring)."""

    compute_capability: tuple[int, int] = (8, 0)
    prefers_cudnn: bool = False

    @classmethod
    def of(cls, compute_capability: tuple[int, int] | None, cuda_version: str | None,
           cudnn_version: int | None = None, env: Mapping[str, str] | None = None) -> CudaTarget:
        """The target of a GPU of ``compute_capability`` under ``cuda_version``, with the runtime
        ``cudnn_version`` (``torch.backends.cudnn.version()``, e.g. 91600) when it is known."""
        return cls.resolve(compute_capability, cuda_version, cudnn_version, env)[0]

    @classmethod
    def resolve(cls, compute_capability: tuple[int, int] | None, cuda_version: str | None,
                cudnn_version: int | None = None,
                env: Mapping[str, str] | None = None) -> tuple[CudaTarget, str]:
        """``of`` and the sentence that says why cuDNN attention is or is not tried first."""
        cc = tuple(compute_capability) if compute_capability else (8, 0)
        major = _major(cuda_version)
        arch = cc[0] in (9, 10) and (major is not None and major >= 13 or cc[1] in (0, 3))
        if _deprioritized(os.environ if env is None else env):
            target = cls(cc, False)  # type: ignore[arg-type]
            return target, f"{DEPRIORITIZED}=1: torch tries cuDNN attention after flash and " \
                           "memory-efficient"
        if cudnn_version is not None:
            new = cudnn_version > PREFER_CUDNN_ABOVE
            basis = f"runtime cuDNN {_dotted(cudnn_version)} of this machine's torch"
        else:
            new = major is not None and major >= 13
            basis = (f"cuDNN assumed from CUDA {cuda_version}, whose torch wheels ship one "
                     + ("past 9.15" if new else "before 9.15.1"))
        target = cls(cc, new and arch)  # type: ignore[arg-type]
        why = "cuDNN attention first" if target.prefers_cudnn else "flash / memory-efficient first"
        return target, f"{why}: {basis}"


def this_torch_cudnn(cuda_version: str) -> int | None:
    """``torch.backends.cudnn.version()`` when this torch is built for ``cuda_version`` and has a
    cuDNN, else None (another CUDA is a different install, whose cuDNN this process cannot see)."""
    import torch

    if not torch.version.cuda or _mm(torch.version.cuda) != _mm(cuda_version):
        return None
    try:
        if not torch.backends.cudnn.is_available():
            return None
        version = torch.backends.cudnn.version()
    except (RuntimeError, OSError):  # a cuDNN that does not load
        return None
    return int(version) if version else None


def _deprioritized(env: Mapping[str, str]) -> bool:
    """c10::utils::check_env: "1" true, "0" false, anything else ignored with a warning."""
    value = env.get(DEPRIORITIZED)
    if value is not None and value not in ("0", "1"):
        warnings.warn(f"{DEPRIORITIZED}={value!r}: torch reads only 0 or 1 and ignores this "
                      "value (with a warning), so cuDNN attention keeps its default priority; "
                      f"set {DEPRIORITIZED}=1 to try it after flash and memory-efficient",
                      UserWarning, stacklevel=4)
    return value == "1"


def _dotted(version: int) -> str:
    """91600 -> "9.16.0" (cuDNN 9: major * 10000 + minor * 100 + patch)."""
    return f"{version // 10000}.{version // 100 % 100}.{version % 100}"


def _mm(version: str | None) -> tuple[str, ...]:
    return tuple(str(version).strip().split(".")[:2])


def _major(version: str | None) -> int | None:
    try:
        return int(str(version).split(".")[0])
    except (TypeError, ValueError):
        return None
