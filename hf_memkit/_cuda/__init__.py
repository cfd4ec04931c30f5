"""The CUDA target, modelled so that a CPU can predict it: what CUDA allocates that live tensor
bytes do not show.

* ``target``: ``CudaTarget``, what of a GPU and its CUDA changes a traced step;
* ``autocast``, ``sdpa``, ``emulation``: CUDA's autocast policy, its SDPA kernel rules, and the
  emulation that runs both (and CUDA's fused dropout) on CPU fake tensors;
* ``events``: the allocation and free events of a traced step;
* ``allocator``: PyTorch's caching allocator, replayed over those events;
* ``runtime``: the CUDA context by version and module loading, cuBLAS workspaces, NCCL buffers;
* ``host``: the host side (pinned blocks, the host link) that offloading uses.

Imports the ground floor only (``_errors``, ``_units``); everything that traces or estimates
imports this room, never the other way.
"""
