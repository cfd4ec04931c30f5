"""Find the fastest candidate that fits (``core.Search``), and what the search does at the edges of
the card (``edges``: the expandable-segments rung, the tight fallback, the offload setup passed
over)."""

from .core import Search

__all__ = ["Search"]
