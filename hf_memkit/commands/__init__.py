"""The ``hf-memkit`` CLI: one module per command (``*_parser`` + ``*_command``), registered in
``main`` (docs/style.md §10). ``_answers`` replays the answer to a repeated ``hf-memkit plan``
question (kept in ``hf_memkit._store``'s entry format); how fast the CLI must be:
docs/quality-bars.md#speed-and-footprint.
"""
