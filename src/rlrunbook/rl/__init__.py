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

``tasks``, ``paradigms``, ``config`` and ``loop`` hand on the names users import from there (``register_task``,
``register_paradigm``, ``TrainConfig``, ``run_training``).
"""
