"""Probing a GPU machine under the real rules (issue 25): NVML's PCI order against CUDA's
order, full UUIDs against prefixes, MIG permissions, a context per rank, and what this process
already holds. Each test failed on the code before the fix; ``tests.fakes`` follows NVML's and
CUDA's rules, not this project's."""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import LlamaConfig

import hf_memkit as mk
from hf_memkit._estimate.budget import memory_budget
from hf_memkit._units import GiB, MiB
from tests.fakes import a100, mig_uuid_of, t4, uuid_of
from tests.fakes.machine import Process

# --- defect 3: the wrong card on mixed machines ----------------------------------------------

def test_cuda_device_0_is_the_a100_even_when_the_t4_is_first_on_the_pci_bus(machine):
    m = machine([t4(0x07, 0), a100(0x41, 1)])
    dev = mk.probe_device(0)     # CUDA's FASTEST_FIRST order: the A100
    assert (dev.name, dev.compute_capability) == ("NVIDIA A100-SXM4-80GB", (8, 0))
    assert dev.total_memory == m.gpus[1].total and dev.source == "nvml"
    assert dev.catalog_name == "A100-80GB"


@pytest.mark.parametrize("order, visible, expect", [
    (None, "1", "Tesla T4"),                  # "1" indexes CUDA's order, not NVML's
    ("PCI_BUS_ID", None, "Tesla T4"),         # CUDA in PCI order: device 0 is the T4
    ("PCI_BUS_ID", "1", "NVIDIA A100-SXM4-80GB"),
])
def test_cuda_visible_devices_indexes_cudas_order(machine, monkeypatch, order, visible, expect):
    m = machine([t4(0x07, 0), a100(0x41, 1)])
    if order:
        monkeypatch.setenv("CUDA_DEVICE_ORDER", order)
    if visible:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    dev = mk.probe_device(0)
    gpu = next(g for g in m.gpus if g.name == expect)
    assert dev.name == expect == torch.cuda.get_device_properties(0).name
    assert dev.total_memory == gpu.total and dev.source == "nvml"


# --- defect 2: UUID prefixes and MIG without root ---------------------------------------------

def test_a_uuid_prefix_in_cuda_visible_devices_finds_the_nvml_device(machine, monkeypatch,
                                                                      caplog):
    m = machine([a100(0x07, 0), a100(0x41, 1)])
    m.spawn(777, uuid_of(1), 30 * GiB)             # another job on the second card
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", uuid_of(1)[:32])   # unique: CUDA accepts it
    with caplog.at_level("WARNING"):
        dev = mk.probe_device(0)
    assert dev.source == "nvml" and not caplog.records
    assert dev.free_memory == m.free(m.gpus[1]) < 50 * GiB


def test_a_mig_slice_without_root_is_measured_through_its_own_handle(machine, monkeypatch,
                                                                     caplog):
    m = machine([a100(0x07, 0, migs=[("3g.40gb", 40 * GiB), ("3g.40gb", 40 * GiB)])])
    assert not m.root
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", mig_uuid_of(0, 1)[:24])
    m.spawn(555, mig_uuid_of(0, 1), 6 * GiB)       # a neighbour inside the same slice
    with caplog.at_level("WARNING"):
        dev = mk.probe_device(0)
    assert not caplog.records
    assert (dev.mig, dev.source) == (True, "nvml")
    assert dev.name == "NVIDIA A100-SXM4-80GB MIG 3g.40gb"
    assert (dev.total_memory, dev.free_memory) == (40 * GiB, 34 * GiB)
    assert dev.driver_version == m.driver


# --- defect 4: a context on GPU 0 in every rank ------------------------------------------------

@pytest.mark.parametrize("nvml", [True, False])
def test_a_rank_probes_its_own_device_and_opens_no_context_on_gpu_0(machine, monkeypatch, nvml):
    m = machine([a100(0x07, 0), a100(0x41, 1), a100(0x81, 2), a100(0xC1, 3)])
    if not nvml:
        monkeypatch.setitem(__import__("sys").modules, "pynvml", None)
    monkeypatch.setenv("LOCAL_RANK", "2")
    dev = mk.probe_device()
    assert dev.index == 2
    assert uuid_of(0) not in m.this.context             # GPU 0 untouched by rank 2
    # NVML answers without a context; torch's mem_get_info needs one, on the rank's own GPU
    assert set(m.this.context) == (set() if nvml else {uuid_of(2)})


# --- defect 5: what this process holds is counted twice -----------------------------------------

