"""Every field of the installed config class of every registered trainer (``TrainingArguments``,
TRL's ``SFTConfig``, ``DPOConfig``, ``GRPOConfig``, ``RLOOConfig``), in one of three classes
(docs/fitting.md: memory-relevant settings are modelled or named in a warning):

  * **modelled**: read into the ``TrainingSetup``. Derived from the registries: the fields of the
    modelled techniques (``Technique.fields``), of the trainer (``TrainerKind.modelled_fields``),
    plus the fields ``_setup.normalize_args`` and the engines read themselves (``SETUP_FIELDS``,
    ``ENGINE_FIELDS``, from each engine's ``Engine.fields``);
  * **unmodelled**: changes a training step's device memory, but the estimate does not follow it.
    ``UNMODELLED``: the fields here and those a trainer's entry declares for its config alone
    (``TrainerKind.unmodelled_fields``); set to a non-default value, ``normalize_args`` warns
    naming it. Plus the techniques registered with ``modelled=False`` and what a trainer's
    ``unmodelled`` names (those registries warn themselves);
  * **irrelevant**: does not change what a training step holds on the device, one reason per
    group (``IRRELEVANT``, and a trainer entry's own ``irrelevant``).

``tests/contracts/test_field_coverage.py`` enumerates the installed classes, so a field that a new
transformers or TRL adds fails there until it is placed in one class, here or in its trainer's
entry. Read from transformers 5.23 (``training_args.py``, ``trainer.py``) and TRL 1.16
(``sft_config.py``, ``sft_trainer.py``, ``dpo_config.py``, ``dpo_trainer.py``,
``grpo_config.py``, ``rloo_config.py``, ``trainer/utils.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from .._engines import ENGINES
from .._techniques import TECHNIQUES
from .._trainers import TRAINER, TRAINERS, Unmodelled

# Read by _setup.normalize_args itself (batch sizes, precision, optimizer, clipping, eval).
SETUP_FIELDS = ("per_device_train_batch_size", "gradient_accumulation_steps",
                "per_device_eval_batch_size", "bf16", "fp16", "tf32", "optim", "optim_args",
                "optim_target_modules", "max_grad_norm", "eval_accumulation_steps",
                "prediction_loss_only")
# Read by the engines (``Engine.fields``) and with them the run's parallel dimensions.
ENGINE_FIELDS = tuple(dict.fromkeys([*(f for e in ENGINES for f in e.fields),
                                     "parallelism_config"]))

CLASSES = ("modelled", "unmodelled", "irrelevant")


UNMODELLED: dict[str, Unmodelled] = {
    # transformers.TrainingArguments
    # TrainingArguments sets the backend itself when torch_compile is on (the torch_compile
    # technique warns then); given alone, it switches torch.compile on
    "torch_compile_backend": Unmodelled("it switches torch.compile on, which fuses kernels and "
                                        "changes activation memory",
                                        when={"torch_compile": (False,)}),
    "torch_compile_mode": Unmodelled("torch.compile (which it switches on) fuses kernels; "
                                     "reduce-overhead / max-autotune add CUDA graphs with a "
                                     "memory pool of their own"),
    "torch_empty_cache_steps": Unmodelled("torch.cuda.empty_cache() every n steps returns the "
                                          "caching allocator's free segments, lowering reserved "
                                          "memory between steps"),
    "label_smoothing_factor": Unmodelled("the Trainer's LabelSmoother takes log_softmax of the "
                                         "logits outside the model (fp32 [tokens x vocab] "
                                         "temporaries)", trainers=(TRAINER.name,),
                                         otherwise="TRL's trainers compute their own loss"),
    "use_cache": Unmodelled("the model returns its key/value cache, which stays alive until the "
                            "step ends", trainers=(TRAINER.name,),
                            otherwise="TRL's trainers pass use_cache=False to every forward"),
    "bf16_full_eval": Unmodelled("evaluation casts the model to bf16 (eval weights and "
                                 "activations halve)"),
    "fp16_full_eval": Unmodelled("evaluation casts the model to fp16 (eval weights and "
                                 "activations halve)"),
    "eval_do_concat_batches": Unmodelled("eval predictions are kept as a list, not concatenated "
                                         "(no concatenation copy)"),
    "include_for_metrics": Unmodelled("eval also gathers the inputs and/or losses for the "
                                      "metrics, kept on the device until eval_accumulation_steps"),
    "batch_eval_metrics": Unmodelled("metrics are computed per eval batch, so predictions are "
                                     "not accumulated on the device"),
    "eval_use_gather_object": Unmodelled("eval outputs are gathered as Python objects, not "
                                         "tensors"),
    "auto_find_batch_size": Unmodelled("after an out-of-memory error the Trainer retries with "
                                       "half the micro-batch; the estimate is for the micro-batch "
                                       "given"),
    "full_determinism": Unmodelled("deterministic algorithms and CUBLAS_WORKSPACE_CONFIG change "
                                   "kernels and their workspaces"),
    "debug": Unmodelled("the underflow/overflow detector's hooks take abs() of every weight and "
                        "activation (temporaries of their size)"),
    "weight_decay": Unmodelled("torch's foreach SGD / Adagrad / RMSprop add weight decay out of "
                               "place: a copy of the gradients", when={
                                   "optim": ("sgd", "adagrad", "rmsprop")}),
    # trl.SFTConfig / trl.DPOConfig
    "model_init_kwargs": Unmodelled("the dtype / quantization TRL loads a model name with; pass "
                                    "dtype= / quantization_config= to estimate_memory"),
    "router_aux_loss_coef": Unmodelled("whether a Mixture-of-Experts model returns its router "
                                       "logits (one [tokens x experts] tensor per layer) for "
                                       "the load-balancing loss"),
    "eval_packing": Unmodelled("the eval batches' packing; the eval estimate follows `packing`"),
    "disable_dropout": Unmodelled("whether DPOTrainer zeroes the model's dropout (saved dropout "
                                  "masks); the trace keeps the model's own dropout"),
    "precompute_ref_batch_size": Unmodelled(
        "the reference log-probs are computed before training in no-grad batches of this size; "
        "the estimate covers training steps only", when={"precompute_ref_log_probs": (True,)}),
    "ld_alpha": Unmodelled("LD-DPO's [2 x batch, tokens] masks and weighted sums of the "
                           "per-token log-probs"),
}


def _trainer_own() -> dict[str, Unmodelled]:
    """The fields of one trainer's config alone that change memory and are not modelled
    (``TrainerKind.unmodelled_fields``), each marked with the trainers that declare it."""
    out: dict[str, Unmodelled] = {}
    for kind in TRAINERS:
        for name, u in kind.unmodelled_fields.items():
            given = out[name].trainers if name in out else ()
            titles = " / ".join(TRAINERS.get(t).title for t in (*given, kind.name))
            out[name] = dataclasses.replace(u, trainers=(*given, kind.name),
                                            otherwise=f"only {titles} read it")
    return out


UNMODELLED.update(_trainer_own())

IRRELEVANT: dict[str, tuple[str, ...]] = {
    "where outputs go, names and logging; nothing the step holds": (
        "output_dir", "run_name", "project", "trackio_space_id", "trackio_bucket_id",
        "trackio_static_space_id", "report_to", "disable_tqdm", "log_level", "log_level_replica",
        "log_on_each_node", "logging_strategy", "logging_steps", "logging_first_step",
        "skip_memory_metrics"),
    "a scalar per step (the loss's NaN check, token counts, the tokens averaged across ranks)": (
        "logging_nan_inf_filter", "include_num_input_tokens_seen",
        "average_tokens_across_devices"),
    "schedules and optimizer scalars: values, not tensors (weight_decay: see UNMODELLED)": (
        "num_train_epochs", "max_steps", "learning_rate", "lr_scheduler_type",
        "lr_scheduler_kwargs", "warmup_steps", "adam_beta1", "adam_beta2", "adam_epsilon"),
    "when evaluation runs, not what one eval step holds (stage='eval' estimates that)": (
        "eval_strategy", "eval_steps", "eval_delay", "eval_on_start"),
    "checkpoints and the Hub: written between steps, from host copies": (
        "save_only_model", "save_strategy", "save_steps", "save_on_each_node",
        "save_total_limit", "enable_jit_checkpoint", "push_to_hub", "hub_token",
        "hub_private_repo", "hub_model_id", "hub_strategy", "hub_always_push", "hub_revision",
        "load_best_model_at_end", "metric_for_best_model", "greater_is_better",
        "ignore_data_skip", "restore_callback_states_from_checkpoint",
        "resume_from_checkpoint"),
    "seeds and script flags (do_*: the Trainer does not read them)": (
        "seed", "data_seed", "do_train", "do_eval", "do_predict", "local_rank"),
    "the data loader: host memory and worker processes, not the device": (
        "dataloader_drop_last", "dataloader_num_workers", "dataloader_pin_memory",
        "dataloader_persistent_workers", "dataloader_prefetch_factor",
        "dataloader_multiprocessing_context", "dataloader_in_order"),
    "which columns and rows reach the model; the estimate is at the given seq_len, the longest "
    "batch (group_by_length orders batches, it does not lengthen them)": (
        "remove_unused_columns", "label_names", "train_sampling_strategy", "length_column_name"),
    "DDP communication settings: its buckets together hold every gradient whatever their "
    "cap (_engines/ddp.py); buffers are broadcast in place": (
        "ddp_find_unused_parameters", "ddp_bucket_cap_mb", "ddp_broadcast_buffers",
        "ddp_static_graph", "ddp_backend", "ddp_timeout"),
    "the device: estimate_memory's `device` argument says which one is estimated": (
        "use_cpu",),
    "TRL dataset preparation, on the host before training": (
        "trust_remote_code", "chat_template_path", "dataset_text_field", "dataset_kwargs",
        "dataset_num_proc", "eos_token", "pad_token", "shuffle_dataset"),
    "which end of a row truncation keeps: the length (max_length) is the same": (
        "truncation_mode",),
}


def _config_fields(trainer: str) -> list[str]:
    return [f.name for f in dataclasses.fields(TRAINERS.get(trainer).config_type())]


def field_classes(trainer: str = TRAINER.name) -> dict[str, frozenset[str]]:
    """``CLASSES`` -> the fields of ``trainer``'s installed config class in that class (a field in
    none of them, or in two, is a gap the coverage test reports)."""
    kind = TRAINERS.get(trainer)
    names = set(_config_fields(trainer))
    unmodelled = {n for n, u in UNMODELLED.items() if not u.trainers or trainer in u.trainers}
    unmodelled |= {f for t in TECHNIQUES if not t.modelled for f in t.fields}
    unmodelled |= set(kind.fields) - kind.modelled_fields()
    modelled = {*SETUP_FIELDS, *ENGINE_FIELDS, *kind.modelled_fields(),
                *(f for t in TECHNIQUES if t.modelled for f in t.fields)}
    irrelevant = {f for group in (*IRRELEVANT.values(), *kind.irrelevant.values())
                  for f in group}
    irrelevant |= {n for n, u in UNMODELLED.items() if u.trainers and trainer not in u.trainers}
    return {"modelled": frozenset(modelled & names), "unmodelled": frozenset(unmodelled & names),
            "irrelevant": frozenset(irrelevant & names)}


def _plain(v: Any) -> Any:
    """An enum's value; None for every empty value ("", [], {}: ``debug`` is "" as a field
    default and [] on an instance)."""
    v = getattr(v, "value", v)
    if isinstance(v, (list, tuple)):
        v = [getattr(x, "value", x) for x in v]
    return None if v in ("", [], {}, ()) else v


def unmodelled_settings(given: Mapping[str, Any], defaults: Mapping[str, Any], trainer: str,
                        get: Callable[[str], Any]) -> list[str]:
    """``"field: what it changes"`` for every ``UNMODELLED`` field that ``given`` sets to a value
    other than its default (``defaults``: the config class's) and that changes memory for
    ``trainer`` with these arguments (``get`` reads a field)."""
    return [f"{name}: {u.what}" for name, u in UNMODELLED.items()
            if name in given and u.applies(trainer, get)
            and _plain(given[name]) != _plain(defaults.get(name))]
