"""Step time of a small model on CPU with and without MemoryCallback + ThroughputCallback.

    python bench/callback_overhead.py [--repeats 7] [--steps 40] [--json PATH] [--quick]

One process; the two conditions alternate (ABBA order) so drift hits both alike. Each run
trains ``--steps`` optimizer steps with ``logging_steps=10``; its step time is the mean time
between consecutive ``on_step_begin`` calls after ``--warmup`` steps (logging steps included,
which is where the callbacks do their work). Reported: the median over repeats of the ratio
with/without. Bar (docs/quality-bars.md): <= 1% overhead, reported (exit status 0 either way).
``--quick``: 1 repeat of 6 steps after 2, no warm-up runs (a check that it runs, not a
measurement).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch
from _quick import add_flag, guard
from transformers import LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

from hf_memkit._run.synthetic import SyntheticTextDataset, tiny_llama_config
from hf_memkit.callbacks import MemoryCallback, ThroughputCallback


class StepClock(TrainerCallback):
    def __init__(self):
        self.t: list[float] = []

    def on_step_begin(self, args, state, control, **kwargs):
        self.t.append(time.perf_counter())

    def on_train_end(self, args, state, control, **kwargs):
        self.t.append(time.perf_counter())


def run_once(model_state, cfg, data, *, with_callbacks: bool, steps: int, warmup: int) -> float:
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    model.load_state_dict(model_state)
    clock = StepClock()
    callbacks = [clock]
    if with_callbacks:
        callbacks += [MemoryCallback(plot=False, report=False), ThroughputCallback()]
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, max_steps=steps, per_device_train_batch_size=8,
                                 logging_steps=10, report_to=[], use_cpu=True, save_strategy="no",
                                 disable_tqdm=True, dataloader_num_workers=0)
        trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks)
        trainer.callback_handler.callbacks.insert(0, trainer.callback_handler.pop_callback(clock))
        trainer.train()
    t = clock.t[warmup:]
    return (t[-1] - t[0]) / (len(t) - 1)


def main(argv: list[str] | None = None) -> int:
    """Measure the step time with and without the callbacks; print and write ``--json``.

    Args:
        argv: the command line (default ``sys.argv[1:]``).

    Returns:
        The exit status: 0 (the bar is reported, not gated).
    """
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--json", help="write the per-repeat times and the median ratio here")
    add_flag(p)
    a = p.parse_args(argv)
    guard(a.quick, a.json, "--json")
    if a.quick:
        a.repeats, a.steps, a.warmup = 1, 6, 2
    import logging

    log = logging.getLogger("hf_memkit")
    level = log.level
    log.setLevel(logging.ERROR)  # the one CPU "no MFU peak" warning
    try:
        return _measure(a)
    finally:
        log.setLevel(level)  # an in-process caller keeps its own


def _measure(a: argparse.Namespace) -> int:
    cfg = tiny_llama_config(hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                            num_attention_heads=8, num_key_value_heads=4, vocab_size=2048)
    torch.manual_seed(0)
    state = LlamaForCausalLM(cfg).state_dict()
    data = SyntheticTextDataset(vocab_size=2048, seq_len=128, num_samples=8 * a.steps)
    for c in () if a.quick else (False, True):  # warm-up, discarded: the first run in a
        # process pays one-off costs
        run_once(state, cfg, data, with_callbacks=c, steps=a.warmup + 5, warmup=a.warmup)
    ratios, off_all, on_all = [], [], []
    for r in range(a.repeats):
        order = (False, True) if r % 2 == 0 else (True, False)
        times = {c: run_once(state, cfg, data, with_callbacks=c, steps=a.steps, warmup=a.warmup)
                 for c in order}
        off_all.append(times[False])
        on_all.append(times[True])
        ratios.append(times[True] / times[False])
        print(f"repeat {r}: without {times[False] * 1e3:.2f} ms/step, with "
              f"{times[True] * 1e3:.2f} ms/step, ratio {ratios[-1]:.4f}", flush=True)
    med = statistics.median(ratios)
    print(f"\nstep time without callbacks: median {statistics.median(off_all) * 1e3:.2f} ms; "
          f"with: {statistics.median(on_all) * 1e3:.2f} ms")
    print(f"median ratio with/without over {a.repeats} repeats: {med:.4f} "
          f"({(med - 1) * 100:+.2f}% overhead; bar <= +1%)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"quick": a.quick, "steps": a.steps, "warmup": a.warmup,
                       "repeats": [{"without_s": off, "with_s": on, "ratio": r}
                                   for off, on, r in zip(off_all, on_all, ratios, strict=True)],
                       "median_ratio": med, "bar_met": med <= 1.01}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
