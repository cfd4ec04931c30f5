"""One training (or eval) step of the real model code, traced on fake tensors.

* ``step``: ``trace_step`` (the only module that touches private torch APIs: FakeTensorMode and
  MemTracker) and the fake model it runs;
* ``quant``: QLoRA's NF4 base linears as the trace sees them.

Imports ``_cuda`` (the target it emulates and the events it records) and ``_model`` (depth,
adapters); the techniques, the trainers and the estimator import it.
"""
