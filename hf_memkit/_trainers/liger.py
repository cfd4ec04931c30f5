"""Liger under TRL's trainers: ``SFTTrainer`` and ``DPOTrainer`` replace the model's head with
their fused log-prob head, so they turn Liger's fused linear cross-entropy off and keep its layer
kernels (``_techniques.liger.layers_only``)."""

from __future__ import annotations

from .._techniques import TechniqueUse
from .._techniques.liger import NAME, layers_only


def liger_layers_only(uses: frozenset[TechniqueUse]) -> frozenset[TechniqueUse]:
    out = set()
    for u in uses:
        if u.name == NAME:
            opts = dict(u.options)
            config = layers_only(dict(opts.get("config") or ()))
            u = TechniqueUse.of(NAME, {**opts, "config": config})
        out.add(u)
    return frozenset(out)
