"""Liger kernels (``use_liger_kernel``): the registered technique (``technique``) and the
emulation of Liger's kernels on fake tensors (``kernels``), one home for everything Liger."""

from .technique import NAME, layers_only, liger_layers_only

__all__ = ["NAME", "layers_only", "liger_layers_only"]
