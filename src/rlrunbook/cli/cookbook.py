"""``rlrunbook cookbook``: a tinker-cookbook recipe run unmodified on the local backend (the runner is
:mod:`rlrunbook.cookbook.runner`, also ``python -m rlrunbook.cookbook``)."""

from __future__ import annotations

import argparse

from rlrunbook.cookbook.runner import DESCRIPTION, add_arguments, run


def cmd_cookbook(args: argparse.Namespace) -> int:
    return run(args)


def add_command(commands) -> None:
    cookbook = commands.add_parser("cookbook", description=DESCRIPTION,
                                   help="run a tinker-cookbook recipe unmodified on the local backend: "
                                        "rlrunbook cookbook [--renderer R] [--hf-dataset NAME=FILE] "
                                        "<recipe module> [recipe args]")
    # The runner's own options, then the recipe and its arguments (one positional taking the rest alone would
    # refuse a leading option: argparse.REMAINDER does not start at one).
    add_arguments(cookbook)
    cookbook.set_defaults(func=cmd_cookbook)
