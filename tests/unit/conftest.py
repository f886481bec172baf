"""Unit-tier helpers shared by the test folders below, which mirror the package: ``<package>/test_<module>.py``
tests ``rlrunbook/<package>/<module>.py`` (``project/`` holds the checks of the repository as a whole, its docs,
CI and workflows; ``scripts/`` the tests of ``scripts/``).

The helper modules beside this file (``fake_wandb.py``, ``keyed_task.py``, ``memory_probe.py``,
``sdk_origin.py``) are imported by name from tests in sub-folders, so this folder is put on ``sys.path``
whatever pytest's import mode.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = str(Path(__file__).resolve().parent)
if HERE not in sys.path:
    sys.path.insert(0, HERE)
