"""The installed ``rlrunbook`` command, as users type it: what the tests that start it as a process run."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path


def installed_rlrunbook() -> str:
    """The ``rlrunbook`` entry point beside this Python (the venv's), else the one on ``PATH``.

    Raises ``FileNotFoundError`` naming the fix when the package is not installed as a command.
    """
    beside = Path(sys.executable).parent / "rlrunbook"
    if beside.is_file():
        return str(beside)
    found = shutil.which("rlrunbook")
    if found is None:
        raise FileNotFoundError(f"no `rlrunbook` command next to {sys.executable} or on PATH: install the package "
                                "(`bash scripts/setup.sh`, or `pip install -e .`)")
    return found
