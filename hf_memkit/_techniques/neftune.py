"""``neftune_noise_alpha``: NEFTune's noise per embedding output. Not modelled yet: warned."""

from .base import Flag, register

register(Flag("neftune_noise_alpha", "NEFTune adds a noise tensor per embedding output",
              modelled=False))
