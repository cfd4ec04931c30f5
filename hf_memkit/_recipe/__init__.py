"""Recipes: a training setup in a YAML file -> ``Recipe``, validated all at once.

A recipe names the model, the data, the shape of the run (seq_len, target batch, method), the
hardware it is planned for, and ``pins`` that override the planner. ``load_recipe`` reads it
with ``yaml.safe_load`` (plain data only: no ``!!python/...`` tags, no imports), checks every key
and value, and raises one ``ConfigError`` listing every problem, each as ``FILE: KEY: what is
wrong``. The planner, ``hf-memkit plan RECIPE`` and ``hf-memkit train RECIPE`` consume it.

Schema (every key but ``model``, ``training.seq_len`` and ``training.target_batch_size`` is
optional; ``Recipe.schema()`` gives the same table with defaults)::

    model: NAME                 # or the mapping below
    model:
      name: Llama-3.1-8B        # catalog name, local model directory, or a config.json path
      overrides: {num_hidden_layers: 2}   # config fields; random init unless the dir has weights
      task: causal-lm           # head; default: read from config.architectures
      tokenizer: ./tok          # local tokenizer directory (needed for data from a file)
    data: synthetic             # or a path, or the mapping below
    data:
      source: train.jsonl       # 'synthetic', or a local .txt (one example per line) / .jsonl file
      num_samples: 256          # synthetic: how many; a file: use at most this many
      text_field: text          # .jsonl: the text key
      label_field: label        # .jsonl, sequence-classification: the label key
    training:
      seq_len: 2048
      target_batch_size: 32     # effective batch = micro-batch x accumulation x GPUs, kept exact
      method: auto              # auto | full | lora | qlora
    hardware:
      device: RTX-4090          # catalog GPU (hf-memkit devices), 'cpu', or omitted = this machine
      num_gpus: 1
      max_memory: 20GiB         # explicit budget (overrides the device's)
      headroom: 0.05            # fraction kept for other tenants (default 0: headless)
    trainer: trainer            # trainer (transformers') | sft | dpo | grpo | rloo (TRL's)
    pins: {learning_rate: 2.0e-4, max_steps: 100}   # any field of the trainer's config
    callbacks: [memory, throughput]                 # and/or oom_guard (OOMGuardTrainer)
    output_dir: outputs/my-run

Relative paths in ``model``/``data`` are relative to the recipe file; ``output_dir`` is
relative to the working directory and stays inside it (an absolute one needs ``--output-dir``).

Modules: ``schema`` (``Recipe``, its key table), ``load`` (``load_recipe``, bundled recipes),
``checker`` (``Checker``: every problem as ``WHERE: KEY: message``), ``validate`` (one check per
section), ``validate_pins`` (``check_pins``: recipe pins and the command line's FIELD=VALUE,
typed and checked by ``_setup.fields``).

Why recipes explain themselves and report every problem at once: docs/style.md §7 and §9; the
public contract: docs/api.md#recipes.
"""

from __future__ import annotations

from .load import bundled_recipes, bundled_recipes_dir, load_recipe, resolve_recipe_path
from .schema import Recipe

# package-internal: hf_memkit._run.train checks command-line pins with them
from .validate import Checker as Checker
from .validate import check_pins as check_pins

__all__ = ["Recipe", "load_recipe", "bundled_recipes", "bundled_recipes_dir",
           "resolve_recipe_path"]
