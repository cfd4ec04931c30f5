"""The CUDA target, modelled so that a CPU can predict it: what CUDA allocates that live tensor
bytes do not show. Why a trace must follow CUDA and not the CPU: docs/stack-facts.md
(#cpu-and-cuda-kernel-differences, #fake-cuda-tensors-on-a-cpu-build,
#cuda-module-loading-and-the-context).

* ``target``: ``CudaTarget``, what of a GPU and its CUDA changes a traced step (whether torch
  tries cuDNN attention first: the runtime cuDNN, ``TORCH_CUDNN_SDPA_DEPRIORITIZED``);
* ``autocast``, ``sdpa``, ``emulation``: CUDA's autocast policy, its SDPA kernel rules, and the
  emulation that runs both (and CUDA's fused dropout) on CPU fake tensors;
* ``collectives``: what context and sequence parallelism (torch's ring attention, DeepSpeed's
  Ulysses) allocate around each attention kernel;
* ``events``: the allocation and free events of a traced step;
* ``allocator``: PyTorch's caching allocator, replayed over those events, and its options
  (``PYTORCH_CUDA_ALLOC_CONF``) as torch parses them;
* ``runtime``: the CUDA context by version and module loading, cuBLAS workspaces
  (``CUBLAS_WORKSPACE_CONFIG``), NCCL buffers;
* ``host``: the host side (pinned blocks, the host link) that offloading uses.

Imports the ground floor only (``_errors``, ``_units``); everything that traces or estimates
imports this room, never the other way.
"""
