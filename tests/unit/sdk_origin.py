"""Where ``import tinker`` comes from: the installed Tinker SDK, never a module of this project (DESIGN §2).

Checked by the files, not by names: the checkout may sit in a folder called ``rlrunbook`` (so may the venv
that holds the SDK), and a name test would then fail for the SDK and could pass for a shadow.
"""

from __future__ import annotations

from importlib.metadata import distribution
from pathlib import Path
from types import ModuleType

import rlrunbook


def assert_is_the_sdk(module: ModuleType) -> None:
    """``module`` (what ``import tinker`` gave) is the ``tinker/__init__.py`` that the installed ``tinker``
    distribution ships, and no file of the ``rlrunbook`` package."""
    loaded = Path(module.__file__).resolve()
    shipped = Path(distribution("tinker").locate_file("tinker/__init__.py")).resolve()
    assert loaded == shipped, f"`import tinker` gave {loaded}, not the installed SDK's {shipped}"
    package = Path(rlrunbook.__file__).resolve().parent
    assert package not in loaded.parents, f"`import tinker` gave {loaded}, inside rlrunbook ({package})"
