"""Held-out evaluation: task rewards of a sampler on problems it is not trained on."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from rlrunbook.engines.noise import mix_seed
from rlrunbook.rl.rollout.paradigms import RolloutContext
from rlrunbook.rl.rollout.tasks import Problem


def rewards_per_problem(ctx: RolloutContext, problems: Sequence[Problem], samples_per_problem: int,
                        seed: int = 0) -> list[list[float]]:
    """Task rewards of ``samples_per_problem`` completions of each problem: a P x n table (one batched round)."""
    with ctx.batch():
        futures = [ctx.sample(ctx.prompt(p), samples_per_problem, mix_seed(seed, i)) for i, p in enumerate(problems)]
    return [[ctx.task.reward(p, ctx.decode(list(s.tokens))).reward for s in f.result().sequences]
            for p, f in zip(problems, futures, strict=True)]


def mean_task_reward(ctx: RolloutContext, problems: Sequence[Problem], samples_per_problem: int,
                     seed: int = 0) -> float:
    """Mean task reward over ``samples_per_problem`` completions of each problem."""
    table = rewards_per_problem(ctx, problems, samples_per_problem, seed)
    return statistics.fmean(r for row in table for r in row)
