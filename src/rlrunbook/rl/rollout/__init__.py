"""Rollout: problems in, scored rollouts out.

It owns what a training step samples and how it is scored: tasks (a data set's problems, their
prompts and the task reward), prompt rendering and the prompt limit, the blocklist and the
finite-reward check, the debate judges, the paradigms that drive the sampler (single_turn, debate)
and the advantages of a group of rollouts. It reads the run's options only as the small
:class:`~rlrunbook.rl.rollout.paradigms.RolloutSettings`, never the whole config.
"""