def test_memory_this_process_holds_counts_as_usable_by_its_run(machine):
    m = machine([a100(0x07, 0)])
    m.spawn(901, uuid_of(0), 10 * GiB)                  # another tenant
    before = mk.probe_device()
    m.cuda.allocate(14 * GiB)                           # the model moved to the GPU
    after = mk.probe_device()
    assert after.own_memory == m.context_bytes + 14 * GiB
    assert after.free_memory == before.free_memory - after.own_memory
    budget = memory_budget(after, headroom=0.05, this_machine=True)
    assert budget.bytes == memory_budget(before, headroom=0.05, this_machine=True).bytes
    assert budget.bytes == m.gpus[0].total - m.gpus[0].reserved - 10 * GiB  # the tenant's, not ours
    assert after.others_memory == 10 * GiB and "other processes hold 10.00 GiB" in budget.basis


# --- defect 1: DDP ranks plan different setups ------------------------------------------------

TINY = LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, vocab_size=4000,
                   tie_word_embeddings=False)


def _plan(device=None):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p = mk.plan_training(TINY, seq_len=1024, target_batch_size=64, device=device,
                             headroom=0.0)
    c = p.chosen
    return c.method, c.precision, c.checkpointing, c.micro_batch, c.grad_accum


def test_ranks_plan_the_same_setup_whether_or_not_rank_0_loaded_its_model(machine, monkeypatch):
    m = machine([a100(0x07, 0), a100(0x41, 1)])
    for k in range(2):    # the GPUs are shared: 3 GiB left on each for this job
        m.spawn(600 + k, uuid_of(k), m.free(m.gpus[k]) - 3 * GiB)
    rank0, rank1 = m.this, Process(m.this.pid + 1)
    monkeypatch.setenv("LOCAL_RANK", "0")
    m.cuda.allocate(1536 * MiB)                          # rank 0 has loaded its model
    chosen0 = _plan()
    m.become(rank1)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert _plan() == chosen0
    # what every rank got before: GPU 0, after rank 0 loaded its model, counted as used
    assert _plan(mk.probe_device(0).replace(own_memory=0)) != chosen0
    assert rank0.context and uuid_of(0) not in rank1.context


# --- defect 9: one process on a multi-GPU machine becomes nn.DataParallel ----------------------

@pytest.mark.parametrize("env, expect", [
    ({}, "0"),                                      # CUDA's first device, and only it
    ({"CUDA_VISIBLE_DEVICES": "1,0"}, "1"),          # the first the user listed
    ({"CUDA_VISIBLE_DEVICES": "1"}, None),           # already one
    ({"WORLD_SIZE": "2", "LOCAL_RANK": "1"}, None),  # torchrun: each rank has its device
])
def test_one_process_is_pinned_to_one_gpu(machine, monkeypatch, env, expect):
    from hf_memkit._device.probe import pin_one_device

    machine([a100(0x07, 0), a100(0x41, 1)])
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert pin_one_device() == expect
    assert torch.cuda.device_count() == (2 if "WORLD_SIZE" in env else 1)


def test_hf_memkit_train_pins_one_gpu_before_it_trains(machine, monkeypatch):
    from hf_memkit.commands import train as train_cmd
    from hf_memkit.commands.main import main

    machine([a100(0x07, 0), a100(0x41, 1)])
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    seen = {}

    def run_train(recipe, **kw):
        seen["visible"], seen["count"] = (__import__("os").environ.get("CUDA_VISIBLE_DEVICES"),
                                          torch.cuda.device_count())
        return 0

    monkeypatch.setattr(train_cmd, "run_train", run_train)
    monkeypatch.setattr(train_cmd, "reexec_with_mmap_threshold", lambda ref: None)
    assert main(["train", "9m_sft_cpu"]) == 0
    assert seen == {"visible": "0", "count": 1}


def test_a_one_gpu_plan_on_a_two_gpu_process_warns_about_data_parallel(machine, monkeypatch):
    machine([a100(0x07, 0), a100(0x41, 1)])
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.warns(UserWarning, match=r"sees 2 GPUs and was not started by torchrun.*"
                                         r"nn\.DataParallel"):
        p = mk.plan_training(TINY, seq_len=256, target_batch_size=8)
    assert any("nn.DataParallel" in n for n in p.notes)


def test_in_a_container_nvml_shows_host_pids_and_this_process_is_not_guessed(machine):
    """A container with its own PID namespace: NVML lists this process under its host pid.
    Its entry cannot be told from another tenant's, so neither is claimed; what torch holds
    (reserved) is this process's, and the budget stays on the safe side of it."""
    m = machine([a100(0x07, 0)])
    m.cuda.allocate(6 * GiB)
    m.this.pid = 2_000_000                               # the host's pid for this process
    m.spawn(901, uuid_of(0), 10 * GiB)
    dev = mk.probe_device()
    assert dev.others_memory is None
    assert dev.own_memory == torch.cuda.memory_reserved(0) == 6 * GiB   # the context unknown
