"""Measuring a GPU for its calibration (CUDA only; run in a fresh process: ``hf-memkit calibrate``
starts one): the CUDA context and cuBLAS workspaces from NVML, and the reference step's
allocated and reserved bytes, into a ``calibration.Calibration``."""

from __future__ import annotations

import logging
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from .._errors import HfMemkitError
from .._units import GiB
from .calibration import Calibration

if TYPE_CHECKING:  # torch is imported where a measurement runs: `calibrate --help` needs none
    import torch

logger = logging.getLogger(__name__)

# The reference model: Llama-3.2-1B's widths (hidden 2048, GQA 32/8 heads, MLP 8192, tied head)
# with 2 layers and a 32000 vocabulary, fp32 weights, random init: 187M parameters, about 4.6 GiB
# for a step of batch 4 x 512 tokens with AdamW (GEMMs large enough to use the large pool and the
# tensor-core kernels a real fine-tune loads).
REFERENCE_MODEL = "Llama-3.2-1B"
REFERENCE_OVERRIDES = {"num_hidden_layers": 2, "vocab_size": 32000, "bos_token_id": 1,
                       "eos_token_id": 2, "dtype": "float32"}
REFERENCE_BATCH, REFERENCE_SEQ_LEN, REFERENCE_STEPS = 4, 512, 3
REFERENCE_MIN_FREE = 6 * GiB


def reference_config():
    """The reference model's config (see ``REFERENCE_MODEL``): random weights, no download."""
    from .._model.catalog import load_bundled_config

    base = load_bundled_config(REFERENCE_MODEL)
    d = base.to_dict()
    d.pop("torch_dtype", None)
    d.update(REFERENCE_OVERRIDES)
    return type(base).from_dict(d)


def _warn_other_processes(pynvml: Any, handle: Any) -> None:
    """Other tenants of the GPU do not enter the measurement (this process's own NVML entry, or
    used less what was used before its context), but they change what a run may use: say so."""
    from .nvml import processes, split_processes

    _own, others = split_processes(processes(pynvml, handle))
    if others:
        logger.warning("other processes hold %s on this GPU: they are not counted in the "
                       "calibration, but a run here has that much less to use",
                       f"{others / GiB:.2f} GiB")


def _open_context(device: torch.device) -> None:
    """Create the CUDA context: one tiny tensor, made and freed, and the cache emptied."""
    import torch

    torch.zeros(1, device=device)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()


def _growth(device: torch.device, fn) -> int:
    """Allocator bytes still held after ``fn`` returns (everything it made is freed by then)."""
    import torch

    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    fn()
    torch.cuda.synchronize(device)
    return int(torch.cuda.memory_allocated(device) - before)


def _workspaces(device: torch.device, dtypes: list[torch.dtype]) -> tuple[int, int]:
    """(forward thread, autograd thread) cuBLAS/cuBLASLt workspace bytes. torch keeps one
    workspace per (cuBLAS handle, stream) and handles are per thread, so the first matmul of the
    main thread and the first backward matmul (autograd's device thread) each allocate one
    (aten/src/ATen/cuda/CublasHandlePool.cpp). mm and addmm (the cuBLASLt path) in each dtype."""
    import torch

    def make(dt, grad=False):
        kw = dict(device=device, dtype=dt, requires_grad=grad)
        return (torch.full((256, 512), 0.01, **kw), torch.full((512, 512), 0.01, **kw),
                torch.full((512,), 0.01, **kw))

    def forward():
        for dt in dtypes:
            a, w, b = make(dt)
            torch.mm(a, w)
            torch.nn.functional.linear(a, w, b)

    def backward():
        for dt in dtypes:
            a, w, b = make(dt, grad=True)
            torch.nn.functional.linear(a, w, b).float().sum().backward()

    return _growth(device, forward), _growth(device, backward)


def _reference_step(device: torch.device, bf16: bool) -> tuple[int, int]:
    """(max allocated, max reserved) of steps 2..3 of the reference model with torch AdamW."""
    import torch

    from .._model.profile import model_from_config

    config = reference_config()
    model = model_from_config(config, "causal-lm", device=device, dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, config.vocab_size, (REFERENCE_BATCH, REFERENCE_SEQ_LEN), device=device)
    for step in range(REFERENCE_STEPS):
        if step == 1:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        del loss
    torch.cuda.synchronize(device)
    return (int(torch.cuda.max_memory_allocated(device)),
            int(torch.cuda.max_memory_reserved(device)))


def _check_fresh(index: int) -> None:
    import torch

    if not torch.cuda.is_available():
        raise HfMemkitError("calibration needs a CUDA GPU, and torch sees none here; plans and "
                            "estimates for a catalog GPU (--gpu A100-80GB) work without one")
    if torch.cuda.is_initialized() and torch.cuda.memory_reserved(index) > 0:
        raise HfMemkitError("measure_calibration must run in a fresh process, before any CUDA "
                            "tensor exists (`hf-memkit calibrate` starts one)")


