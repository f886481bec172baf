"""The ``rlrunbook`` command: :func:`main` runs one command line, :func:`build_parser` builds its parser.

One module per command family (:mod:`~rlrunbook.cli.train`, :mod:`~rlrunbook.cli.runs`,
:mod:`~rlrunbook.cli.evaluation`, :mod:`~rlrunbook.cli.serve`, :mod:`~rlrunbook.cli.tools`), the parser and
the error boundary in :mod:`~rlrunbook.cli.app`, the console script in :mod:`~rlrunbook.cli.launch`. The
names here load :mod:`~rlrunbook.cli.app` on first use, so the console script imports nothing of the
command line before its signal handlers are in place.
"""

from __future__ import annotations

__all__ = ["build_parser", "main", "parse_args"]


def __getattr__(name: str):
    if name in __all__:
        from rlrunbook.cli import app

        return getattr(app, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
