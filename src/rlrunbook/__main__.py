"""``python -m rlrunbook``: the ``rlrunbook`` command, entered the same way (signal handlers first)."""

import sys

from rlrunbook.cli.launch import launch

sys.exit(launch())
