"""``use_liger_kernel``: Liger's fused cross-entropy and RMSNorm. Not modelled yet: warned."""

from .base import Technique, flag, register

register(Technique("use_liger_kernel", fields=("use_liger_kernel",),
                   read=flag("use_liger_kernel"),
                   what="Liger kernels (fused cross-entropy, RMSNorm) change activation memory",
                   modelled=False))
