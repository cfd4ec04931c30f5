"""``hf-memkit plan --write-config DIR``: the files a plan is launched with, written where the
printed launch lines say: ``plan.json``, ``accelerate_config.yaml``, ``ds_config.json`` (under
DeepSpeed) and a ``train.py`` that loads the plan and applies it."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from .._errors import HfMemkitError

PLAN_FILE, ACCELERATE_FILE, SCRIPT_FILE = "plan.json", "accelerate_config.yaml", "train.py"

_SCRIPT = '''"""Train {model} as hf-memkit planned it (plan.json, beside this file).

Launch it with:
    {launch}

The model, its preparation (adapters, k-bit, attention, checkpointing) and the training
arguments come from the plan; the dataset is yours: fill in the TODO below.
"""

from pathlib import Path

{imports}

import hf_memkit as mk

HERE = Path(__file__).resolve().parent
plan = mk.Plan.from_json((HERE / "{plan_file}").read_text())

# the arguments first: under DeepSpeed ZeRO-3 they make from_pretrained load the model sharded
args = plan.to_training_args(output_dir="out")  # add your own fields here (learning_rate, ...)
# the model you planned for: its Hub id, or a local directory with its weights
model = transformers.{auto_class}.from_pretrained({model_json}, **plan.model_kwargs)
model = plan.prepare(model)

train_dataset = None  # TODO: your tokenized dataset (rows of input_ids, and labels)
if train_dataset is None:
    raise SystemExit("train.py: set train_dataset to your tokenized dataset first")

trainer = {trainer_module}.{trainer_class}(
    model=model, args=args, train_dataset=train_dataset, callbacks=[mk.MemoryCallback(plan)])
trainer.train()
'''


def _trainer_class(plan: Any) -> tuple[str, str]:
    """The module and class of the trainer the plan is for (``trl``, ``SFTTrainer``)."""
    config = plan.estimate.setup.trainer_kind.config_class if plan.estimate is not None else \
        "transformers.TrainingArguments"
    module, name = config.rsplit(".", 1)
    return module, "Trainer" if name == "TrainingArguments" else name.replace("Config", "Trainer")


def _auto_class(task: str | None) -> str:
    from .._model.tasks import TASKS

    return TASKS.get(task).auto_class if task else "AutoModelForCausalLM"


def _hub_id(ref: Any) -> str:
    """What ``from_pretrained`` loads for the plan's model: a bundled name's Hub id."""
    from .._model.names import HUB_IDS, canonical_name

    if not isinstance(ref, str):
        return "path/to/your/model"
    name = canonical_name(ref)
    return next((k for k, v in HUB_IDS.items() if v == name and "/" in k), ref) if name else ref


def _accelerate_yaml(plan: Any, ds_file: Path | None) -> str:
    """The plan's accelerate config, its DeepSpeed config file named as the launch line names
    it (accelerate reads the path from the directory it is launched in)."""
    import yaml

    cfg = yaml.safe_load(plan.accelerate_config())
    if ds_file is not None and isinstance(cfg.get("deepspeed_config"), dict):
        cfg["deepspeed_config"]["deepspeed_config_file"] = str(ds_file)
    return yaml.safe_dump(cfg, sort_keys=False)


def add_write_options(p: Any) -> None:
    """``--write-config DIR`` and ``--overwrite`` on ``hf-memkit plan``'s parser.

    Args:
        p (`argparse.ArgumentParser`): The parser.
    """
    p.add_argument("--write-config", default=None, metavar="DIR",
                   help="write the files the plan is launched with into DIR: plan.json, "
                        "accelerate_config.yaml, ds_config.json (DeepSpeed) and a train.py that "
                        "applies the plan; the printed launch line names them")
    p.add_argument("--overwrite", action="store_true",
                   help="with --write-config: replace those files where DIR already has them")


def check_folder(folder: str, *, overwrite: bool) -> None:
    """Refuse, before planning, a ``folder`` that is a file or already holds a file of the
    names ``write_config`` writes (unless ``overwrite``).

    Args:
        folder (`str`): The directory ``--write-config`` names.
        overwrite (`bool`): Whether ``--overwrite`` was given.

    Raises:
        HfMemkitError: As ``write_config`` would, after the search.
    """
    root = Path(folder)
    if root.exists() and not root.is_dir():
        raise HfMemkitError(f"--write-config {folder}: is a file, not a directory; name a "
                            "directory (it is created when missing)")
    there = [str(root / n) for n in (PLAN_FILE, ACCELERATE_FILE, SCRIPT_FILE, "ds_config.json")
             if os.path.lexists(root / n)]
    if there and not overwrite:
        raise HfMemkitError(f"--write-config {folder}: would replace {', '.join(there)}; add "
                            "--overwrite, or name another directory")


def write_config(plan: Any, folder: str, *, task: str | None = None,
                 overwrite: bool = False) -> dict[str, str]:
    """Write the files ``plan`` is launched with into ``folder``.

    Args:
        plan (`Plan`): The plan.
        folder (`str`): The directory (created when missing).
        task (`str`, *optional*): The model's head, as ``--task`` names it (default: causal LM).
        overwrite (`bool`, *optional*, defaults to `False`): Replace files of the same names.

    Returns:
        `dict[str, str]`: each written file's role (``plan``, ``accelerate_config``,
        ``deepspeed_config``, ``script``) -> its path, and ``launch`` -> the command line.

    Raises:
        HfMemkitError: ``folder`` is a file, or holds one of the files and ``overwrite`` is off.
    """
    from .._engines import ENGINES

    check_folder(folder, overwrite=overwrite)
    root = Path(folder)

    engine = ENGINES.get(plan.parallel.get("engine", "none"))
    ds = engine.config_of(plan.training_args_kwargs) is not None
    names = {"plan": PLAN_FILE, "accelerate_config": ACCELERATE_FILE, "script": SCRIPT_FILE,
             **({"deepspeed_config": engine.config_file} if ds else {})}
    paths = {k: root / v for k, v in names.items()}
    root.mkdir(parents=True, exist_ok=True)
    launch = " ".join(x for x in (*(f"{k}={v}" for k, v in plan.env.items()),
                                  f"accelerate launch --config_file {paths['accelerate_config']}",
                                  str(paths["script"])) if x)
    if ds:
        plan.write_deepspeed_config(paths["deepspeed_config"])
    paths["plan"].write_text(plan.to_json(full=False, indent=2))
    paths["accelerate_config"].write_text(_accelerate_yaml(plan, paths.get("deepspeed_config")))
    module, cls = _trainer_class(plan)
    imports = "import transformers" if module == "transformers" else \
        f"import transformers\nimport {module}"
    paths["script"].write_text(_SCRIPT.format(
        model=_hub_id(plan.model_name), model_json=json.dumps(_hub_id(plan.model_name)),
        launch=launch, plan_file=PLAN_FILE, imports=imports,
        trainer_module=module, trainer_class=cls, auto_class=_auto_class(task)))
    return {**{k: str(p) for k, p in paths.items()}, "launch": launch}
