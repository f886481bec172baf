"""Dynamic sampling (DAPO, Yu et al. 2025, §3.2): a step trains only on question groups whose rewards differ.

A group whose rollouts all score the same gets advantage 0 everywhere: it costs a forward-backward and
teaches nothing. So each step samples its ``num_groups`` groups, drops the tied ones, and samples as many
new groups as it is missing, up to ``dynamic_sampling.max_rounds`` rounds. "Tied" means: no rollout of
the group has a non-zero advantage under the run's training mode, which is exact for each of them:

- ``grpo``: the group's rewards are all equal;
- ``rs_grpo``: the task rewards of the group's surviving winners are all equal (or one winner);
- ``rejection``: no debater of the group won (every winner was blocklisted).

If the rounds end with fewer than ``num_groups`` groups with spread, the step is skipped: no update, a
train-log row marked ``skipped`` (``check-run`` accepts it), a warning. After
``dynamic_sampling.max_skipped_steps`` skipped steps in a row the run stops with ``NoLearningSignalError``.

Where this departs from DAPO: DAPO over-samples whole batches and trims; here each round draws exactly
the missing number of groups, so a step that needs no refill samples exactly what it would without dynamic
sampling (same problems, same seeds, same tokens), and a step that is skipped trains nothing
instead of a smaller batch (the loss is a token sum, so a smaller batch would be a smaller step).

The data cursor: problems are taken in the seeded order, one per drawn group, so after a refill the
next step starts further along. :class:`DataCursor` (the next problem's index into that order and the
skipped-in-a-row count; :mod:`rlrunbook.rl.setup.data_order`) is saved in every checkpoint, which keeps resume exact. Under data parallelism
every rank sees the union of every round (``union_batch``), so all ranks drop the same groups and draw
the same refill; each rank samples its contiguous share of the refill's groups.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from rlrunbook import distributed
from rlrunbook.errors import NoLearningSignalError
from rlrunbook.rl.rollout.paradigms import RolloutBatch
from rlrunbook.rl.rollout.rollouts import Rollout
from rlrunbook.rl.setup.data_order import DataCursor
from rlrunbook.rl.training import data_parallel as dp


@dataclass
class SampledStep:
    """One step's sampling: every drawn rollout, the kept (trainable) ones with their advantages, the counts."""

    drawn: RolloutBatch  # every round, every group: the rollout file and the reward statistics
    kept: list[Rollout]  # the rollouts of groups with spread, in draw order
    advantages: list[float]  # of ``kept``
    kept_groups: list[int]  # draw indices (= group ids) of the kept groups
    own_groups: list[int]  # the draw indices this rank sampled (all of them in one process): what it trains
    groups_drawn: int
    rounds: int
    skipped: bool

    def metrics(self) -> dict[str, float]:
        """``dynamic_sampling/*`` for the step's log row."""
        return {"dynamic_sampling/groups_drawn": self.groups_drawn,
                "dynamic_sampling/groups_kept": len(self.kept_groups), "dynamic_sampling/rounds": self.rounds}


COUNT_PREFIXES = ("time/", *dp.COUNT_PREFIXES)  # summed over rounds; other batch metrics are per-rollout means


def merge_rounds(batches: Sequence[RolloutBatch]) -> RolloutBatch:
    """One batch from a step's rounds: rollouts and rollout-file lists concatenated in round order, times
    and counts summed, other metrics (fractions, means over samples) averaged weighted by rollouts."""
    if len(batches) == 1:
        return batches[0]
    weights = [len(b.rollouts) for b in batches]
    total = sum(weights) or 1
    keys = {key for b in batches for key in b.metrics}
    metrics = {key: sum(b.metrics.get(key, 0.0) for b in batches) if key.startswith(COUNT_PREFIXES)
               else sum(w * b.metrics.get(key, 0.0) for w, b in zip(weights, batches, strict=True)) / total
               for key in keys}
    return RolloutBatch(rollouts=[r for b in batches for r in b.rollouts], kind=batches[0].kind,
                        payload=dp.merge_payloads([b.payload for b in batches]),
                        sampled_tokens=sum(b.sampled_tokens for b in batches), metrics=metrics)


