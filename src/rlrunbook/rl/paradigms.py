"""Where users import paradigms from: a paradigm plugs in with ``rlrunbook.rl.paradigms.register_paradigm``.

The paradigms live in :mod:`rlrunbook.rl.rollout.paradigms`; this module hands their public names on.
"""

from rlrunbook.rl.rollout.paradigms import (
    PARADIGMS,
    Debate,
    Paradigm,
    RolloutBatch,
    RolloutContext,
    RolloutSettings,
    SingleTurn,
    get_paradigm,
    register_paradigm,
)

__all__ = ["PARADIGMS", "Debate", "Paradigm", "RolloutBatch", "RolloutContext", "RolloutSettings", "SingleTurn",
           "get_paradigm", "register_paradigm"]
