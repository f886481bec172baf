"""The training system, by stage, each importing only the stages listed before it.

* ``data/`` and ``rewards/``: the ground floor. Data sets read into records, and rewards as pure
  functions of a completion's text.
* ``rollout/``: turning problems into scored rollouts. Tasks (problems + task reward), prompts,
  judges, the rollout guards, paradigms (single_turn, debate) and the advantages of a group.
* ``setup/``: resolving a run before any model loads. The validated config and its sources, the
  data set (and its cache), the problem order and held-out split, the service and device, the
  checks of the surroundings, checkpoints and resume planning.
* ``evaluation/``: measuring a policy. pass@k and its intervals, held-out rewards, in-training
  validation, and the evaluation of a run's checkpoints.
* ``training/``: the loop on top. The run plan it consumes, dynamic sampling, data parallelism and
  the guards of each update.

The names users import come from this package itself (``from rlrunbook.rl import register_task``), whichever
stage defines them; each loads its stage on first use, so importing one stage does not import the others.
"""

from __future__ import annotations

import importlib

# Public name -> the module that defines it.
_HOMES = {
    **dict.fromkeys(("TASKS", "MathTask", "Problem", "QATask", "SummaryTask", "Task", "get_task_class",
                     "register_task"), "rlrunbook.rl.rollout.tasks"),
    **dict.fromkeys(("PARADIGMS", "Debate", "Paradigm", "RolloutBatch", "RolloutContext", "RolloutSettings",
                     "SingleTurn", "get_paradigm", "register_paradigm"), "rlrunbook.rl.rollout.paradigms"),
    **dict.fromkeys(("CONFIG_VERSION", "BackendSettings", "CheckpointSettings", "DataSettings",
                     "DynamicSamplingSettings", "LossSettings", "MismatchSettings", "RewardSettings", "TrainConfig",
                     "ValidationSettings"), "rlrunbook.rl.setup.config"),
    "validate": "rlrunbook.rl.setup.config_checks",
    **dict.fromkeys(("run_training", "train"), "rlrunbook.rl.training.loop"),
}
__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name in _HOMES:
        return getattr(importlib.import_module(_HOMES[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

