"""Memory techniques, one registered ``Technique`` per file (see ``base``; Liger's is a folder).
Order of import is the order of warnings and candidate labels.

What a new technique touches: docs/extending.md. Imports the ground floor, ``_cuda``,
``_engines``, ``_model`` and ``_trace`` (a technique may patch the trace).
"""

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
