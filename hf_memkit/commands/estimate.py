"""``hf-memkit estimate``: the memory breakdown of one training setup, on any GPU, without one."""

from __future__ import annotations

import argparse
import dataclasses
import json

from .._errors import HfMemkitError, excerpt, quoted, read_user_file
from .._model.tasks import task_choices
from .cache import add_cache_option, apply_cache_option


class FieldError(argparse.ArgumentTypeError, HfMemkitError):
    """A bad ``FIELD=VALUE``: argparse prints its message and exits 2; read outside argparse it
    is an ``HfMemkitError`` (exit 2 too)."""


# --dtype values: the floating dtypes weights can be loaded in (estimate_memory's `dtype`)
DTYPES = ("float32", "bfloat16", "float16", "auto")


def fraction(text: str) -> float:
    """``--headroom``: the fraction of device memory kept free, in [0, 1)."""
    try:
        v = float(text)
    except ValueError:
        v = None
    if v is None or not 0 <= v < 1:
        raise FieldError(f"expected the fraction of device memory kept free, in [0, 1) (0.1 "
                         f"keeps 10% free), got `{text}`")
    return v


def positive_int(text: str) -> int:
    """An integer >= 1 (a count without a bound of its own: ``--lora-r``)."""
    try:
        v = int(text)
    except ValueError:
        v = 0
    if v < 1:
        raise FieldError(f"expected a positive integer, got `{excerpt(text)}`")
    return v


# The library's bounds (``_trainers.packing.MAX_TOKENS`` / ``MAX_BATCH``,
# ``_plan.request.MAX_RANKS``), restated so that the command line parses without importing torch
# (a contract test keeps them equal).
MAX_TOKENS, MAX_BATCH, MAX_RANKS = 2**24, 2**20, 2**17


def at_most(limit: int, what: str):
    """An argparse type: a positive integer of at most ``limit`` ``what``."""
    def parse(text: str) -> int:
        v = positive_int(text)
        if v > limit:
            raise FieldError(f"expected a positive integer of at most {limit} {what}, got "
                             f"`{excerpt(text)}`")
        return v

    parse.__name__ = f"at_most_{limit}"
    return parse


def device_index(text: str) -> int:
    """``--index``, ``--device``: a CUDA device index, an integer >= 0."""
    try:
        v = int(text)
    except ValueError:
        v = -1
    if v < 0:
        raise FieldError(f"expected a CUDA device index, an integer >= 0 (0 is the first device "
                         f"CUDA shows), got `{excerpt(text)}`")
    return v


tokens = at_most(MAX_TOKENS, "tokens (2**24)")
samples = at_most(MAX_BATCH, "samples (2**20)")
gpus = at_most(MAX_RANKS, "(2**17)")
steps = at_most(2**31, "optimizer steps (2**31)")
lora_rank = at_most(2**16, "(2**16; a rank above a layer's width adds nothing)")


class Field(tuple):
    """A parsed ``FIELD=VALUE``: the pair ``(field, value)``, keeping the text as given
    (``text``) so that ``--trainer``'s config class can type its own fields again."""

    text: str

    def __new__(cls, key: str, value: object, text: str) -> Field:
        self = super().__new__(cls, (key, value))
        self.text = text
        return self


class RawField(str):
    """A ``FIELD=VALUE`` as given, its form checked (``field_text``) but not yet typed: the
    command line is checked before torch and transformers load (``typed_fields`` types it)."""


def field_text(text: str) -> RawField:
    """``FIELD=VALUE``'s form (a field name, ``=``); its value is typed by ``typed_fields``."""
    key, sep, _ = text.partition("=")
    if not sep or not key.strip():
        raise FieldError(f"expected FIELD=VALUE (a TrainingArguments field, e.g. bf16=true or "
                         f"optim=adafactor), got `{text}`")
    return RawField(text)


def typed_fields(fields: list) -> list:
    """Each ``RawField`` typed by ``parse_field`` (which imports transformers); a bad value is
    an ``HfMemkitError`` (exit 2) naming it."""
    return [parse_field(f) if isinstance(f, RawField) else f for f in fields]


