"""Results turned into something people read (docs/style.md §4: compute first, render
separately).

* ``text``: rich tables for the CLI and ``explain()``;
* ``html``: notebook views (``_repr_html_``).

Takes estimates and plans as arguments and imports neither: only the ground floor (and an
annotation of ``_device``), so ``MemoryEstimate`` and ``Plan`` can call it.
"""
