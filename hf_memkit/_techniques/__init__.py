"""Memory techniques, one registered ``Technique`` per file (see ``base``). Order of import is
the order of warnings and candidate labels."""

from . import checkpoint_offload, checkpointing, liger, neftune, torch_compile  # noqa: F401
from .base import (
    TECHNIQUES,
    Flag,
    Technique,
    TechniqueUse,
    read_techniques,
    register,
    searched,
    unmodelled,
)

__all__ = ["TECHNIQUES", "Flag", "Technique", "TechniqueUse", "read_techniques", "register", "searched",
           "unmodelled"]
