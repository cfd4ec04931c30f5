"""Trainers whose step hf_memkit models, one registered ``TrainerKind`` per file (``base``):
``transformers.Trainer``, TRL's ``SFTTrainer``, ``DPOTrainer``, ``GRPOTrainer`` and
``RLOOTrainer`` (the folder ``rl/``: a step of phases, optionally a vLLM beside it),
``KTOTrainer``, ``RewardTrainer`` and ``DistillationTrainer`` (on-policy: ``rl/``'s generation,
then a teacher's forward in each micro-step). ``detect`` names the trainer of a config (and refuses TRL trainers not modelled); the
other modules are what TRL's trainers do to a step (``fused_head``, ``packing``, ``offload``)
and the data ``hf-memkit train`` gives them (``data``).

What a new trainer touches, and the hooks the estimator and the planner call on every trainer:
docs/extending.md#a-trainer; TRL's behaviour that the entries follow: docs/stack-facts.md
(#trl-sfttrainer-and-dpotrainer, #trl-grpotrainer, #trl-with-colocated-vllm).
"""

# isort: off
from . import trainer, sft, dpo, rl, kto, reward, distillation  # noqa: F401  (registers, in this order)
# isort: on
from .base import (
    TRAINER_KEY,
    TRAINERS,
    BatchShape,
    RolloutPhase,
    Tenant,
    TraceStep,
    TrainerKind,
    TrlTrainerKind,
    Unmodelled,
    register,
)
from .detect import trainer_of_args
from .trainer import TRAINER

__all__ = ["TRAINER", "TRAINERS", "TRAINER_KEY", "BatchShape", "RolloutPhase", "Tenant", "TraceStep",
           "TrainerKind", "TrlTrainerKind", "Unmodelled", "register", "trainer_of_args"]
