"""Measurement harnesses used by the tests and benchmarks, not the product API (docs/style.md
§15). How the ground truth is measured, and why so: docs/stack-facts.md#cpu-ground-truth and
#distributed-training-on-cpu.

* :mod:`.groundtruth`: the independent CPU ground truth, a real ``transformers.Trainer`` run's
  peak tensor memory measured in a child process (``measure_trainer_peak``);
* :mod:`.groundtruth_trl`: TRL's ``SFTTrainer`` / ``DPOTrainer`` for that ground truth;
* :mod:`.groundtruth_dist`: the same per rank for 2-process DDP / FSDP2 / DeepSpeed runs on CPU
  under torchrun (``measure_distributed_peak``; ranks run :mod:`._dist_worker`, tensor and
  sequence parallelism :mod:`._parallel_worker`, both counting with :mod:`._rank_tools`);
* :mod:`.models`: the model and synthetic examples a spec describes (``spec_model``,
  ``synthetic_examples``), shared by the harnesses;
* :mod:`.simulate`: a simulated device-memory budget on CPU (``SimulatedMemoryBudget``).

Nothing is imported here: import the submodule you need (``simulate`` imports torch).
"""
