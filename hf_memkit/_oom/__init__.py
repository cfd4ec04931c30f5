"""Surviving an out-of-memory error inside the training loop. Why a Trainer mixin (a callback
cannot catch an exception; ``auto_find_batch_size`` changes the effective batch): ``guard``'s
docstring; the wording an OOM is known by: docs/stack-facts.md#oom-wording-and-batch-size-retry.

* ``guard``: ``OOMGuardMixin`` / ``OOMGuardTrainer`` (re-exported by ``hf_memkit.callbacks``):
  replay the optimizer step with smaller micro-batches, keep the effective batch;
* ``detect``: what an OOM error is (``is_oom_error``), which ones are host memory and not the
  device's (``host_memory_error``: pinned memory, which a smaller batch does not free), the
  allocator's history (Python stacks only) and snapshots;
* ``step``: splitting a micro-batch, and undoing an optimizer step that failed (``HostBackup``:
  the host copy ``oom_step_backup=True`` keeps, pinned while torch can pin it).

Imports the ground floor and transformers' ``Trainer`` only.
"""
