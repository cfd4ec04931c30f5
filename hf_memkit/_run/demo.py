"""The end-to-end slice the README's demo runs: the bundled tiny Llama recipe, trained on CPU.

``hf-memkit demo`` = ``hf-memkit train recipes/tiny-llama/1m_full_cpu.yaml``: plan, build the
model from its config, train it through ``transformers.Trainer`` with the memory callbacks.
Returns data (``TrainResult``); the CLI renders it.
"""

from __future__ import annotations

from pathlib import Path

DEMO_RECIPE = "recipes/tiny-llama/1m_full_cpu.yaml"


def run_demo(output_dir: str | Path = "demo_output", *, steps: int | None = None,
             overwrite: bool = False):
    """Train the tiny recipe; ``steps`` overrides its ``max_steps`` (40); ``overwrite``: train
    into an ``output_dir`` that is not empty (an earlier demo's). -> ``TrainResult``."""
    from .._recipe import load_recipe
    from .train import train_recipe

    return train_recipe(load_recipe(DEMO_RECIPE), output_dir=str(output_dir), max_steps=steps,
                        overwrite=overwrite)
