"""torchao 8/4-bit AdamW, GaLore and APOLLO: the real optimizer, built by the real
``Trainer.create_optimizer`` for a tiny Llama, takes one real step after a real backward; the
state it then holds (every tensor storage under ``optimizer.state``, the quantized subclasses'
codes / scales / qmaps and the GaLore / APOLLO projector matrices included) must equal the
prediction made from the config alone (hf_memkit's own model spec and argument reader). The
values refused (LOMO, AdaLOMO, the layerwise variants) must say why and list what is modelled."""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import LlamaConfig

from hf_memkit import HfMemkitError
from hf_memkit._model.spec import resolve_model
from hf_memkit._optimizers import OptimizerContext, get_optimizer_profile
from hf_memkit._setup.setup import normalize_args
from tests.helpers import require

# vocab 509: the embedding and LM head (509 x 128) are not a multiple of torchao's 256 block
CFG = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, vocab_size=509, tie_word_embeddings=False)


def _tensors(v):
    if torch.is_tensor(v):
        if hasattr(v, "__tensor_flatten__") and type(v) is not torch.nn.Parameter:
            names, _ = v.__tensor_flatten__()          # torchao OptimState8bit / OptimState4bit
            for n in names:
                yield from _tensors(getattr(v, n))
        else:
            yield v
    elif isinstance(v, (list, tuple)):
        for x in v:
            yield from _tensors(x)
    elif hasattr(v, "ortho_matrix"):                   # GaLore / APOLLO projector objects
        yield from _tensors(v.ortho_matrix)


def state_bytes(opt) -> int:
    """``real_state_bytes`` (test_adamw_bnb_adafactor_sgd.py), reaching into tensor subclasses and
    the projector objects kept in the state."""
    seen = {}
    for st in opt.state.values():
        for v in st.values():
            for t in _tensors(v):
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def _stepped(tmp_path, dtype, **args):
    """The Trainer's optimizer for a tiny Llama, after one forward, backward and step()."""
    from transformers import LlamaForCausalLM, Trainer, TrainingArguments

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**CFG)).to(dtype)
    ta = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], **args)
    trainer = Trainer(model=model, args=ta)
    opt = trainer.create_optimizer()
    ids = torch.randint(0, CFG["vocab_size"], (2, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt.step()
    return opt


def _predicted(dtype, device_kind="cpu", **args):
    _, trainable = resolve_model(LlamaConfig(**CFG), dtype=dtype).states()
    setup = normalize_args(dict(args))
    return get_optimizer_profile(setup.optim).estimate(
        trainable, OptimizerContext(device_kind, setup.optim_args))


CASES = [
    ("torchao 8bit", "torchao", dict(optim="adamw_torch_8bit")),
    ("torchao 4bit", "torchao", dict(optim="adamw_torch_4bit")),
    ("galore adamw", "galore_torch", dict(optim="galore_adamw",
                                          optim_target_modules=["self_attn", "mlp"])),
    ("galore adamw rank16 reverse", "galore_torch", dict(
        optim="galore_adamw", optim_target_modules="all-linear",
        optim_args="rank=16,proj_type=reverse_std")),
    ("galore adafactor", "galore_torch", dict(optim="galore_adafactor",
                                              optim_target_modules=["q_proj", "up_proj"],
                                              optim_args="rank=16")),
    ("apollo", "apollo_torch", dict(optim="apollo_adamw", optim_target_modules="all-linear",
                                    optim_args="rank=16")),
    ("apollo svd tensor", "apollo_torch", dict(
        optim="apollo_adamw", optim_target_modules=["mlp"],
        optim_args="rank=32,proj=svd,scale_type=tensor")),
]


# every case in fp32 and bf16 params, but torchao 4-bit in fp32 only (its compile time)
PARAMS = [(*c, dt) for c in CASES for dt in (torch.float32, torch.bfloat16)
          if not (c[0] == "torchao 4bit" and dt is torch.bfloat16)]


@pytest.mark.parametrize("name,module,args,dtype", PARAMS,
                         ids=[f"{p[0]}-{str(p[3])[6:]}" for p in PARAMS])
def test_state_matches_the_trainers_optimizer(name, module, args, dtype, tmp_path):
    require(module)
    opt = _stepped(tmp_path, dtype, **args)
    assert _predicted(dtype, **args).state == state_bytes(opt)


def test_galore_adamw_8bit_state_layout(tmp_path, monkeypatch):
    """GaLoreAdamW8bit.step calls torch.cuda.synchronize() (CUDA only); with that call made a
    no-op, bitsandbytes' CPU backend runs it, so its state layout is checked here too."""
    require("galore_torch")
    require("bitsandbytes")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    args = dict(optim="galore_adamw_8bit", optim_target_modules="all-linear",
                optim_args="rank=16")
    opt = _stepped(tmp_path, torch.float32, **args)
    # the two qmaps are shared tensors in every 8-bit param's state: counted once
    assert _predicted(torch.float32, "cuda", **args).state == state_bytes(opt)
    with pytest.raises(HfMemkitError, match="CUDA only"):
        _predicted(torch.float32, **args)


def test_low_rank_optimizers_need_target_modules():
    with pytest.raises(HfMemkitError, match="optim_target_modules"):
        _predicted(torch.float32, optim="galore_adamw")
    with pytest.raises(HfMemkitError, match="no nn.Linear module matches"):
        _predicted(torch.float32, optim="apollo_adamw", optim_target_modules=["nothing_here"])


@pytest.mark.parametrize("optim", ["lomo", "adalomo", "galore_adamw_layerwise",
                                   "galore_adamw_8bit_layerwise", "galore_adafactor_layerwise",
                                   "apollo_adamw_layerwise"])
def test_refused_optimizers_say_why_and_what_is_modelled(optim):
    with pytest.raises(HfMemkitError) as e:
        get_optimizer_profile(optim)
    msg = str(e.value)
    assert f"`{optim}`" in msg and "inside backward" in msg
    assert "modelled: " in msg
    for name in ("adamw_torch", "adamw_torch_8bit", "galore_adamw", "apollo_adamw"):
        assert name in msg
    with pytest.raises(HfMemkitError, match=f"`{optim}`"):
        normalize_args({"optim": optim})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name,module,args", [c for c in CASES if "torchao" not in c[0]],
                         ids=[c[0] for c in CASES if "torchao" not in c[0]])
def test_step_temporaries_match_memtracker(name, module, args, dtype, tmp_path):
    """The extra tensors one steady-state step allocates (no SVD / redraw: that runs every
    update_proj_gap steps), measured by torch's MemTracker, vs the predicted transient. The
    per-row / per-column norm vectors (a few KiB) are not modelled."""
    from torch.distributed._tools.mem_tracker import MemTracker

    require(module)
    opt = _stepped(tmp_path, dtype, **args)
    params = [p for g in opt.param_groups for p in g["params"]]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(2):
            for p in params:
                p.grad = torch.randn_like(p)
            opt.step()
        for p in params:
            p.grad = torch.randn_like(p)
        state = [t for st in opt.state.values() for v in st.values() for t in _tensors(v)]
        mt = MemTracker()
        mt.track_external(*params, *[p.grad for p in params], *state, opt)
        with mt:
            start = mt.get_tracker_snapshot("current")[torch.device("cpu")]["Total"]
            opt.step()
    extra = mt.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"] - start
    assert _predicted(dtype, **args).transient == pytest.approx(extra, rel=0.01)


# ----------------------------------------------------------------------------------------------
# the planner's 8-bit rung: bitsandbytes' AdamW, else torchao's (issue 14, item 5)
# ----------------------------------------------------------------------------------------------

def _install_torchao(root, monkeypatch, version="0.16.0"):
    """A torchao distribution on ``sys.path`` ahead of the installed one (its metadata and a
    package whose import fails, so that planning is seen not to import it)."""
    import sys

    for name in [m for m in sys.modules if m == "torchao" or m.startswith("torchao.")]:
        monkeypatch.delitem(sys.modules, name)      # imported by an earlier test: forgotten
    _clear_lookups()
    pkg = root / "torchao"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise ImportError('hf_memkit imported torchao')\n")
    info = root / f"torchao-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torchao\nVersion: {version}\n")
    monkeypatch.syspath_prepend(str(root))


