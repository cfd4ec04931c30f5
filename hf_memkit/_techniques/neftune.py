"""``neftune_noise_alpha``: NEFTune's noise per embedding output. Not modelled yet: warned."""

from .base import Technique, flag, register

register(Technique("neftune_noise_alpha", fields=("neftune_noise_alpha",),
                   read=flag("neftune_noise_alpha"),
                   what="NEFTune adds a noise tensor per embedding output", modelled=False))
