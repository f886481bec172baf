"""Where scripts imported the training loop from: ``rlrunbook.rl.loop.run_training``.

The loop lives in :mod:`rlrunbook.rl.training.loop`; this module hands its public names on.
"""

from rlrunbook.rl.training.loop import run_training, train

__all__ = ["run_training", "train"]
