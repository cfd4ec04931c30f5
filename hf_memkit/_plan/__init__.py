"""Pick the fastest training setup that fits: ``plan_training`` -> ``Plan``.

Data flow: ``PlanRequest`` (validated once) -> ``space`` (candidates: method x rung x precision
x optimizer x searched techniques x micro-batch) -> ``cost`` (relative time per sample) ->
``search`` (lower bounds, then exact estimates, in ladder order) -> ``emit`` (TrainingArguments,
model and accelerate kwargs) -> ``result.Plan``. ``lengths`` plans from the rows' lengths,
``sequence`` splits sequences over ranks when they cannot each hold whole ones, ``rungs`` says
what each rung of the chosen setup saved (``Plan.ladder``). ``reverse`` answers "how large can
it be?"; ``serialize`` and ``read`` write a plan as JSON and check it when read back
(``Plan.from_json``).

With ``method="auto"`` full fine-tuning wins whenever some full setup fits (LoRA changes what is
trained, so it is a fallback, never a speed trick). The rules, and why: docs/fitting.md. A
hub: it drives every engine and trainer through its registry entry and names none
(docs/extending.md).
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from .._compat import quiet_notices, spare_the_collector
from .._engines import engine_choices
from .._errors import ConfigError, HfMemkitError, quoted
from .._estimate.budget import resolve_headroom
from .._methods import METHODS, Method, ladder, method_choices
from .._model.profile import architecture_facts, unwrap_model
from .._model.spec import loaded_weights
from .._setup.fields import training_args_fields
from .._trainers import trainer_of_args
from .cost import Shape
from .emit import ArgsContext, accelerator_kwargs, model_kwargs, parallel_summary, training_args
from .lengths import Lengths, length_problems
from .request import PlanRequest, Problem
from .result import MEMORY_FIELDS, Plan
from .reverse import max_batch_size, max_seq_len
from .rungs import ladder_savings
from .search import Search
from .sequence import plan_split
from .space import Candidate, SpecBook, attention, candidates


def _model_name(model: Any, spec: Any) -> Any:
    if isinstance(model, str) or hasattr(model, "__fspath__"):
        return str(model)
    return spec.config  # a config or a model: keep its config (re-estimates use it)


def search_for(req: PlanRequest) -> tuple[Search, list[Candidate]]:
    methods = ladder(req.method)
    book = SpecBook(req, {m.name: m for m in methods})
    facts = architecture_facts(book.base.config)
    ctx = ArgsContext(req.pins, req.dev, req.ranks, facts["hidden_size"] or 1,
                      book.base.facts().layer_class)
    shape = Shape(sum(p.numel() for p in book.base.meta.parameters()), facts["num_layers"] or 1,
                  facts["hidden_size"] or 1, facts["num_attention_heads"] or 1, req.seq_len,
                  req.per_rank, req.nodes)
    s = Search(req, book, ctx, shape, methods, req.budget(), req.host_budget())
    said = [i.message for i in req.precision_issues()]  # the refused: the request's problems
    said += [w for w in [book.base.positions_warning(req.seq_len),
                         req.data_parallel_warning()] if w]
    for message in said:
        s.notes.append(message)
        warnings.warn(message, UserWarning, stacklevel=3)
    return s, candidates(req, methods, book, s.notes)


def _finish(s: Search, cands: list[Candidate], chosen: Candidate) -> Plan:
    req = s.req
    chosen.chosen, chosen.reason = True, "fastest setup that fits"
    if chosen.estimate is not None and not chosen.estimate.needs_at_least:
        # what estimate_memory says of it: its smallest capacity searched even where the
        # verdict did not depend on it, so the plan and the estimate show one `required`
        chosen.estimate = s.estimate(chosen, judge=False)
    est = chosen.estimate
    if est is not None and (est.refusals or est.required > s.budget):
        # the search's own rule (edges, core.record): a plan never hands over a setup its own
        # estimate refuses
        raise HfMemkitError(f"internal error: the planner chose {chosen.label()}, which its own "
                            f"estimate refuses ({est.verdict}); please report it")
    for c in cands:
        if c.fits and not c.chosen:
            c.reason = "fits; slower than the chosen setup"
        elif not c.reason and c.estimate is None:
            c.reason = "not estimated: slower than the chosen setup" if (
                c.method == chosen.method) else (
                "not needed: a full fine-tuning setup fits" if chosen.method == "full"
                else f"not needed: a {chosen.method} setup fits (earlier in the method ladder)")
    base_time = chosen.rel_time
    # on first use, with the chosen setup's own predicted time (rel_time is made relative below)
    ladder = functools.partial(ladder_savings, s, dataclasses.replace(chosen, rel_time=base_time))
    for c in cands:
        if c.rel_time is not None:
            c.rel_time = c.rel_time / base_time
    spec, peft_cfg, quant = s.book.get(chosen.method, chosen.precision)
    attn, attn_why = attention(s.book.base, req.dev, chosen.precision, req.split.cp)
    notes = s.notes + [f"attention: {attn} ({attn_why})"]
    method = METHODS.get(chosen.method)
    if method.note:
        notes.append(method.note)
    if chosen.precision == "pure-bf16":
        notes.append("pure bf16: weights, gradients and optimizer state in bf16 with no fp32 "
                     "master copy (as torchtune defaults to); saves memory but changes numerics")
    if chosen.padding_free:
        tokens = dict(s.setup_of(chosen).trainer.options).get("tokens") or \
            chosen.micro_batch * req.seq_len
        notes.append(f"padding-free: each micro-batch's rows flattened into one row (the "
                     f"largest holds {tokens} tokens); TRL takes the rows as they are "
                     f"(max_length=None): truncate them to {req.seq_len} tokens beforehand")
    if chosen.allocator:
        notes.append(f"PYTORCH_CUDA_ALLOC_CONF={chosen.allocator}: without it this setup misses "
                     "the budget by the caching allocator's fragmentation; with it the allocator "
                     "maps freed pages into one growing segment (torch's CUDA memory notes). Set "
                     "it before the run's first CUDA allocation (plan.env; the launch lines "
                     "carry it)")
    if chosen.micro_batch < req.per_rank:
        notes.append(f"micro-batch {chosen.micro_batch} x {chosen.grad_accum} accumulation steps "
                     f"x {req.data_parallel} data-parallel rank(s) = {req.target_batch_size}")
    ta = training_args(chosen, s.ctx, s.eval_batch(chosen))
    setup = s.setup_of(chosen)
    parallel = parallel_summary(chosen, ta, setup.sharding, setup.parallel, req.nodes, notes,
                                chosen.estimate)
    return Plan(device=req.dev, model_name=_model_name(req.model, s.book.base),
                seq_len=req.seq_len, target_batch_size=req.target_batch_size,
                num_gpus=req.ranks, method=req.method, budget=s.budget,
                training_args_kwargs=ta, model_kwargs=model_kwargs(chosen, attn, quant, req.dev),
                peft_config=peft_cfg, accelerator_kwargs=accelerator_kwargs(chosen, ta),
                candidates=cands, notes=notes, num_nodes=req.nodes, parallel=parallel,
                budget_basis=req.budget_of().basis, _ladder=ladder)


def _request(model: Any, *, seq_len: int | None = None, target_batch_size: int,
             device: Any = None, num_gpus: int | None = None, method: str = "auto",
             headroom: float | None = None, max_memory: int | str | None = None,
             task: str | None = None, num_nodes: int = 1, engine: str = "auto",
             host_memory: int | str | None = None, cuda_version: str | None = None,
             trainer: str | None = None, lengths: Any = None, mean_len: Any = None,
             max_len: Any = None, **constraints: Any) -> PlanRequest:
    headroom = resolve_headroom(headroom, max_memory, "plan_training", stacklevel=4)
    if trainer is not None:
        trainer = trainer_of_args(None, trainer)  # a clear error: a trainer not modelled, a typo
    if isinstance(lengths, Iterator):  # read once: checked, then planned
        lengths = list(lengths)
    problems = length_problems(lengths, mean_len, max_len, trainer, seq_len)
    if problems:
        raise ConfigError([p.message for p in problems], source="plan_training")
    profile = Lengths.of(lengths, mean_len, max_len)
    return PlanRequest(model, profile.max_len if profile else seq_len, target_batch_size, device,
                       num_gpus, method, headroom, max_memory, task, num_nodes, engine,
                       host_memory, dict(constraints), cuda_version=cuda_version,
                       trainer=trainer, lengths=profile)


@spare_the_collector()
@quiet_notices()  # third-party import notices our call triggers
def plan_training(model: Any, *, seq_len: int | None = None, target_batch_size: int,
                  device: Any = None,
                  num_gpus: int | None = None, method: str = "auto", headroom: float | None = None,
                  max_memory: int | str | None = None, task: str | None = None,
                  num_nodes: int = 1, engine: str = "auto", host_memory: int | str | None = None,
                  cuda_version: str | None = None, trainer: str | None = None,
                  lengths: Any = None, mean_len: float | None = None, max_len: int | None = None,
                  **constraints: Any) -> Plan:
    """Choose the fastest training setup whose predicted memory fits the device's budget.

    A setup fits when its estimate's `upper` (`required` plus the margin) is within the budget
    (docs/fitting.md); where none does, the first that fits at the centre is chosen and the
    plan is `tight` (`Plan.verdict`). With `method="auto"` full fine-tuning wins whenever some
    full setup fits without offloading parameters or optimizer state (LoRA changes what is
    trained, so it is a fallback, never a speed trick); offload comes after the LoRA family
    unless `host_memory` is given. `num_gpus` ranks
    over `num_nodes` nodes: DDP when a replica fits, else FSDP2 (`engine="fsdp"`, the default)
    or DeepSpeed ZeRO (`engine="deepspeed"`) sharding, and CPU offload only as the last rung;
    `engine="ddp"` never shards. The effective batch (micro-batch x accumulation x data-parallel
    ranks) is `target_batch_size` exactly.

    Args:
        model (`torch.nn.Module`, `PretrainedConfig`, `str` or `os.PathLike`):
            What `estimate_memory` takes: a model (any device), a config, a catalog name or a
            local directory.
        seq_len (`int`, *optional*):
            The longest sequence of a batch, at most 2**24 tokens. Not with `lengths` or
            `mean_len` + `max_len`, which replace it.
        target_batch_size (`int`):
            The effective batch, per optimizer step over all ranks; the data-parallel ranks
            must divide it (or it them, where the planner may split sequences over ranks).
        device (`DeviceInfo` or `str`, *optional*):
            A `DeviceInfo`, a catalog name or `"cpu"`; `None` plans for this machine's device,
            whose free memory then bounds the budget too.
        num_gpus (`int`, *optional*):
            Ranks over all nodes; defaults to 1.
        method (`str`, *optional*, defaults to `"auto"`):
            `"auto"`, `"full"`, `"lora"` or `"qlora"`.
        headroom (`float`, *optional*, defaults to 0):
            The fraction of device memory kept free for other tenants of the GPU (a desktop,
            a second job), in [0, 1). The budget starts from what CUDA hands out (NVML's
            total less the driver's reserve); a catalog card is planned headless, and on this
            machine's GPU its free memory already leaves other tenants theirs.
        max_memory (`int` or `str`, *optional*):
            Bytes or `"20GiB"`: replaces the device's budget entirely (headroom with it).
        task (`str`, *optional*):
            Picks the head for a config or a name (as in `estimate_memory`).
        num_nodes (`int`, *optional*, defaults to 1):
            Nodes the `num_gpus` ranks are spread over; must divide `num_gpus`.
        engine (`str`, *optional*, defaults to `"auto"`):
            `"auto"`, `"ddp"`, `"fsdp"` or `"deepspeed"`: the engine that shards when a
            replica does not fit.
        host_memory (`int` or `str`, *optional*):
            Bytes or `"512GiB"`, per node: bounds what offload may keep in CPU RAM. Planning
            for this machine it defaults to its RAM; for a catalog GPU to what a typical host
            holds (twice its GPUs' memory), and the plan notes what an offload setup needs.
        cuda_version (`str`, *optional*):
            The target's CUDA (as in `estimate_memory`); default the installed torch's.
        trainer (`str`, *optional*):
            `"sft"` / `"dpo"` plan for TRL's `SFTTrainer` / `DPOTrainer` step (their fused
            head, DPO's chosen+rejected rows and reference model), `"grpo"` / `"rloo"` for
            TRL's online RL trainers (a colocated vLLM's share of the GPU planned first, when
            their config colocates one); default `transformers.Trainer`. For a TRL trainer
            `constraints` may pin its config's fields (`packing=True`), `max_length` is
            `seq_len` unless pinned, and `to_training_args()` builds the trainer's config (or
            `apply_to` your own).
        lengths (`Sequence[int]`, *optional*):
            With `trainer="sft"` and instead of `seq_len`: the rows' token counts.
            Micro-batches are then planned in tokens, padded (peaking at the longest row) or
            padding-free (the rows flattened; peaking at the most tokens a micro-batch can
            hold) where the model's attention takes sequence boundaries from `position_ids`.
        mean_len (`float`, *optional*):
            With `max_len`, instead of `lengths`: the rows' mean token count
            (0 < `mean_len` <= `max_len`).
        max_len (`int`, *optional*):
            With `mean_len`: the longest row, which is then the sequence length.
        **constraints:
            Pin TrainingArguments (or TRL config) fields, kept as given (e.g.
            `optim="adamw_torch_fused"`, `activation_checkpointing=False`), or restrict the
            search (`micro_batch=4`).

    Returns:
        `Plan`: the chosen setup (`chosen`, its `estimate`), every candidate considered, the
        arguments to train with (`training_args_kwargs`, `to_training_args()`), the model's
        loading kwargs, LoRA config and what a multi-GPU run needs.

    Raises:
        ConfigError: Every problem of the request at once: a value out of range, an unknown
            `method`, `engine` or constraint, a pin of the wrong type, a precision the device
            refuses, ranks that do not divide `target_batch_size`, a micro-batch or
            accumulation that does not complete it, more GPUs than the machine or a node holds,
            `lengths` / `mean_len` + `max_len` beside `seq_len` or without `trainer="sft"`.
        HfMemkitError: When no setup fits (the error names the smallest memory any setup
            needs, and which), for an unknown model or device, or a trainer not modelled.
    """
    req = _request(model, seq_len=seq_len, target_batch_size=target_batch_size, device=device,
                   num_gpus=num_gpus, method=method, headroom=headroom, max_memory=max_memory,
                   task=task, num_nodes=num_nodes, engine=engine, host_memory=host_memory,
                   cuda_version=cuda_version, trainer=trainer, lengths=lengths,
                   mean_len=mean_len, max_len=max_len, **constraints)
    req.raise_problems("plan_training")
    # what the trainer brings besides its step is planned around the search (a colocated vLLM)
    base = lambda: SpecBook(req, {}).base  # noqa: E731
    try:
        return req.trainer_kind.plan_around(req, _plan, base)
    except ConfigError:
        raise
    except HfMemkitError:
        # nothing fits with its margin, sequence splits included: a second pass may take a
        # setup that fits at the centre (tight); where none does, it raises the same error
        return req.trainer_kind.plan_around(dataclasses.replace(req, allow_tight=True), _plan,
                                            base)


def _plan(req: PlanRequest) -> Plan:
    if req.split.plain and req.target_batch_size % req.ranks:  # fewer sequences than ranks
        return plan_split(req, _plan, None)
    try:
        s, cands = search_for(req)
        return _finish(s, cands, s.run(cands))
    except ConfigError:
        raise
    except HfMemkitError as exc:
        if not req.split.plain or not req.splits_sequences:
            raise
        return plan_split(req, _plan, exc)


def _as_given(model: Any) -> tuple[Method, torch.dtype, str]:
    """The method a model is ready to train with as it is, its weights' dtype, and in words. A
    name or config is loaded later by the user, with no adapters, in fp32 (``from_config``)."""
    if not isinstance(model, torch.nn.Module):
        return METHODS.get("full"), torch.float32, "a model that is not loaded yet"
    base, has_adapters = unwrap_model(model)
    dtype, bits = loaded_weights(base)
    weights = f"a {bits}-bit base" if bits else f"{str(dtype).removeprefix('torch.')} weights"
    words = f"adapters on {weights}" if has_adapters else weights
    for m in METHODS:
        if m.describes(has_adapters, bits):
            return m, dtype, words
    raise HfMemkitError(
        f"the model has {words} and no method trains it as it is: a quantized base trains only "
        "through adapters; prepare it with plan = mk.plan_training(model, ...) and "
        "model = plan.prepare(model)")




@quiet_notices()  # third-party import notices our call triggers
def auto_training_args(model: Any, *, base_args: Any = None, **kwargs: Any):
    """The training arguments of the fastest setup that fits `model` as it is given.

    A loaded model is planned as it is (a plain model: full fine-tuning in its own dtype; a peft
    model: its own adapters, on its own 16-bit or quantized base), and its attention kernel is
    set to the plan's in place; what the arguments switch on (checkpointing, optimizer,
    precision) the Trainer applies. A name or a config is planned as loaded later, in fp32 with
    no adapters. Setups that need the model loaded or wrapped otherwise (LoRA, QLoRA, an 8-bit
    base, pure bf16 weights) are not returned: when only such a setup fits, the error says so,
    and `plan_training` + `plan.prepare(model)` applies it.

    Args:
        model (`torch.nn.Module`, `PretrainedConfig`, `str` or `os.PathLike`):
            The model, as `plan_training` takes it.
        base_args (`TrainingArguments`, *optional*):
            Your own arguments (`TrainingArguments`, `SFTConfig`, ...): they get the plan
            through `Plan.apply_to` and keep their other fields.
        **kwargs:
            `plan_training`'s arguments (`seq_len`, `target_batch_size`, ...; a `method` the
            model is ready for). `output_dir` and other TrainingArguments fields that do not
            change memory are applied as overrides.

    Returns:
        `TrainingArguments` (or the TRL trainer's config), or `base_args`' class with the plan.

    Raises:
        ConfigError: The request's problems, as in `plan_training`.
        HfMemkitError: When only a setup that needs the model prepared otherwise fits, no
            setup fits, `method` asks for such a setup, or a quantized base has no adapters.
    """
    from transformers import TrainingArguments

    if base_args is not None and not isinstance(base_args, TrainingArguments):
        raise HfMemkitError(f"base_args: expected TrainingArguments or a subclass of it "
                            f"(SFTConfig, DPOConfig, ...), got {type(base_args).__name__} "
                            f"{quoted(base_args)}; or leave it out")
    fields = training_args_fields()
    overrides = {k: kwargs.pop(k) for k in list(kwargs) if k in fields and k not in MEMORY_FIELDS}
    given, dtype, words = _as_given(model)
    asked = kwargs.get("method", "auto")
    if asked in method_choices() and asked not in given.selected_by:
        raise HfMemkitError(
            f"auto_training_args plans for the model as it is given ({words}: {given.name}); "
            f"method={asked!r} needs it loaded or wrapped otherwise. Use "
            f"plan = mk.plan_training(model, method={asked!r}, ...), load the model with "
            "plan.model_kwargs, then model = plan.prepare(model) and args = "
            "plan.to_training_args()")
    kwargs["method"] = asked if asked != "auto" else given.selected_by[-1]
    req = _request(model, **kwargs)
    req.raise_problems("auto_training_args")
    s, cands = search_for(req)
    pure_ok = dtype == torch.bfloat16
    ready = [c for c in cands if c.method == given.name
             and (c.precision != "pure-bf16" or pure_ok)]
    try:
        chosen = s.run(ready) if ready else s.raise_impossible(cands)
    except HfMemkitError as exc:
        raise HfMemkitError(
            f"{exc}\nauto_training_args plans only for the model as it is given ({words}: "
            f"{given.name}{'' if pure_ok else ', no pure bf16'}). plan_training(model, ...) also "
            "considers LoRA, LoRA on an 8-bit base, QLoRA and pure bf16, which need the model "
            "loaded with plan.model_kwargs and prepared with plan.prepare(model)") from None
    plan = _finish(s, ready, chosen)
    if isinstance(model, torch.nn.Module):
        plan.set_attention(model)
    if base_args is not None:
        import dataclasses

        if overrides:
            base_args = dataclasses.replace(base_args, **overrides)
        return plan.apply_to(base_args)
    return plan.to_training_args(**overrides)


__all__ = ["Candidate", "Plan", "PlanRequest", "Problem", "auto_training_args", "engine_choices",
           "max_batch_size", "max_seq_len", "plan_training"]
