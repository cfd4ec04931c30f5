"""Surviving an out-of-memory error inside the training loop.

* ``guard``: ``OOMGuardMixin`` / ``OOMGuardTrainer`` (re-exported by ``hf_memkit.callbacks``):
  replay the optimizer step with smaller micro-batches, keep the effective batch;
* ``detect``: what an OOM error is (``is_oom_error``), the allocator's history and snapshots;
* ``step``: splitting a micro-batch, and undoing an optimizer step that failed (``HostBackup``:
  the host copy ``oom_step_backup=True`` keeps, pinned while torch can pin it).

Imports the ground floor and transformers' ``Trainer`` only.
"""
