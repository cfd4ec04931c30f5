"""``torch_compile``: fused kernels change activation memory. Not modelled yet: warned."""

from .base import Technique, flag, register

register(Technique("torch_compile", fields=("torch_compile",), read=flag("torch_compile"),
                   what="torch.compile fuses kernels and changes activation memory",
                   modelled=False))
