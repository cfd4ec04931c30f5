"""TRL's online RL trainers, ``GRPOTrainer`` and ``RLOOTrainer``, in one folder (as a large
method is one folder in peft): a step of phases and, optionally, a vLLM engine beside it.

* ``entry``: the registered ``GRPO`` and ``RLOO`` entries, their config fields and the hooks the
  estimator and the planner call for every trainer (``TrainerKind.rollout``, ``tenant``,
  ``plan_around``);
* ``steps``: the traced steps (``ScoreStep``: the train step and the no-grad scoring;
  ``GenerateStep``: the policy's ``generate`` at its two peaks);
* ``rollout``: the generation and scoring phases on top of what the step holds;
* ``vllm``: a colocated vLLM engine's GPU memory from vLLM's own start-up rules;
* ``colocate``: that engine beside the trainer, in the estimate and in the plan.

Nothing outside this folder names it: ``_estimate`` and ``_plan`` reach it through the hooks.
"""

from . import entry  # noqa: F401  (registers GRPO and RLOO)
from .entry import even_ids
from .steps import grow_cache

__all__ = ["even_ids", "grow_cache"]