def check_input(args: argparse.Namespace, *, model: bool = True) -> None:
    """What the command line names, checked against the bundled catalogs before torch loads
    (an unknown model or GPU, a bad --max-memory or --cuda-version is refused in well under a
    second): ``HfMemkitError``, exit 2. ``model``: check the model name too."""
    from .._device.probe import get_device
    from .._model.names import check_model_ref
    from .._units import parse_bytes

    if model:
        check_model_ref(args.model)
    if args.gpu is not None:
        get_device(args.gpu)
    for flag in ("max_memory", "host_memory"):
        value = getattr(args, flag, None)
        if value is not None:
            try:
                parse_bytes(value)
            except HfMemkitError as exc:
                raise HfMemkitError(f"--{flag.replace('_', '-')}: {exc}") from None
    if args.cuda_version is not None:
        from .._cuda.runtime import parse_cuda_version

        parse_cuda_version(args.cuda_version)


def parse_field(text: str) -> tuple[str, object]:
    """``FIELD=VALUE`` -> (field, value). A bool/int/float ``TrainingArguments`` field's value is
    parsed by the field's type (``bf16=False`` is False: true/false, 1/0, yes/no); other values
    are read as JSON (``fsdp_config={...}``), else kept as text (``trainer_fields`` then types
    a TRL config's own fields)."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise FieldError(f"expected FIELD=VALUE (a TrainingArguments field, e.g. bf16=true or "
                         f"optim=adafactor), got `{text}`")
    from .._setup.fields import check_field, field_types

    if key in field_types():
        try:
            return Field(key, check_field(key, value), text)
        except HfMemkitError as exc:
            raise FieldError(f"{text}: {exc}") from None
    try:
        return Field(key, json.loads(value), text)
    except json.JSONDecodeError:
        return Field(key, value, text)


def trainer_option(text: str | None) -> str | None:
    """``--trainer``: a registered trainer (``trainer``, ``sft``, ``dpo``) whose config class is
    installed, else ``HfMemkitError`` (exit 2): TRL's GRPO, RLOO, ... are refused by name, a
    missing TRL says how to install it."""
    if text is None:
        return None
    from .._setup.fields import config_class
    from .._trainers import trainer_of_args

    try:
        config_class(text)
    except HfMemkitError as exc:
        raise HfMemkitError(f"--trainer {text}: {exc}") from None
    return trainer_of_args(None, text)


def trainer_fields(fields: list, trainer: str | None, *, also: tuple[str, ...] = ()) -> dict:
    """``fields`` (parsed ``FIELD=VALUE``) typed and checked by ``trainer``'s config class
    (``SFTConfig``, ``DPOConfig``): unknown fields, values of the wrong type or out of range are
    reported together (exit 2). ``also``: names the command takes besides the config's
    (``micro_batch``). The plain Trainer's fields stay as parsed (``estimate_memory`` checks
    them)."""
    from .._trainers import TRAINER

    if trainer in (None, TRAINER.name):
        return dict(fields)
    from .._errors import ConfigError
    from .._setup.fields import check_config_field, config_class

    cls = config_class(trainer)
    out, problems = {}, []
    for f in fields:
        key, value = f
        text = getattr(f, "text", f"{key}={value}")
        if key in also:
            out[key] = value
            continue
        try:
            out[key] = check_config_field(cls, key, value, raw=text.partition("=")[2])
        except HfMemkitError as exc:
            problems.append(f"{text}: {exc}")
    if len(problems) == 1:
        raise HfMemkitError(problems[0])
    if problems:
        raise ConfigError(problems, source="the command line")
    return out


def positive_number(text: str) -> float:
    """``--mean-len``: a number > 0."""
    try:
        v = float(text)
    except ValueError:
        v = 0.0
    if not v > 0:
        raise argparse.ArgumentTypeError(f"expected a number of tokens > 0, e.g. 412.5; got "
                                         f"{text!r}")
    return v


LENGTHS_CAP = 256 * 2**20  # bytes of a --lengths file: ~40 million rows of 6-digit counts


def read_lengths(path: str | None, flag: str = "--lengths") -> list[int] | None:
    """``--lengths FILE`` (or ``flag``: ``--completion-lengths``): a JSON list of integers, or
    one integer per line (blank lines and ``#`` comments skipped); a regular UTF-8 file of at
    most ``LENGTHS_CAP`` bytes (a FIFO or /dev/zero is refused, not read). The values are
    checked by the API (``estimate_memory``, ``plan_training``)."""
    if path is None:
        return None
    what = "a file of the rows' token counts, one per line or a JSON list"
    data = read_user_file(path, what=what, cap=LENGTHS_CAP, name=f"{flag} {excerpt(path)}")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise HfMemkitError(f"{flag} {excerpt(path)}: not UTF-8 text (byte "
                            f"0x{data[exc.start]:02x} at offset {exc.start}); give {what}"
                            ) from None
    if text.lstrip().startswith("["):
        try:
            return json.loads(text)
        except ValueError as exc:  # JSONDecodeError, or an integer of over 4300 digits
            raise HfMemkitError(f"{flag} {excerpt(path)}: not a JSON list of integers "
                                f"({excerpt(exc)})") from None
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        try:
            out.append(int(line))
        except ValueError:
            raise HfMemkitError(f"{flag} {excerpt(path)}, line {n}: {quoted(line)} is not an "
                                "integer; give one token count per line (or a JSON list)"
                                ) from None
    return out


def seq_len_or_max_length(seq_len: int | None, fields: dict, trainer: str | None,
                          lengths: list[int] | None = None) -> int | None:
    """``--seq-len``, which a TRL trainer's ``max_length=N`` or ``--lengths`` may stand for
    (None: the API derives it); without any, ``HfMemkitError`` saying what to give."""
    if seq_len is not None or lengths is not None:
        return seq_len
    from .._trainers import TRAINER

    if trainer not in (None, TRAINER.name) and fields.get("max_length") is not None:
        return None
    raise HfMemkitError("--seq-len is required (tokens per sequence, e.g. --seq-len 2048); "
                        "with --trainer sft or dpo, max_length=N may give it instead, or "
                        "--lengths FILE (the rows' token counts)")


def estimate_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "estimate", help="predict the memory of one training setup",
        description="Predict peak memory of a training (or eval) step of MODEL (a bundled name, a "
                    "local directory with config.json) on a catalog GPU or this machine.",
        epilog="Examples:\n"
               "  hf-memkit estimate Llama-3.1-8B --gpu RTX-4090 --seq-len 2048 --batch 1 \\\n"
               "      bf16=true gradient_checkpointing=true optim=adamw_bnb_8bit\n"
               "  hf-memkit estimate gpt2 --gpu cpu --seq-len 512 --batch 8 --json\n"
               "  hf-memkit estimate bert-large-uncased --task sequence-classification "
               "--gpu T4 --seq-len 512 --batch 8 fp16=true\n"
               "  hf-memkit estimate Llama-3.1-70B --gpu H100-80GB --num-gpus 8 --seq-len 4096 "
               "--batch 1 \\\n      bf16=true fsdp=true "
               "'fsdp_config={\"version\": 2, \"cpu_offload\": true}'   # one rank's memory\n"
               "  hf-memkit estimate Llama-3.2-1B --gpu RTX-4090 --trainer sft --batch 4 "
               "max_length=2048 packing=true   # TRL's SFTTrainer\n"
               "  hf-memkit estimate Llama-3.1-8B --gpu RTX-4090 --seq-len 2048 --batch 1 "
               "--method qlora --lora-r 64 bf16=true\n\n"
               "Exit status: 0 fits, 3 tight (the centre fits, its margin does not), 1 does not "
               "fit, 2 bad input.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("model", help="bundled model name or local directory with config.json")
    p.add_argument("fields", nargs="*", type=field_text, metavar="FIELD=VALUE",
                   help="any TrainingArguments field, e.g. bf16=true optim=adafactor (with "
                        "--trainer sft/dpo: any SFTConfig/DPOConfig field, e.g. packing=true)")
    p.add_argument("--gpu", default=None, help="catalog GPU (hf-memkit devices) or 'cpu'; "
                                               "default: this machine")
    p.add_argument("--seq-len", type=tokens, default=None,
                   help="longest sequence in a batch (with --trainer sft/dpo: default the "
                        "max_length=N field)")
    add_trainer_option(p)
    p.add_argument("--lengths", default=None, metavar="FILE",
                   help="the rows' token counts, one integer per line or a JSON list, instead "
                        "of --seq-len: a padded batch at its longest row; with --trainer sft "
                        "and padding_free/packing, the fullest micro-batch of them")
    p.add_argument("--completion-lengths", default=None, metavar="FILE",
                   help="with --trainer grpo/rloo: the completions' token counts (one per line "
                        "or a JSON list, e.g. from a previous run's logs): estimated at the "
                        "longest, at most max_completion_length (default: the cap)")
    p.add_argument("--batch", type=samples, default=None,
                   help="per_device_train_batch_size")
    p.add_argument("--task", default=None, metavar="TASK", choices=task_choices(),
                   help=f"head: {', '.join(task_choices(aliases=False))}")
    p.add_argument("--stage", default="train", choices=("train", "eval", "forward_backward"),
                   help="forward_backward: a custom loop's forward + backward, no optimizer")
    p.add_argument("--cuda-version", default=None, metavar="X.Y",
                   help="the target's CUDA, e.g. 12.8 (default: the installed torch's, else "
                        "13.0); CUDA < 11.7 or CUDA_MODULE_LOADING=EAGER loads every kernel "
                        "into a larger context")
    p.add_argument("--dtype", default=None, choices=DTYPES,
                   help="load dtype (bfloat16 = pure bf16 training; default: the model's, "
                        "float32 for a config)")
    p.add_argument("--num-gpus", type=gpus, default=None,
                   help="data-parallel ranks: one rank's memory under DDP, or the FSDP / "
                        "DeepSpeed sharding given by fsdp=... / deepspeed=... fields")
    p.add_argument("--method", default="full", choices=estimate_methods(),
                   help="what is trained: full (every weight), lora (adapters on a frozen "
                        "16-bit base), qlora (adapters on a 4-bit NF4 base; needs "
                        "bitsandbytes); LoRA as plan_training builds it: every linear layer, "
                        "alpha 2 x r, dropout 0.05")
    p.add_argument("--lora-r", type=lora_rank, default=None, metavar="R",
                   help="LoRA rank with --method lora/qlora (default 16)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--max-batch", action="store_true",
                   help="instead: the largest micro-batch that fits (reverse query)")
    p.add_argument("--max-seq-len", action="store_true",
                   help="instead: the longest seq_len (multiple of 64) that fits, up to --seq-len")
    p.add_argument("--headroom", type=fraction, default=None,
                   help="fraction of device memory kept free for other tenants (a desktop, a second "
                        "job), in [0, 1) (default 0: a catalog card is planned headless; on "
                        "this machine free memory is read): the budget of the verdict and of "
                        "--max-batch/--max-seq-len")
    p.add_argument("--max-memory", default=None, metavar="SIZE",
                   help="explicit budget instead of the device's, e.g. 20GiB (as in plan): "
                        "what the verdict (fits) and --max-batch/--max-seq-len use")
    add_cache_option(p)
    return p


def estimate_methods() -> list[str]:
    """``--method``'s choices: the methods ``plan_training(method=...)`` names, less "auto"."""
    from .._methods import method_choices

    return [m for m in method_choices() if m != "auto"]


def method_kwargs(args: argparse.Namespace) -> dict:
    """``--method`` / ``--lora-r`` as ``estimate_memory`` keywords: the method's peft
    ``LoraConfig`` and quantization config and its load dtype, built as ``plan_training`` builds
    them (``_plan.space.SpecBook``); {} for full fine-tuning."""
    if args.method == "full":
        if args.lora_r is not None:
            raise HfMemkitError(f"--lora-r {args.lora_r} sets the rank of LoRA adapters: give it "
                                "with --method lora or --method qlora (the default --method "
                                "full trains every weight)")
        return {}
    from .._methods import METHODS

    method = next(m for m in METHODS if args.method in m.selected_by)
    if method.missing():
        raise HfMemkitError(f"--method {args.method} {method.missing()}; or estimate --method "
                            "full / lora, which need no bitsandbytes")
    from .._device.probe import resolve_device
    from .._model.profile import to_config
    from .._model.tasks import normalize_task

    dev = resolve_device(args.gpu)
    peft_config = method.peft_config(normalize_task(args.task, to_config(args.model)))
    if args.lora_r is not None:
        peft_config.r, peft_config.lora_alpha = args.lora_r, 2 * args.lora_r
    return {"peft_config": peft_config, "quantization_config": method.quantization_config(dev),
            "dtype": args.dtype or method.load_dtype("", dev)}


def add_trainer_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trainer", default=None, metavar="TRAINER",
                   help="trainer (transformers.Trainer, the default), sft (TRL's SFTTrainer: "
                        "its fused log-prob head, SFTConfig's fields and defaults: bf16 and "
                        "checkpointing on), dpo (DPOTrainer: chosen + rejected rows, a "
                        "reference model), kto (KTOTrainer: a row and a KL row per example, "
                        "a reference model), reward (RewardTrainer: chosen + rejected rows of a "
                        "one-output classifier, --task sequence-classification), grpo "
                        "(GRPOTrainer), rloo (RLOOTrainer) or distillation "
                        "(DistillationTrainer: a teacher the student's size): "
                        "generation, scoring and training phases, --seq-len the longest "
                        "prompt, max_completion_length=N, use_vllm=true for a colocated vLLM; "
                        "needs pip install 'hf-memkit[trl]'")


