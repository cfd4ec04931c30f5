"""Which trainer a config belongs to, and a clear refusal for TRL trainers not modelled."""

from __future__ import annotations

from typing import Any

from .._errors import HfMemkitError
from .base import TRAINERS

# TRL trainers that are not modelled yet (their steps keep reward or value models, an online
# generation or losses of their own). A trainer that gets a registry entry is modelled, whether
# or not it is still listed here.
NOT_MODELLED = {"online_dpo": "OnlineDPOTrainer", "ppo": "PPOTrainer",
                "orpo": "ORPOTrainer", "cpo": "CPOTrainer", "gkd": "GKDTrainer",
                "xpo": "XPOTrainer", "nash_md": "NashMDTrainer", "bco": "BCOTrainer",
                "prm": "PRMTrainer"}


def _refuse(what: str) -> HfMemkitError:
    modelled = ", ".join(f"{k.name!r} ({k.title})" for k in TRAINERS)
    return HfMemkitError(
        f"{what} is not modelled: hf_memkit traces one optimizer step of the trainers it "
        f"models ({modelled}); online DPO, PPO, ORPO, CPO and the other TRL trainers not listed "
        "have losses, generation buffers or extra models it does not estimate. Estimate the policy's "
        "step with trainer='sft' as a lower bound, or measure with hf_memkit's MemoryCallback")


def _class_name_kind(cls: type) -> str:
    name = cls.__name__.removesuffix("Config")
    return "".join("_" + c.lower() if c.isupper() and i and not name[i - 1].isupper() else
                   c.lower() for i, c in enumerate(name))


def trainer_of_args(args: Any, trainer: str | None = None) -> str:
    """The registered trainer for ``args`` (a config instance or dict) and ``trainer`` (a name,
    or None to take it from the config's class)."""
    if trainer is not None:
        key = str(trainer).lower().replace("-", "_")
        if key in NOT_MODELLED and key not in TRAINERS:
            raise _refuse(f"trainer={trainer!r} ({NOT_MODELLED[key]})")
        kind = TRAINERS.get(key).name
    else:
        kind = None
    cls = type(args)
    if args is not None and not isinstance(args, dict) and cls.__module__.startswith("trl"):
        found = next((k.name for k in TRAINERS if k.name != "trainer"
                      and isinstance(args, k.config_type())), None)
        if found is None:
            key = _class_name_kind(cls)
            title = NOT_MODELLED.get(key, cls.__name__.removesuffix("Config") + "Trainer")
            raise _refuse(f"{cls.__name__} ({title})")
        if kind is not None and kind != found:
            raise HfMemkitError(f"trainer={trainer!r} but args is a {cls.__name__} (the "
                                f"{TRAINERS.get(found).title}'s config); pass trainer={found!r} "
                                "or leave trainer out")
        return found
    return kind or "trainer"
