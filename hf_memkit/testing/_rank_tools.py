"""What a measuring rank counts, shared by the rank workers (``_dist_worker``,
``_parallel_worker``): bytes a rank holds of a tensor (a DTensor's local shard), of an
optimizer's state, a digest of tensors, and the synthetic examples a case trains on."""

from __future__ import annotations

import hashlib
from typing import Any

from .models import synthetic_examples


def tensor_bytes(t) -> int:
    """Bytes this rank holds for ``t``: the local shard of a DTensor, else the tensor itself."""
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


def optimizer_bytes(optimizer) -> int:
    import torch

    return sum(tensor_bytes(v) for st in optimizer.state.values() for v in st.values()
               if isinstance(v, torch.Tensor))


def digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def digesting_collate(seen: list[str]):
    """A data collator that stacks the examples and records each batch's token digest in
    ``seen`` (which batches a rank trained on)."""
    import torch

    def collate(xs):
        batch = {k: torch.stack([x[k] for x in xs]) for k in xs[0]}
        seen.append(digest([batch["input_ids"]]))
        return batch

    return collate


def examples(spec: dict[str, Any], config: Any, n: int, seed: int) -> list[dict[str, Any]]:
    """``n`` training examples: counting sequences a model can learn (``spec["learnable"]``),
    else random tokens."""
    if spec.get("learnable"):
        from .._run.synthetic import SyntheticTextDataset

        ds = SyntheticTextDataset(vocab_size=config.get_text_config().vocab_size,
                                  seq_len=spec["seq_len"], num_samples=n, seed=seed)
        return [ds[i] for i in range(n)]
    return synthetic_examples(spec, config, n, seed=seed)
