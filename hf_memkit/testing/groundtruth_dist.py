"""An independent multi-process CPU measurement of per-rank peak tensor memory
(docs/stack-facts.md#cpu-ground-truth, issue 7).

Never used by the estimator; it checks the per-rank (sharding) estimates. ``nproc`` ranks run on
this machine under ``torchrun`` with the gloo backend, each started with
``MALLOC_MMAP_THRESHOLD_=65536`` and ``OMP_NUM_THREADS=1``; each rank measures its own peak with
the same window as :mod:`hf_memkit.testing.groundtruth` (sum of the CPU tensor storages alive when
the window opens, ``VmHWM`` reset through ``/proc/self/clear_refs``, peak ``VmHWM - VmRSS_open +
alive_open``, steady steps ``>= 2``) and writes a JSON file that the parent gathers.

Modes (``spec["mode"]``):

``"ddp"``
    The real ``transformers.Trainer`` (``use_cpu=True``, ``ddp_backend="gloo"``), which wraps
    the model in ``DistributedDataParallel`` itself (accelerate's ``MULTI_CPU`` path, with the
    Trainer's ``find_unused_parameters`` default). DDP's reducer keeps one flat gradient bucket
    per ~25 MiB (``bucket_cap_mb``) in C++, separate from ``param.grad`` because accelerate's
    ``DistributedDataParallelKwargs.gradient_as_bucket_view`` defaults to False: those bytes are
    alive at every window opening but invisible to a gc walk, so they are added from the
    reducer's own logging data (``_get_ddp_logging_data()["bucket_sizes"]``).

``"fsdp2"``
    FSDP2 (``torch.distributed.fsdp.fully_shard``) applied by accelerate's own code, the path the
    Trainer takes on CUDA for ``fsdp=True, fsdp_config={"version": 2, ...}``:
      * ``TrainingArguments(fsdp=True, fsdp_config=...)`` builds ``fsdp_plugin_args``;
        ``accelerate.utils.FullyShardedDataParallelPlugin(**fsdp_plugin_args)`` is built from
        them as ``Trainer.create_accelerator_and_postprocess`` does, and
        ``plugin.set_mixed_precision(args.mixed_precision)`` is called as
        ``accelerate.state.AcceleratorState`` does for ``bf16=True``: a
        ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16, output_dtype=bf16)``;
      * ``accelerate.utils.fsdp_utils.fsdp2_apply_ac`` (when ``activation_checkpointing``) and
        ``fsdp2_prepare_model`` are then called as-is (``Accelerator._prepare_fsdp2``), with a
        stand-in for the ``Accelerator`` that carries only the plugin, ``mixed_precision`` and
        ``torch_device_mesh=None``. In accelerate 1.15 that shards, bottom-up, every module of the
        ``transformer_layer_cls_to_wrap`` classes with the plugin's ``reshard_after_forward``;
        then the input embedding on its own (untied weights); then ``[final norm, lm_head]`` as
        one group with ``reshard_after_forward=False``; then the root with torch's default
        (``None``: the root does not reshard after forward). Mixed precision upcasts trainable
        low-precision parameters to fp32 first (master weights). No autocast is added: with
        FSDP2 ``Accelerator.prepare`` never calls ``prepare_model``, and the Trainer's
        ``autocast_smart_context_manager`` is a null context;
      * the one CPU-only change: the plugin's ``CPUOffloadPolicy()`` pins memory, which needs an
        accelerator, so offload uses ``CPUOffloadPolicy(pin_memory=False)``. On a CPU-only machine
        "device" and host are the same memory, so offload changes the mechanics, not the total;
      * the optimizer is the Trainer's (``Trainer.get_optimizer_cls_and_kwargs``: default
        ``adamw_torch_fused``, which works on CPU with DTensor parameters in torch 2.13), built on
        the sharded parameters (accelerate builds it first and swaps the parameters in;
        same tensors). The loop follows the Trainer's: the step's micro-batches fetched first,
        forward with labels, ``loss / accumulation`` backward, ``set_requires_gradient_sync(False)``
        on all but the last micro-batch (accelerate's ``no_sync`` for FSDP2; on none where the
        args' ``accelerator_config`` has ``gradient_accumulation_kwargs.sync_each_batch``),
        ``clip_grad_norm_(max_grad_norm)`` when > 0, ``optimizer.step()``,
        ``zero_grad(set_to_none=True)``. The learning rate is constant (a schedule holds no memory).

``"tp"``, ``"sp"``
    Tensor parallelism (transformers' ``DistributedConfig(tp_size=N)``, the Trainer's steps) and
    DeepSpeed Ulysses sequence parallelism (the real Trainer): see
    :mod:`hf_memkit.testing._parallel_worker`, which also records why context parallelism has no
    mode (torch 2.13 has no CP rule for the CPU SDPA kernel). Modes ``"sp"`` and ``"deepspeed"``
    need ``spec["deepspeed"]``.

FSDP through the Trainer needs CUDA: on CPU, accelerate's ``AcceleratorState`` only keeps an
``fsdp_plugin`` for GPU-like distributed types, so ``Trainer(args=TrainingArguments(fsdp=True,
fsdp_config=..., use_cpu=True))`` under torchrun silently trains plain DDP on full replicas
(``trainer.is_fsdp_enabled`` False, ``DistributedType.MULTI_CPU``). That is why the rank worker
(:mod:`hf_memkit.testing._dist_worker`) calls accelerate's FSDP2 preparation itself.

Each rank gets different data: DDP through the Trainer's distributed sampler, FSDP2 seeded by rank.

This module is the launcher (the parent process); what runs inside each rank is
:mod:`hf_memkit.testing._dist_worker`.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
from typing import Any

_MODES = ("ddp", "fsdp2", "deepspeed", "tp", "sp")
# the folder each rank writes its pid<rank> and rank<rank>.json into
OUT_ENV = "HF_MEMKIT_DIST_OUT"
WORKER_MODULE = "hf_memkit.testing._dist_worker"


def measure_distributed_peak(spec: dict[str, Any], *, nproc: int = 2,
                             timeout: float = 600.0) -> dict[str, Any]:
    """Train ``nproc`` gloo ranks on this CPU under torchrun; return each rank's measured peak.

    ``spec``: ``mode`` ("ddp" | "fsdp2" | "deepspeed" | "tp" | "sp"), ``config``
    (``PretrainedConfig.to_dict()``), ``seq_len``, optional ``steps`` (3; steady steps are
    ``>= 2``), ``task`` ("causal-lm"), ``dtype`` ("float32"), ``attn_implementation``,
    ``learnable`` (False: random tokens; True: counting sequences a model can learn), ``args``
    (TrainingArguments fields: ``per_device_train_batch_size``, ``gradient_accumulation_steps``,
    ``optim``, ``learning_rate``, ``max_grad_norm``, ``bf16``, ...). ``micro_batch`` is accepted
    as a shorthand for ``per_device_train_batch_size``. For ``"fsdp2"`` also ``fsdp``:
    ``reshard_after_forward`` (True), ``offload`` (False), ``mixed_precision`` (None | "bf16"),
    ``activation_checkpointing`` (False), ``transformer_layer_cls_to_wrap`` (the model's
    ``_no_split_modules``).

    Returns ``{"mode", "nproc", "peak" (max over ranks), "losses" (per optimizer step, mean over
    ranks), "ranks": [...]}``; each rank: ``rank``, ``world_size``, ``peak`` (its largest steady
    step), ``steps`` (per step: ``peak``, ``alive_open``, ``seconds``, ``grad_bytes``),
    ``local_param_bytes`` / ``local_grad_bytes`` / ``local_optimizer_bytes`` (what this rank
    holds: DTensor local shards under FSDP2), ``full_param_bytes``, ``optimizer_impl``,
    ``data_digest`` (its first batch), and ``ddp`` (buckets, ``param_digest`` before/after) or
    ``fsdp`` (the FSDP units and their ``reshard_after_forward``, policies).
    Raises ``ValueError`` on a bad spec and ``RuntimeError`` (with the ranks' stderr tail) when
    the run fails.
    """
    _check_spec(spec, nproc)
    spec = dict(spec)
    if "micro_batch" in spec:
        spec["args"] = {**spec.get("args", {}),
                        "per_device_train_batch_size": int(spec.pop("micro_batch"))}
    env = dict(os.environ)
    env.update(MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1",
               TRANSFORMERS_VERBOSITY="error", TOKENIZERS_PARALLELISM="false",
               PYTHONWARNINGS="ignore")
    for attempt in range(2):  # a free port can be taken between the probe and torchrun's bind
        proc, ranks = _launch(spec, nproc, env, timeout)
        if proc.returncode == 0 and len(ranks) == nproc:
            break
        if attempt or "address already in use" not in proc.stderr.lower():
            raise RuntimeError(
                f"distributed measurement ({spec['mode']}, {nproc} ranks) failed: torchrun exit "
                f"{proc.returncode}, {len(ranks)} of {nproc} ranks reported; stderr tail:\n"
                f"{proc.stderr[-4000:]}")
    n_steps = min(len(r["losses"]) for r in ranks)
    losses = [sum(r["losses"][i] for r in ranks) / nproc for i in range(n_steps)]
    return {"mode": spec["mode"], "nproc": nproc, "peak": max(r["peak"] for r in ranks),
            "losses": losses, "ranks": ranks}


def _launch(spec: dict[str, Any], nproc: int, env: dict[str, str],
            timeout: float) -> tuple[subprocess.CompletedProcess, list[dict[str, Any]]]:
    with tempfile.TemporaryDirectory(prefix="hf_memkit_dist_") as out:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
               "--nproc_per_node", str(nproc), "--master_addr", "127.0.0.1",
               "--master_port", str(_free_port()), "--module", WORKER_MODULE,
               json.dumps(spec)]
        log_path = os.path.join(out, "torchrun.log")
        with open(log_path, "w") as log:  # a file, not a pipe: nothing can block on reading it
            popen = subprocess.Popen(cmd, env={**env, OUT_ENV: out}, stdout=log,
                                     stderr=subprocess.STDOUT, text=True)
            try:
                popen.wait(timeout=timeout)
                timed_out = False
            except subprocess.TimeoutExpired:
                _stop(popen, out)
                timed_out = True
        with open(log_path, errors="replace") as log:
            output = log.read()
        if timed_out:
            raise RuntimeError(f"distributed measurement ({spec['mode']}, {nproc} ranks) timed "
                               f"out after {timeout:.0f} s; output tail:\n{output[-3000:]}")
        ranks = []
        for r in range(nproc):
            path = os.path.join(out, f"rank{r}.json")
            if os.path.exists(path):
                with open(path) as f:
                    ranks.append(json.load(f))
    return subprocess.CompletedProcess(cmd, popen.returncode, "", output), ranks


def _stop(popen: subprocess.Popen, out: str) -> None:
    """End a torchrun that ran past its time and the ranks it started (each in its own session).

    SIGTERM lets torchrun's agent stop its workers; ranks still alive after that (recorded in
    ``pid<rank>`` files when they start) and torchrun itself are then killed.
    """
    popen.terminate()
    try:
        popen.wait(timeout=15)
    except subprocess.TimeoutExpired:
        popen.kill()
        popen.wait()
    for name in os.listdir(out):
        if name.startswith("pid"):
            try:
                with open(os.path.join(out, name)) as f:
                    os.kill(int(f.read()), signal.SIGKILL)
            except (OSError, ValueError):  # already gone
                pass


def _check_spec(spec: dict[str, Any], nproc: int) -> None:
    problems = []
    if spec.get("mode") not in _MODES:
        problems.append(f"mode {spec.get('mode')!r} is not one of {', '.join(_MODES)}")
    for key in ("config", "seq_len"):
        if key not in spec:
            problems.append(f"missing `{key}`")
    if not isinstance(nproc, int) or nproc < 1:
        problems.append(f"nproc must be a positive int, got {nproc!r}")
    if spec.get("mode") == "deepspeed" and not isinstance(spec.get("deepspeed"), dict):
        problems.append("mode='deepspeed' needs `deepspeed`: a DeepSpeed config dict (its "
                        "zero_optimization, bf16 and bucket sizes; batch sizes are filled in)")
    if spec.get("mode") == "sp" and not isinstance(spec.get("deepspeed"), dict):
        problems.append("mode='sp' needs `deepspeed`: a DeepSpeed config dict (Ulysses runs "
                        "under DeepSpeed; batch sizes and clipping are the Trainer's 'auto')")
    if spec.get("mode") == "sp" and isinstance(nproc, int) and nproc > 0 and isinstance(
            spec.get("seq_len"), int) and spec["seq_len"] % nproc:
        problems.append(f"mode='sp' shards the sequence: seq_len {spec['seq_len']} must be a "
                        f"multiple of nproc {nproc}")
    if spec.get("mode") == "sp" and (spec.get("args") or {}).get("bf16"):
        problems.append("mode='sp' runs the Trainer without use_cpu (Ulysses needs it), and "
                        "TrainingArguments(bf16=True) refuses a CPU-only machine without use_cpu")
    if spec.get("mode") == "ddp" and spec.get("fsdp"):
        problems.append("`fsdp` options need mode='fsdp2'")
    known = ("version", "reshard_after_forward", "offload", "mixed_precision",
             "activation_checkpointing", "transformer_layer_cls_to_wrap")
    unknown = set(spec.get("fsdp") or {}) - set(known)
    if unknown:
        problems.append(f"unknown fsdp option(s) {sorted(unknown)}; known: {', '.join(known)}")
    if (spec.get("fsdp") or {}).get("version", 2) not in (1, 2):
        problems.append(f"fsdp version {spec['fsdp']['version']!r}: 1 (FSDP1) or 2 (FSDP2)")
    mp = (spec.get("fsdp") or {}).get("mixed_precision")
    if mp not in (None, "no", "bf16"):
        problems.append(f"fsdp mixed_precision {mp!r}: CPU supports None or 'bf16'")
    if problems:
        raise ValueError("bad distributed measurement spec: " + "; ".join(problems))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
