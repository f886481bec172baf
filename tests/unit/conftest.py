"""Unit-tier helpers shared by the test folders below (``rl/<stage>/`` mirrors ``rlrunbook.rl``).

The helper modules beside this file (``fake_wandb.py``, ``dp_trainer_worker.py``) are imported by
name from tests in sub-folders too, so this folder is put on ``sys.path`` whatever pytest's import mode.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = str(Path(__file__).resolve().parent)
if HERE not in sys.path:
    sys.path.insert(0, HERE)
