"""``hf-memkit train RECIPE``: plan, build, prepare and train a recipe through the trainer it names.

Data flow: ``Recipe`` -> ``plan_training`` -> ``Plan`` -> model (from the config, random init
unless the model directory holds weights; QLoRA goes through ``save_pretrained`` /
``from_pretrained(quantization_config=...)`` because ``from_config`` rejects quantization) ->
``Plan.prepare`` -> dataset (``data``: synthetic, or a local text / JSON-lines file and a local
tokenizer) -> the trainer the recipe's ``trainer:`` entry builds (``TrainerKind.build``:
``Trainer`` or ``OOMGuardTrainer``, TRL's ``SFTTrainer`` / ``DPOTrainer``) with
``MemoryCallback`` fed the plan's prediction and ``ThroughputCallback`` -> ``TrainResult`` (data;
the CLI renders it).

Bad input raises ``ConfigError`` (exit 2); an exception while the model trains raises
``TrainingFailed`` (exit 1).
"""

from __future__ import annotations

import os
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

from .._compat import no_progress_bars
from .._errors import ConfigError, HfMemkitError, TrainingFailed  # noqa: F401  (re-exported)
from .._recipe import Recipe
from .._trainers import TRAINERS
from . import writes
from .data import build_dataset, load_tokenizer
from .stop import (  # noqa: F401  (TrainingInterrupted: re-exported)
    TrainingInterrupted,
    failure_message,
    train_keeping_what_exists,
    write_error,
)


@dataclass
class TrainResult:
    """What a recipe run did: numbers in bytes and seconds, paths of what it wrote."""

    recipe: str
    plan: Any = field(repr=False)
    steps: int
    first_loss: float | None
    last_loss: float | None
    seconds: float
    predicted_peak: int | None          # the plan's MemoryEstimate.peak_allocated
    measured_peak: int | None           # MemoryCallback's largest peak_allocated
    device: str                         # what trained: cpu / cuda / mps
    output_dir: str
    model_dir: str | None
    memory_report: str | None
    memory_plot: str | None
    timeline: list[dict[str, Any]] = field(default_factory=list, repr=False)
    samples_per_second: float | None = None
    oom_recoveries: int = 0

    def to_dict(self) -> dict[str, Any]:
        c = self.plan.chosen
        return {
            "recipe": self.recipe, "steps": self.steps, "first_loss": self.first_loss,
            "last_loss": self.last_loss, "seconds": self.seconds, "device": self.device,
            "plan": {"setup": c.label(), "attention": c.attn,
                     "device_used": c.device_used, "budget": self.plan.budget,
                     "planned_for": self.plan.device.name,
                     "training_args": self.plan.training_args_kwargs},
            "predicted_peak_allocated": self.predicted_peak,
            "measured_peak_allocated": self.measured_peak,
            "measured_over_predicted": (self.measured_peak / self.predicted_peak
                                        if self.measured_peak and self.predicted_peak else None),
            "samples_per_second": self.samples_per_second,
            "oom_recoveries": self.oom_recoveries,
            "output_dir": self.output_dir, "model_dir": self.model_dir,
            "memory_report": self.memory_report, "memory_plot": self.memory_plot,
            "units": "bytes, seconds",
        }


# ----------------------------------------------------------------------------------------------
# checks that only matter when this machine trains
# ----------------------------------------------------------------------------------------------


def check_trainable_here(recipe: Recipe, *, device: str | None = None) -> None:
    """Raise ``ConfigError`` (naming the file and key) when this machine cannot train the recipe."""
    where = recipe.source or "recipe"
    device = device if device is not None else recipe.device
    problems = []
    cuda = torch.cuda.is_available()
    if device not in (None, "cpu") and not cuda:
        problems.append(
            f"{where}: hardware.device: the recipe is planned for {device} but this machine has "
            "no CUDA GPU; `hf-memkit plan` works anywhere, `train` needs the GPU (or set "
            "device: cpu for a model small enough to train on a CPU)")
    if recipe.num_gpus > 1:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world != recipe.num_gpus:
            problems.append(
                f"{where}: hardware.num_gpus: {recipe.num_gpus} GPUs need one process per GPU: "
                f"torchrun --nproc_per_node {recipe.num_gpus} -m hf_memkit.commands.main train "
                f"{where} (this process runs {world})")
    from .._model.tasks import TASKS, normalize_task

    try:
        task = normalize_task(recipe.task, recipe.model_config())
    except HfMemkitError as exc:
        problems.append(f"{where}: model: {exc}")
        task = None
    trainable = [t.name for t in TASKS if t.trainable_by_cli]
    if task is not None and task not in trainable:
        problems.append(
            f"{where}: model.task: `hf-memkit train` trains {', '.join(trainable)}; this "
            f"model's task is {task} (set model.task, or plan it with `hf-memkit plan`)")
    if problems:
        raise ConfigError(problems, source=where)