@pytest.fixture
def without_bitsandbytes(monkeypatch):
    """bitsandbytes made unimportable (``sys.modules[name] = None`` is what ``import`` and
    ``find_spec`` read as absent), with hf_memkit's cached lookup cleared around the test."""
    import sys

    from hf_memkit._compat import _has

    monkeypatch.setitem(sys.modules, "bitsandbytes", None)
    _has.cache_clear()
    yield
    monkeypatch.undo()
    _clear_lookups()


def _clear_lookups():
    from hf_memkit._compat import _has

    _has.cache_clear()


def test_planner_searches_torchao_8bit_when_bitsandbytes_is_absent(
        tmp_path, monkeypatch, without_bitsandbytes):
    import sys

    from hf_memkit._optimizers import planner_optimizers

    # neither 8-bit library: no 8-bit rung
    monkeypatch.setitem(sys.modules, "torchao", None)
    for kind in ("cpu", "cuda"):
        assert not {"adamw_bnb_8bit", "adamw_torch_8bit"} & set(planner_optimizers(kind))
    _install_torchao(tmp_path, monkeypatch)
    cpu, cuda, mps = (planner_optimizers(k) for k in ("cpu", "cuda", "mps"))
    assert "adamw_torch_8bit" in cpu and "adamw_torch_8bit" in cuda
    assert "adamw_bnb_8bit" not in cpu + cuda
    assert "adamw_torch_8bit" not in mps              # torchao tests CPU and CUDA only
    # the rung sits where bitsandbytes' did: after fused AdamW, before Adafactor
    assert cpu.index("adamw_torch_fused") < cpu.index("adamw_torch_8bit") < cpu.index("adafactor")
    assert "adamw_torch_4bit" not in cpu + cuda       # only when pinned
    assert "torchao" not in sys.modules               # found, never imported


def test_planner_skips_a_torchao_older_than_transformers_requires(
        tmp_path, monkeypatch, without_bitsandbytes):
    from transformers.utils.import_utils import TORCHAO_MIN_VERSION

    from hf_memkit._optimizers import planner_optimizers

    major, minor, *_ = TORCHAO_MIN_VERSION.split(".")
    _install_torchao(tmp_path, monkeypatch, version=f"{major}.{int(minor) - 1}.0")
    assert "adamw_torch_8bit" not in planner_optimizers("cpu")


def test_planner_never_searches_both_8bit_adamws(tmp_path, monkeypatch):
    from hf_memkit._optimizers import planner_optimizers

    require("bitsandbytes")                          # installed here: it wins
    _install_torchao(tmp_path, monkeypatch)
    for kind in ("cpu", "cuda"):
        found = planner_optimizers(kind)
        assert "adamw_bnb_8bit" in found and "adamw_torch_8bit" not in found
