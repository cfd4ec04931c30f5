"""One device: every state on it, nothing shared."""

from __future__ import annotations

from typing import Any

from .base import Engine, RankStates, Sharding, StateSizes, register


class Single(Engine):
    name = "none"
    user_facing = False

    def from_args(self, get, world: int) -> Sharding:
        return Sharding()

    def label(self, sh: Sharding) -> str:
        return "single device"

    def notes(self, sh: Sharding, device_kind: str) -> list[str]:
        return []

    def rank_states(self, sh: Sharding, sizes: StateSizes, facts: Any,
                    device_kind: str) -> RankStates:
        return RankStates(sizes.weight_bytes, sizes.grad_bytes, sizes.optimizer_state,
                          sizes.optimizer_transient)


SINGLE = register(Single())