def start_nvml(pynvml: Any) -> None:
    """``nvmlInit``, or an ``HfMemkitError`` naming why NVML cannot start (the driver's
    ``libnvidia-ml.so.1`` not found: ``NVMLError_LibraryNotFound``) instead of NVML's own.

    Args:
        pynvml: the ``pynvml`` module.

    Raises:
        HfMemkitError: NVML did not start; the message says why and what to check.
    """
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        raise HfMemkitError(f"NVML did not start ({type(exc).__name__}: {exc}): the NVIDIA "
                            "driver's libnvidia-ml.so.1 is missing or failed to load (in a "
                            "container, start it with the NVIDIA runtime, e.g. `--gpus`); "
                            "calibration measures the CUDA context through NVML. Check the "
                            "driver with `nvidia-smi`, or skip calibration (estimates use the "
                            "uncalibrated band)") from None


def measure_calibration(index: int = 0) -> Calibration:
    """Measure CUDA device ``index`` (CUDA only; call it in a fresh process).

    1. NVML before CUDA init, through the device's own handle (a MIG instance's on MIG):
       free memory (6 GiB needed), other processes (warned; not counted), and ``used``, the
       baseline (the driver's reservation and the other tenants). Then ``torch.cuda.init()``,
       one tiny tensor made and freed, ``empty_cache``: ``context_at_init`` = what this process
       holds (``nvml.own_used``: its NVML process entry, else used - baseline) - reserved.
    2. ``cublas_workspace``: allocator growth across the first mm/addmm (forward) and the first
       backward, with every tensor freed (``_workspaces``). If CUDA had already run matmuls the
       growth is 0 and torch's documented default (``_cuda.cublas_workspace``) is used instead.
    3. 3 steps of the reference model (bf16 autocast where supported, else fp32; torch AdamW),
       peaks of steps 2..3: ``reserved_over_allocated``; then, after ``synchronize``,
       ``context`` = what this process holds - ``memory_reserved``.

    NVML refusing to start (no driver library) or to read the device (``NVMLError``) is an
    ``HfMemkitError`` naming the cause.
    """
    import torch

    from .._compat import require
    from .._cuda.runtime import cublas_workspace
    from .nvml import nvml_handle, own_used
    from .probe import probe_device

    _check_fresh(index)
    pynvml = require("pynvml", "calibration (NVML readings of the CUDA context)")
    start_nvml(pynvml)
    try:
        handle = nvml_handle(pynvml, index)   # a MIG instance's own handle: no root needed
        _warn_other_processes(pynvml, handle)
        mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
        free, baseline = int(mem.free), int(mem.used)
        if free < REFERENCE_MIN_FREE:
            raise HfMemkitError(f"calibration's reference step needs {REFERENCE_MIN_FREE // GiB} "
                                f"GiB free on GPU {index}; {free / GiB:.2f} GiB are free")
        dev = probe_device(index)
        device = torch.device("cuda", index)
        torch.cuda.init()
        torch.cuda.set_device(device)
        _open_context(device)
        held = own_used(pynvml, handle, baseline)
        context_at_init = held - int(torch.cuda.memory_reserved(device))
        dtypes = [torch.float32] + ([torch.bfloat16] if dev.supports_bf16 else [torch.float16])
        fwd, bwd = _workspaces(device, dtypes)
        workspace = fwd + max(0, bwd)  # bwd 0: the autograd thread shares the workspace
        if fwd <= 0:
            logger.warning("cuBLAS workspaces were already allocated (CUDA ran matmuls before "
                           "calibration); using torch's documented default instead")
            workspace = cublas_workspace(dev.compute_capability)
        peak_alloc, peak_reserved = _reference_step(device, dev.supports_bf16)
        torch.cuda.synchronize(device)
        context = own_used(pynvml, handle, baseline) - int(torch.cuda.memory_reserved(device))
    except pynvml.NVMLError as exc:
        raise HfMemkitError(f"NVML cannot read CUDA device {index}'s memory "
                            f"({type(exc).__name__}: {exc}); calibration measures the CUDA "
                            "context through NVML. On a MIG slice it reads the slice's own "
                            "handle; if this persists, run as a user NVML permits or skip "
                            "calibration (estimates use the uncalibrated band)") from None
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass
    return Calibration(
        gpu=dev.name, driver=dev.driver_version, torch=torch.__version__, cuda=torch.version.cuda,
        context=max(0, context), context_at_init=max(0, context_at_init),
        cublas_workspace=max(0, workspace),
        reserved_over_allocated=peak_reserved / peak_alloc if peak_alloc else 1.0,
        created=datetime.now(timezone.utc).isoformat(timespec="seconds"))
