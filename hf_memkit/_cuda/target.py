"""The CUDA target a trace emulates: what of the GPU and its CUDA changes what a step allocates
(``emulation`` traces it; ``sdpa`` picks its attention kernels)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CudaTarget:
    """What of a CUDA target changes the trace: its compute capability (SDPA kernel rules) and
    whether torch prefers cuDNN attention there (sdp_utils.cpp ``check_prefer_cudnn_attention``:
    sm90 / sm100 / sm103 with cuDNN > 9.15, which torch wheels ship from CUDA 13 on; "CUDA <= 12.9
    wheels ship with older cuDNN")."""

    compute_capability: tuple[int, int] = (8, 0)
    prefers_cudnn: bool = False

    @classmethod
    def of(cls, compute_capability: tuple[int, int] | None,
           cuda_version: str | None) -> CudaTarget:
        cc = tuple(compute_capability) if compute_capability else (8, 0)
        major = _major(cuda_version)
        prefers = major is not None and major >= 13 and cc in ((9, 0), (10, 0), (10, 3))
        return cls(cc, prefers)  # type: ignore[arg-type]


def _major(version: str | None) -> int | None:
    try:
        return int(str(version).split(".")[0])
    except (TypeError, ValueError):
        return None