def sample_step(config, step: int, cursor: DataCursor, problems: Sequence[Any], order: Sequence[int],
                rollout: Callable[[list[Any], list[int]], RolloutBatch],
                advantages_of: Callable[[Sequence[Rollout]], list[float]], log: Callable[[str], None]) -> SampledStep:
    """Draw groups until ``config.num_groups`` have spread or ``max_rounds`` rounds are spent.

    ``rollout(problems, group_ids)`` samples and scores this rank's share of a round (``group_ids`` are
    the step-global draw indices, which seed the samples); it is called on every rank, every round.
    ``cursor.next_problem`` is advanced by the groups drawn.
    """
    wanted, max_rounds = config.num_groups, config.dynamic_sampling.max_rounds
    rounds: list[RolloutBatch] = []
    kept: list[Rollout] = []
    advantages: list[float] = []
    kept_groups: list[int] = []
    own_groups: list[int] = []
    drawn = 0
    while len(kept_groups) < wanted and len(rounds) < max_rounds:
        ids = distributed.shard(range(drawn, drawn + wanted - len(kept_groups)))
        chosen = [problems[order[(cursor.next_problem + j) % len(problems)]] for j in ids]
        batch = dp.union_batch(rollout(chosen, ids))  # every rank: the same union, the same decision below
        own_groups += ids
        drawn += wanted - len(kept_groups)
        rounds.append(batch)
        round_advantages = advantages_of(batch.rollouts)
        spread = {r.group for r, a in zip(batch.rollouts, round_advantages, strict=True) if a != 0}
        for rollout_, advantage in zip(batch.rollouts, round_advantages, strict=True):
            if rollout_.group in spread:
                kept.append(rollout_)
                advantages.append(advantage)
        kept_groups += sorted(spread)
    cursor.next_problem += drawn
    sampled = SampledStep(merge_rounds(rounds), kept, advantages, kept_groups, own_groups, drawn, len(rounds),
                          skipped=len(kept_groups) < wanted)
    sampled.drawn.payload["dynamic_sampling"] = {**sampled.metrics(), "kept_groups": kept_groups,
                                                 "skipped": sampled.skipped}
    if drawn > wanted and not sampled.skipped:
        log(f"[dynamic sampling] step {step}: {drawn - wanted} tied group(s) replaced; kept {wanted} of {drawn} "
            f"groups drawn in {len(rounds)} rounds")
    return sampled


def skip_reason(config, sampled: SampledStep) -> str:
    """Why ``sampled`` is not trained on, for the log row and the warning."""
    return (f"only {len(sampled.kept_groups)} of {config.num_groups} groups had reward spread after drawing "
            f"{sampled.groups_drawn} groups in {sampled.rounds} round(s) (dynamic_sampling.max_rounds = "
            f"{config.dynamic_sampling.max_rounds})")


def count_skip(config, step: int, cursor: DataCursor, sampled: SampledStep, rollouts: Sequence[Rollout]) -> None:
    """Count a skipped step; ``NoLearningSignalError`` when ``max_skipped_steps`` are skipped in a row."""
    cursor.skipped_in_a_row += 1
    limit = config.dynamic_sampling.max_skipped_steps
    if cursor.skipped_in_a_row < limit:
        return
    rewards = [r.reward for r in rollouts] or [0.0]
    raise NoLearningSignalError(
        f"step {step}: All token advantages are 0.0 in {limit} steps in a row (no learning signal): "
        f"{skip_reason(config, sampled)}; rewards min {min(rewards):.4g}, max {max(rewards):.4g} over "
        f"{len(rewards)} rollouts, mode {config.run_mode}. Increase -n (more samples per group), raise "
        "dynamic_sampling.max_rounds or dynamic_sampling.max_skipped_steps, change the reward function "
        "(--reward-fn), or use a task of a difficulty where samples differ, or another --temperature.")