def estimate_command(args: argparse.Namespace) -> int:
    from rich.console import Console

    from .._estimate import estimate_memory  # torch and transformers: only when a command runs
    from .._views.text import estimate_table, print_tables

    apply_cache_option(args)
    args.trainer = trainer_option(args.trainer)
    fields = trainer_fields(args.fields, args.trainer)
    lengths = read_lengths(args.lengths)
    seq_len = seq_len_or_max_length(args.seq_len, fields, args.trainer, lengths)
    trainer = {} if args.trainer is None else {"trainer": args.trainer}
    method = method_kwargs(args)
    if "dtype" in method:
        args.dtype = method.pop("dtype")
    if args.batch is not None:
        given = fields.get("per_device_train_batch_size", args.batch)
        if given != args.batch:
            raise HfMemkitError(f"--batch {args.batch} and per_device_train_batch_size={given} "
                                "name two batches; give one of them")
        fields["per_device_train_batch_size"] = args.batch
        fields.setdefault("per_device_eval_batch_size", args.batch)
    if args.max_batch or args.max_seq_len:
        if lengths is not None:
            raise HfMemkitError("--lengths estimates the batches of those rows; --max-batch and "
                                "--max-seq-len search one length: give --seq-len instead")
        if args.completion_lengths is not None:
            raise HfMemkitError("--completion-lengths applies to one estimate; --max-batch and "
                                "--max-seq-len search at max_completion_length: set that field "
                                "to the longest completion instead")

        seq_len = seq_len or fields["max_length"]
        kw = dict(device=args.gpu, headroom=args.headroom, task=args.task, dtype=args.dtype,
                  cuda_version=args.cuda_version, max_memory=args.max_memory, **trainer,
                  **method)
        from ._reverse import batch_reason, seq_len_reason

        if args.max_batch:
            from .._plan.reverse import max_batch_answer

            answer = max_batch_answer(args.model, fields, seq_len=seq_len, **kw)
            text = batch_reason(answer, seq_len)
            result = {"max_batch_size": answer.batch, **dataclasses.asdict(answer)}
        else:
            from .._plan.reverse import max_seq_len_answer

            ans = max_seq_len_answer(args.model, fields, limit=seq_len, **kw)
            text = seq_len_reason(ans, args.trainer)
            result = {"max_seq_len": ans.seq_len, **dataclasses.asdict(ans)}
        print(json.dumps(result) if args.json else text)
        return 0
    try:
        est = estimate_memory(args.model, fields, seq_len=seq_len, device=args.gpu,
                              stage=args.stage, task=args.task, dtype=args.dtype,
                              num_gpus=args.num_gpus, cuda_version=args.cuda_version,
                              max_memory=args.max_memory, lengths=lengths,
                              completion_lengths=read_lengths(args.completion_lengths,
                                                              "--completion-lengths"),
                              **trainer, **method,
                              **({} if args.headroom is None else {"headroom": args.headroom}))
    except ValueError as exc:
        raise HfMemkitError(str(exc)) from exc
    if args.json:
        out = {"trainer": est.setup.trainer.name, **est.to_dict()}
        print(json.dumps(out, indent=2, default=str))
    else:
        print_tables(Console(), estimate_table(est))
    return EXIT_STATUS.get(est.verdict, 0)


# The verdict as the exit status (2 is bad input): a script can branch on it.
EXIT_STATUS = {"fits": 0, "tight": 3, "does not fit": 1, "unknown": 0}


def register(sub) -> None:
    estimate_parser(sub).set_defaults(func=estimate_command, before_torch=check_input)