def check_trainer_runs(recipe: Recipe, task: str | None = None) -> None:
    """``ConfigError`` naming the file and key when ``hf-memkit train`` cannot run the recipe's
    trainer (``TrainerKind.run_problems``: TRL's need a causal LM and no ``oom_guard``; DPO's
    preference pairs are made for synthetic data only)."""
    where = recipe.source or "recipe"
    problems = TRAINERS.get(recipe.trainer).run_problems(
        where=where, synthetic=recipe.is_synthetic, task=task, callbacks=tuple(recipe.callbacks))
    if problems:
        raise ConfigError(problems, source=where)


# ----------------------------------------------------------------------------------------------
# the model
# ----------------------------------------------------------------------------------------------


def recipe_model(recipe: Recipe, plan: Any, task: str) -> torch.nn.Module:
    """The model the plan describes: weights from the model directory when it has them, else
    random init from the config. A quantized base (QLoRA, 8-bit LoRA) is saved and reloaded
    with ``quantization_config`` (``from_config`` rejects it)."""
    kwargs = dict(plan.model_kwargs)
    quant = kwargs.pop("quantization_config", None)
    kwargs["dtype"] = kwargs.get("dtype") or torch.float32
    kwargs["trust_remote_code"] = False  # never run a model directory's own code (auto_map)
    from .._model.profile import load_quantized
    from .._model.tasks import auto_class

    auto = auto_class(task)
    load_kw: dict[str, Any] = {}
    if quant is not None and torch.cuda.is_available():
        load_kw["device_map"] = {"": torch.cuda.current_device()}
    if recipe.has_weights():
        extra = {"config": recipe.model_config()} if recipe.model_overrides else {}
        return auto.from_pretrained(recipe.model, quantization_config=quant, **kwargs, **extra,
                                    **load_kw)
    config = recipe.model_config()
    if quant is None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return auto.from_config(config, **kwargs)
    with tempfile.TemporaryDirectory(prefix="hf_memkit_init_") as tmp:
        model = load_quantized(auto, config, quant, tmp, load_kwargs=load_kw, **kwargs)
    # not the deleted temporary directory: a local model directory (the adapter config records
    # it), else nothing, as from_config leaves it; a bundled config's name is no Hub repo, and
    # peft would look it up on the Hub when it saves the adapters
    local = os.path.isfile(os.path.join(str(recipe.model), "config.json"))
    model.name_or_path = model.config._name_or_path = str(recipe.model) if local else ""
    return model


# ----------------------------------------------------------------------------------------------
# progress
# ----------------------------------------------------------------------------------------------


