"""Evaluation: how good a policy is, on problems it was not trained on.

It owns pass@k, mean@k and their bootstrap intervals, the held-out rewards of a sampler, the
in-training validation hook that the loop calls after each step, and ``eval-checkpoints``, which
scores every checkpoint of a finished run.
"""
