"""Held-out evaluation: the mean task reward of a sampler on problems it is not trained on."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from rlrunbook.engines.noise import mix_seed
from rlrunbook.rl.paradigms import RolloutContext
from rlrunbook.rl.tasks import Problem


def mean_task_reward(ctx: RolloutContext, problems: Sequence[Problem], samples_per_problem: int,
                     seed: int = 0) -> float:
    """Mean task reward over ``samples_per_problem`` completions of each problem (one batched round)."""
    futures = [ctx.sample(ctx.prompt(p), samples_per_problem, mix_seed(seed, i)) for i, p in enumerate(problems)]
    rewards = [ctx.task.reward(p, ctx.decode(list(s.tokens))).reward
               for p, f in zip(problems, futures, strict=True) for s in f.result().sequences]
    return statistics.fmean(rewards)
