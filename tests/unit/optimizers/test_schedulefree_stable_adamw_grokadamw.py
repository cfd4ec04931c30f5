"""Schedule-Free AdamW/RAdam/SGD, StableAdamW (torch-optimi) and GrokAdamW: state hand-computed
from each package's layout, then checked against what the real optimizer builds on CPU (its state
bytes after steps, and the peak of the extra tensors one ``step()`` allocates, measured by torch's
MemTracker)."""

from __future__ import annotations

import warnings

import pytest
import torch

from hf_memkit._optimizers import OptimizerContext, ParamInfo, get_optimizer_profile
from tests.helpers import require

BIG = ParamInfo(1000 * 256, (1000, 256), 4)
MID = ParamInfo(300 * 128, (300, 128), 4)
SMALL = ParamInfo(256, (256,), 4)
BIG_BF16 = ParamInfo(1000 * 256, (1000, 256), 2)
CPU = OptimizerContext("cpu")
CUDA = OptimizerContext("cuda")


def est(name, params, ctx=CPU):
    return get_optimizer_profile(name).estimate(params, ctx)


def test_schedule_free_hand_computed():
    for name in ("schedule_free_adamw", "schedule_free_radam"):
        m = est(name, [BIG, MID, SMALL])
        assert m.state == 2 * 4 * (256_000 + 38_400 + 256)        # z + exp_avg_sq, no step
        # denom of the no-decay group built while the decay group's denom is still bound
        assert m.transient == 4 * (256_000 + 38_400 + 256)
        assert est(name, [BIG, MID], CUDA).transient == 4 * (256_000 + 38_400)  # one group
    sgd = est("schedule_free_sgd", [BIG, SMALL])
    assert sgd.state == 4 * (256_000 + 256) and sgd.transient == 0          # z only


def test_stable_adamw_hand_computed():
    m = est("stable_adamw", [BIG, SMALL])
    assert m.state == 2 * 4 * (256_000 + 256) + 2 * 4       # exp_avg, exp_avg_sq + eps_sq each
    assert m.transient == 2 * BIG.nbytes                    # grad.pow(2) and maximum(), together
    bf16 = est("stable_adamw", [BIG_BF16])
    assert bf16.state == 3 * 2 * 256_000 + 2                # + kahan_comp for a bf16 param
    assert bf16.transient == 2 * 256_000 + 4 * 256_000      # ratio + mean()'s float32 copy
    # transformers: kahan_sum = bool(str); only an empty value switches it off
    off = OptimizerContext("cpu", {"kahan_sum": ""})
    assert est("stable_adamw", [BIG_BF16], off).state == 2 * 2 * 256_000 + 2
    assert est("stable_adamw", [BIG_BF16], OptimizerContext("cpu", {"kahan_sum": "False"})
               ).state == bf16.state
    cuda = est("stable_adamw", [BIG, BIG_BF16], CUDA)       # Triton: placeholders, no temporaries
    assert cuda.state == (2 * 4 * 256_000 + 4 + 1 + 4) + (3 * 2 * 256_000 + 2 + 4)
    assert cuda.transient == 0


def test_grokadamw_hand_computed():
    m = est("grokadamw", [BIG, MID, SMALL])
    assert m.state == 3 * 4 * (256_000 + 38_400 + 256)      # exp_avg, exp_avg_sq, grok_ema
    assert m.transient == 2 * BIG.nbytes                    # no param before BIG in its group
    assert est("grokadamw", [MID, BIG]).transient == MID.nbytes + 2 * BIG.nbytes
    cuda = est("grokadamw", [MID, BIG], CUDA)               # state on the host, copies per step
    assert cuda.state == 0
    assert cuda.transient == max(MID.nbytes + 5 * BIG.nbytes, 4 * MID.nbytes + 2 * BIG.nbytes)
    assert est("grokadamw", [BIG, MID], CUDA).transient == 5 * BIG.nbytes


def _make(name, params):
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.01},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    if name.startswith("schedule_free"):
        sf = require("schedulefree")
        cls = {"schedule_free_adamw": sf.AdamWScheduleFree,
               "schedule_free_radam": sf.RAdamScheduleFree,
               "schedule_free_sgd": sf.SGDScheduleFree}[name]
        opt = cls(groups, lr=1e-3)
        opt.train()                                         # as the Trainer does
        return opt
    if name == "stable_adamw":
        return require("optimi").StableAdamW(groups, lr=1e-3)
    return require("grokadamw").GrokAdamW(groups, lr=1e-3)


