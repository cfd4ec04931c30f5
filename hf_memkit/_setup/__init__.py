"""What the Trainer will do with a set of arguments: ``TrainingArguments``, a TRL config
(``SFTConfig``, ``DPOConfig``, ``GRPOConfig``, ``RLOOConfig``) or a dict of their fields ->
``TrainingSetup``, the estimator's input.

* ``fields``: the defaults, types, coercion and value ranges of any installed config class
  (recipe pins, ``FIELD=VALUE`` and dicts all go through it);
* ``coverage``: every field classified as modelled, not modelled (warned) or irrelevant;
* ``setup``: ``TrainingSetup`` and ``normalize_args``.

Why a setting that is not modelled is warned, never ignored:
docs/fitting.md#settings-that-are-not-modelled; the coverage a new trainer owes:
docs/extending.md#a-trainer. Imports the registries it reads (``_engines``, ``_optimizers``,
``_techniques``, ``_trainers``) and ``_cuda``; the estimator, the planner and the recipes
import it.
"""