def _progress_callback(console: Any):
    """A rich progress bar (steps, loss) on ``console``; replaces the Trainer's tqdm/printer."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )
    from transformers import TrainerCallback

    class RichProgress(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            if not state.is_world_process_zero:
                return
            console.print(f"training {state.max_steps} steps; Ctrl-C (or SIGTERM) stops early "
                          f"and keeps the model and memory report in {args.output_dir}",
                          soft_wrap=True)
            self.progress = Progress(TextColumn("[bold]training"), BarColumn(),
                                     MofNCompleteColumn(), TextColumn("{task.fields[loss]}"),
                                     TimeElapsedColumn(), TimeRemainingColumn(),
                                     console=console, transient=False)
            self.task = self.progress.add_task("train", total=state.max_steps, loss="")
            self.progress.start()

        def on_step_end(self, args, state, control, **kwargs):
            if hasattr(self, "task"):
                self.progress.update(self.task, completed=state.global_step)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if hasattr(self, "task") and logs and "loss" in logs:
                self.progress.update(self.task, loss=f"loss {logs['loss']:.4f}")

        def on_train_end(self, args, state, control, **kwargs):
            if hasattr(self, "task"):
                self.progress.stop()

    return RichProgress()


# ----------------------------------------------------------------------------------------------
# the run
# ----------------------------------------------------------------------------------------------


def plan_recipe(recipe: Recipe, **overrides: Any):
    """``plan_training(**recipe.plan_kwargs(**overrides))``."""
    from .._plan import plan_training

    return plan_training(**recipe.plan_kwargs(**overrides))


def check_run_writes(recipe: Recipe, *, output_dir: str | None = None, overwrite: bool = False,
                     push_to_hub: bool = False, report_to: Any = None) -> dict[str, Any]:
    """Where the run writes (``_run.writes``), checked before any heavy work: the output
    directory (``output_dir``, else the recipe's, else ``outputs/<recipe name>``) and the pins
    that push to the Hub or report to a service against ``push_to_hub`` / ``report_to``. Returns
    the trainer config's ``output_dir``, ``push_to_hub`` and ``report_to``; ``ConfigError``
    (exit 2) lists every problem."""
    where = recipe.source or "recipe"
    services = writes.check_report_flag(report_to, key="report_to") if report_to else []
    out, key = ((output_dir, "--output-dir") if output_dir else
                (recipe.output_dir, f"{where}: output_dir") if recipe.output_dir else
                (os.path.join("outputs", recipe.name), f"{where}: output_dir (default)"))
    problems = writes.output_dir_problems(out, key=key, overwrite=overwrite,
                                          shared=not output_dir)
    problems += writes.outbound_problems(recipe.pins, where=where, push_to_hub=push_to_hub,
                                         report_to=services)
    if problems:
        raise ConfigError(problems, source=where)
    return {"output_dir": os.path.expanduser(out),
            **writes.outbound_args(push_to_hub=push_to_hub, report_to=services)}


def train_recipe(recipe: Recipe, *, plan: Any = None, output_dir: str | None = None,
                 max_steps: int | None = None, pins: dict[str, Any] | None = None,
                 progress_console: Any = None, overwrite: bool = False,
                 push_to_hub: bool = False, report_to: Any = None) -> TrainResult:
    """Plan (unless ``plan`` is given), build, prepare and train ``recipe``; return what happened.

    ``output_dir`` / ``max_steps`` / ``pins`` override the recipe. ``progress_console``: a rich
    ``Console`` for a progress bar (None: no bar). ``overwrite``: train into a directory that is
    not empty. ``push_to_hub`` / ``report_to`` (service names, e.g. ``["wandb"]``): the only way
    the run pushes to the Hub or reports to a service; pins asking for either without them are
    refused (``check_run_writes``)."""
    from transformers import PrinterCallback, ProgressCallback

    from .._callbacks import MemoryCallback, ThroughputCallback
    from .._device.rss import set_mmap_threshold
    from .._model import normalize_task

    set_mmap_threshold()  # before the model's tensors exist: CPU readings track tensor bytes
    where = recipe.source or "recipe"
    if pins:
        recipe = with_pins(recipe, pins)
    if max_steps is not None:
        recipe = with_max_steps(recipe, max_steps)
    check_trainable_here(recipe)
    outputs = check_run_writes(recipe, output_dir=output_dir, overwrite=overwrite,
                               push_to_hub=push_to_hub, report_to=report_to)
    if plan is None:
        plan = plan_recipe(recipe)
    config = recipe.model_config()
    task = normalize_task(recipe.task, config)
    check_trainer_runs(recipe, task)
    out = outputs["output_dir"]
    steps = recipe.pins.get("max_steps", -1)
    n = recipe.num_samples or (steps * recipe.target_batch_size if steps and steps > 0 else 256)
    tokenizer = None if recipe.is_synthetic else load_tokenizer(recipe)
    data, collator = build_dataset(recipe, config, task, num_samples=n, tokenizer=tokenizer)
    args = run_args(recipe, plan, outputs)
    try:
        model = plan.prepare(recipe_model(recipe, plan, task))
    except HfMemkitError:
        raise
    except Exception as exc:  # the model code itself raised (a config it cannot build...)
        raise TrainingFailed(failure_message(f"building the model of {where} failed", exc,
                                              out, write_error(out, "building the model", exc))
                             ) from exc
    memory = MemoryCallback(plan) if "memory" in recipe.callbacks else None
    callbacks = [cb for cb in (memory, ThroughputCallback(plan.device)
                               if "throughput" in recipe.callbacks else None) if cb is not None]
    trainer = TRAINERS.get(recipe.trainer).build(
        model=model, args=args, rows=data, data_collator=collator, processing_class=tokenizer,
        callbacks=callbacks, oom_guard="oom_guard" in recipe.callbacks)
    trainer.remove_callback(PrinterCallback)   # the summary and the progress bar replace them
    trainer.remove_callback(ProgressCallback)
    if progress_console is not None:
        trainer.add_callback(_progress_callback(progress_console))
    t0 = time.perf_counter()
    train_keeping_what_exists(trainer, memory, out, where)
    seconds = time.perf_counter() - t0
    with no_progress_bars():
        trainer.save_model(out)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    sps = [h["throughput/samples_per_second"] for h in trainer.state.log_history
           if "throughput/samples_per_second" in h]
    report = memory.to_report() if memory is not None else {}
    return TrainResult(
        recipe=where, plan=plan, steps=trainer.state.global_step,
        first_loss=losses[0] if losses else None, last_loss=losses[-1] if losses else None,
        seconds=seconds,
        predicted_peak=plan.estimate.peak_allocated if plan.estimate is not None else None,
        measured_peak=(report.get("summary") or {}).get("max_peak_allocated"),
        device=str(args.device.type), output_dir=out, model_dir=out,
        memory_report=memory.report_path if memory else None,
        memory_plot=memory.plot_path if memory else None,
        timeline=list(memory.timeline) if memory else [],
        samples_per_second=sps[-1] if sps else None,
        oom_recoveries=len(getattr(trainer, "oom_recoveries", []) or []))


def run_args(recipe: Recipe, plan: Any, outputs: dict[str, Any]) -> Any:
    """The trainer's config: the plan's arguments with ``outputs`` (``check_run_writes``: the
    output directory, ``push_to_hub`` and ``report_to`` exactly as the command line set them),
    no tqdm bar, and memory logs about ten times a run unless ``logging_steps`` is pinned."""
    where = recipe.source or "recipe"
    steps = recipe.pins.get("max_steps", -1)
    extra: dict[str, Any] = {"disable_tqdm": True, **outputs}
    if "logging_steps" not in recipe.pins and steps and steps > 0:
        extra["logging_steps"] = max(1, min(500, steps // 10))
    try:
        args = plan.to_training_args(**extra)
    except (ValueError, TypeError) as exc:  # TrainingArguments rejects a pinned combination
        raise ConfigError([f"{where}: pins: TrainingArguments rejects them: {exc}"],
                          source=where) from None
    reported = [] if outputs["report_to"] == "none" else outputs["report_to"]
    if "all" not in reported:   # inside a Kubeflow TrainJob transformers adds its own reporter
        args.report_to = list(reported)
    return args


def with_max_steps(recipe: Recipe, max_steps: int) -> Recipe:
    """``max_steps`` pinned; a recipe ``logging_steps`` longer than the run is shortened so the
    memory logs still appear."""
    if not isinstance(max_steps, int) or isinstance(max_steps, bool) or \
            not 1 <= max_steps <= 2**31:
        raise ConfigError([f"max_steps: expected a positive integer of at most 2**31, got "
                           f"{max_steps!r}"], source="train_recipe")
    pins = {"max_steps": max_steps}
    logging = recipe.pins.get("logging_steps")
    if isinstance(logging, (int, float)) and logging >= 1 and logging > max_steps // 2:
        pins["logging_steps"] = max(1, max_steps // 2)
    return with_pins(recipe, pins)


def with_pins(recipe: Recipe, pins: dict[str, Any]) -> Recipe:
    import dataclasses

    from .._device.probe import resolve_device
    from .._recipe import Checker, check_pins

    c = Checker("command line")
    # checked against the recipe's device too: fp16=true on a CPU recipe is bad input here
    checked = check_pins(dict(pins), c, dev=resolve_device(recipe.device), trainer=recipe.trainer)
    if c.problems:
        raise ConfigError(c.problems, source="command line")
    return dataclasses.replace(recipe, pins={**recipe.pins, **checked})