def _state_tensors(opt):
    found = [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v)]
    # GrokAdamW keeps its state in param_group["state"], not in optimizer.state
    found += [v for g in opt.param_groups for st in g.get("state", {}).values()
              for v in st.values() if torch.is_tensor(v)]
    return found


def _bytes(tensors):
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in tensors}.values())


NAMES = ["schedule_free_adamw", "schedule_free_radam", "schedule_free_sgd", "stable_adamw",
         "grokadamw"]
SHAPES = [[(300, 128), (128,)], [(64, 64), (500, 32), (32,), (7,)]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shapes", SHAPES, ids=["two", "four"])
@pytest.mark.parametrize("name", NAMES)
def test_state_and_step_temporaries_match_the_real_optimizer(name, shapes, dtype):
    from torch.distributed._tools.mem_tracker import MemTracker

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(*s, dtype=dtype)) for s in shapes]
    opt = _make(name, params)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # grokadamw: torch.cuda.amp.autocast deprecation
        for _ in range(6):  # RAdam's Adam phase (rho_t > 4) starts at step 5
            for p in params:
                p.grad = torch.randn_like(p)
            opt.step()
        infos = [ParamInfo(p.numel(), tuple(p.shape), p.element_size()) for p in params]
        predicted = est(name, infos)
        assert predicted.state == _bytes(_state_tensors(opt))

        for p in params:
            p.grad = torch.randn_like(p)
        mt = MemTracker()
        mt.track_external(*params, *[p.grad for p in params], *_state_tensors(opt), opt)
        with mt:
            start = mt.get_tracker_snapshot("current")[torch.device("cpu")]["Total"]
            opt.step()
    extra = mt.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"] - start
    if name == "stable_adamw" and dtype != torch.float32:
        # mean()'s float32 copy lives inside the kernel, unseen by MemTracker: measured by RSS
        # in test_stable_adamw_bf16_step_peak_by_rss; what MemTracker sees is the 2 x param
        extra += max(4 * p.numel() - p.numel() * p.element_size() for p in params)
    # StableAdamW's 0-d `rms` (4 bytes) is not modelled
    assert predicted.transient == pytest.approx(extra, abs=8)


_RSS_CHILD = """
import json, sys, torch, optimi
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
torch.set_num_threads(1)
p = torch.nn.Parameter(torch.randn(2_000_000, dtype=torch.bfloat16))
opt = optimi.StableAdamW([p], lr=1e-3)
peaks = []
for _ in range(3):
    p.grad = torch.randn_like(p)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = status("VmRSS")
    opt.step()
    peaks.append(status("VmHWM") - base)
print(json.dumps({"peak": min(peaks[1:])}))
"""


def test_stable_adamw_bf16_step_peak_by_rss():
    """An independent measurement (VmHWM with every large tensor its own mapping:
    docs/stack-facts.md#cpu-ground-truth) of the single-tensor CPU step of a bf16 param: 3 x
    the param, not MemTracker's 2 x."""
    import json
    import os
    import subprocess
    import sys

    require("optimi")
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1",
               PYTHONWARNINGS="ignore")
    out = subprocess.run([sys.executable, "-c", _RSS_CHILD], env=env, capture_output=True,
                         text=True, timeout=300, check=True).stdout
    measured = json.loads(out.strip().splitlines()[-1])["peak"]
    predicted = est("stable_adamw", [ParamInfo(2_000_000, (2_000_000,), 2)]).transient
    assert predicted == 3 * 4_000_000
    assert measured == pytest.approx(predicted, rel=0.03)


@pytest.mark.parametrize("optim,module,cls", [
    ("schedule_free_adamw", "schedulefree", "AdamWScheduleFree"),
    ("schedule_free_radam", "schedulefree", "RAdamScheduleFree"),
    ("schedule_free_sgd", "schedulefree", "SGDScheduleFree"),
    ("stable_adamw", "optimi", "StableAdamW"),
    ("grokadamw", "grokadamw", "GrokAdamW"),
])
def test_the_trainer_builds_the_modelled_class(optim, module, cls, tmp_path):
    from transformers import Trainer, TrainingArguments

    require(module)
    args = TrainingArguments(output_dir=str(tmp_path), optim=optim, use_cpu=True, report_to=[])
    got, _ = Trainer.get_optimizer_cls_and_kwargs(args)
    assert got.__name__ == cls and got.__module__.split(".")[0] == module
    prof = get_optimizer_profile(optim)
    assert prof.accelerate_class == f"{module}.{cls}"
