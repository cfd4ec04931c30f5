"""GRPO on more than one rank (issue 45): each rank generates ``generation_batch_size /
num_processes`` rows, as TRL's own ``GRPOConfig.__post_init__`` resolves them.

The reference is TRL itself: a real ``trl.GRPOConfig`` built for world size 2 and 4 runs its
``__post_init__`` (``steps_per_generation = generation_batch_size // (per_device_train_batch_size
x num_processes)``), with ``num_processes`` read from ``TrainingArguments.world_size`` as TRL
reads it; only that property is given the launcher's answer (a real multi-process launch would
set it through accelerate's ``PartialState``). The estimate is made from the user's arguments
(``generation_batch_size`` given, ``steps_per_generation`` not), and must generate, per rank,
the rows TRL's resolved config makes each process generate.
"""

from __future__ import annotations

import re
import warnings

import pytest

from tests.helpers import require

require("trl")

import trl  # noqa: E402

import hf_memkit as mk  # noqa: E402
from tests.unit.trainers.test_sft_and_dpo import CFG, FP32  # noqa: E402

ARGS = dict(per_device_train_batch_size=2, num_generations=4, generation_batch_size=16,
            max_completion_length=16, **FP32)


def _trl_resolved(world: int, tmp_path) -> trl.GRPOConfig:
    class Launched(trl.GRPOConfig):
        @property
        def world_size(self) -> int:   # what accelerate's PartialState reports under a launcher
            return world

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return Launched(output_dir=str(tmp_path), use_cpu=True, report_to=[], **ARGS)


@pytest.mark.parametrize("world", [2, 4])
def test_grpo_generation_rows_per_rank_follow_trls_resolution(world, tmp_path):
    cfg = _trl_resolved(world, tmp_path)
    assert cfg.generation_batch_size == 16            # what the user asked, across all ranks
    rows = cfg.per_device_train_batch_size * cfg.steps_per_generation   # one process's share
    assert rows * world == cfg.generation_batch_size
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        e = mk.estimate_memory(CFG, dict(ARGS), seq_len=32, device="A100-80GB", trainer="grpo",
                               num_gpus=world)
    said = [int(m.group(1)) for n in e.notes if (m := re.match(r"generation: (\d+) rows", n))]
    assert said == [rows], (said, rows, e.notes)
    assert "generate (decode)" in e.phase_peaks   # traced at those rows
    # the whole estimate is TRL's resolved config's: given its steps_per_generation instead of
    # generation_batch_size, every phase comes out the same
    resolved = {k: v for k, v in ARGS.items() if k != "generation_batch_size"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        same = mk.estimate_memory(CFG, {**resolved, "steps_per_generation":
                                        cfg.steps_per_generation}, seq_len=32,
                                  device="A100-80GB", trainer="grpo", num_gpus=world)
    assert same.phase_peaks == e.phase_peaks
