"""``torch_compile``: fused kernels change activation memory. Not modelled yet: warned."""

from .base import Flag, register

register(Flag("torch_compile", "torch.compile fuses kernels and changes activation memory",
              modelled=False))
