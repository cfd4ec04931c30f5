"""Public home of hf_memkit's Trainer add-ons (also re-exported from ``hf_memkit``).

``MemoryCallback`` and ``ThroughputCallback`` are ``transformers.TrainerCallback`` objects;
``OOMGuardTrainer`` / ``OOMGuardMixin`` recover from out-of-memory errors inside the training
loop (a callback cannot catch exceptions).
"""

from ._compat import quiet_notices

with quiet_notices():  # transformers' Trainer imports peft, which imports bitsandbytes
    from ._callbacks import MemoryCallback, ThroughputCallback
    from ._oom.guard import (
        OOMGuardMixin,
        OOMGuardTrainer,
        OOMRecovery,
        OOMRecoveryError,
        is_oom_error,
    )

__all__ = ["MemoryCallback", "OOMGuardMixin", "OOMGuardTrainer", "OOMRecovery",
           "OOMRecoveryError", "ThroughputCallback", "is_oom_error"]
