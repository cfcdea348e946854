"""``python -m autotune MODEL_DIR``: the command line, and loading the user's model and code."""

from autotune.cli.command import build_parser, main

__all__ = ["build_parser", "main"]
