"""Launching a plan, and the communication time per step the cost model charges."""

from __future__ import annotations

from .base import ENGINES, Sharding

# Inter-node links when a plan spans nodes: InfiniBand NDR 400 Gb/s per GPU (DGX H100 has one
# 400 Gb/s NIC per GPU), the usual fabric for multi-node training. Bytes/s, one direction.
INTER_NODE_BANDWIDTH = 50e9
# PCIe 4 x16, one direction: the host round trip of offloaded states.
PCIE_BANDWIDTH = 25e9


def launch_commands(*, script: str, num_gpus: int, num_nodes: int, engine: str,
                    config_file: str | None = None) -> dict[str, str]:
    """``accelerate launch`` and ``torchrun`` command lines for one node and for several."""
    per_node = num_gpus // max(1, num_nodes)
    acc = ["accelerate launch"]
    e = ENGINES.get(engine) if engine in ENGINES else None
    if e is not None and e.sharded:   # the engine's flags (and DeepSpeed's config file)
        acc.append(e.launch_flags(config_file))
    elif num_gpus > 1:                # replicas
        acc.append(next(r for r in ENGINES if r.replicates).launch_flag)
    acc.append(f"--num_processes {num_gpus}")
    if num_nodes > 1:
        acc.append(f"--num_machines {num_nodes} --machine_rank $NODE_RANK "
                   "--main_process_ip $MASTER_ADDR --main_process_port 29500")
    tr = [f"torchrun --nproc_per_node {per_node}"]
    if num_nodes > 1:
        tr.append(f"--nnodes {num_nodes} --node_rank $NODE_RANK --rdzv_backend c10d "
                  "--rdzv_endpoint $MASTER_ADDR:29500")
    return {"accelerate": " ".join(acc + [script]), "torchrun": " ".join(tr + [script])}


def comm_bytes_per_step(sh: Sharding, *, n_params: int, n_trainable: int, grad_accum: int,
                        mixed_precision: bool) -> float:
    """Bytes each rank sends per optimizer step (ring collectives: (N-1)/N of the payload).

    DDP: one all-reduce of the gradients per step (2x payload); ZeRO-1/2 reduce every
    micro-step. FSDP full shard / ZeRO-3: all-gather of the parameters in forward and again in
    backward, reduce-scatter of the gradients, per micro-step (3x); shard-grad-op gathers once.
    Offload adds host transfers (PCIe), counted by ``comm_seconds``."""
    if sh.world_size <= 1:
        return 0.0
    return ENGINES.get(sh.engine).comm_bytes_per_step(
        sh, n_params=n_params, n_trainable=n_trainable, grad_accum=grad_accum,
        mixed_precision=mixed_precision)


def comm_seconds(sh: Sharding, *, n_params: int, n_trainable: int, grad_accum: int,
                 mixed_precision: bool, intra_bw: float | None, num_nodes: int) -> float:
    """Seconds of communication per optimizer step that compute does not hide (assumed: half
    of it overlaps, as DDP buckets and FSDP prefetching overlap with compute)."""
    vol = comm_bytes_per_step(sh, n_params=n_params, n_trainable=n_trainable,
                              grad_accum=grad_accum, mixed_precision=mixed_precision)
    if vol == 0:
        return 0.0
    bw = (intra_bw or 32e9) / 2  # catalog figures are bidirectional
    if num_nodes > 1:
        bw = min(bw, INTER_NODE_BANDWIDTH)
    t = vol / bw
    if sh.offload_params or sh.offload_optimizer:
        t += 2 * n_params * 4 / max(1, sh.world_size) / PCIE_BANDWIDTH
    return 0.5 * t
