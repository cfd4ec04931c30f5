"""``hf-memkit train`` (and ``hf-memkit demo``, which trains a bundled recipe): a recipe planned,
built and trained for real.

* ``train``: ``Recipe`` -> ``Plan`` -> model -> the trainer its registry entry builds
  (``TrainerKind.build``) + callbacks -> ``TrainResult``;
* ``data``: the recipe's rows (synthetic, text or JSONL) and its tokenizer;
* ``writes``: where a run may write (its output directory; the Hub and reporting services only
  when the command line says so), checked before the plan;
* ``stop``: a run stopped by Ctrl-C, SIGTERM or an error keeps what exists;
* ``synthetic``: synthetic data and tiny models (the demo, tests and benchmarks train on them).

The top of the product: it may import every room below it (recipes, plans, callbacks, the OOM
guard); only the CLI and ``hf_memkit.testing`` import it. Why a run pins one GPU per process:
docs/stack-facts.md#one-process-with-several-gpus; why its data is local or synthetic:
docs/stack-facts.md#offline-models-and-data.
"""
