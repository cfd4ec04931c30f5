"""One training (or eval) step of the real model code, traced on fake tensors.

* ``step``: ``trace_step`` (with ``masked``, the only modules that touch private torch APIs:
  FakeTensorMode and MemTracker; a dispatch mode) and the fake model it runs;
* ``micro``: the micro-steps it runs (a training forward and backward, a no-grad one);
* ``quant``: QLoRA's NF4 base linears as the trace sees them;
* ``masked``: boolean-mask selections of a known size (a dispatch mode; TRL's head on CUDA).

Why private APIs stay fenced here: docs/style.md §11; what they do on a CPU build:
docs/stack-facts.md (#fake-cuda-tensors-on-a-cpu-build, #memtracker-between-iterations).
Imports ``_cuda`` (the target it emulates and the events it records) and ``_model`` (depth,
adapters); the techniques, the trainers and the estimator import it.
"""
