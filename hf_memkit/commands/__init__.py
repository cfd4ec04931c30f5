"""The ``hf-memkit`` CLI: one module per command (``*_parser`` + ``*_command``), registered in main."""
