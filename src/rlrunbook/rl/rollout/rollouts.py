"""Rollouts and what training makes of them: advantages per training mode, datums, step records.

A :class:`Rollout` is one trainable token sequence: a prompt, then a completion whose tokens are
either the policy's own (``mask`` 1, with their sampling logprobs) or injected context such as
an opponent's debate turn (``mask`` 0). Advantages only ever land on own tokens.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tinker import types

from rlrunbook.errors import ConfigError, InputError
from rlrunbook.tokens import build_datum_arrays


@dataclass
class Rollout:
    """One trainable sequence and how it scored.

    ``reward`` is what the training mode centres (task reward for single-turn, the verdict for a
    debater); ``task_reward`` is the task's own reward of the final answer.
    """

    prompt_tokens: list[int]
    completion_tokens: list[int]
    completion_logprobs: list[float]
    completion_mask: list[int]
    problem_id: str
    group: int
    role: str
    reward: float
    task_reward: float
    won: bool | None = None
    metadata: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = len(self.completion_tokens)
        if not (len(self.completion_logprobs) == len(self.completion_mask) == n) or n == 0:
            raise InputError(f"rollout {self.problem_id}/{self.role}: completion arrays differ in length or are "
                             f"empty (tokens {n}, logprobs {len(self.completion_logprobs)}, "
                             f"mask {len(self.completion_mask)}).")

    @property
    def own_token_count(self) -> int:
        return sum(self.completion_mask)


def centered_by_group(values: Sequence[float], groups: Sequence[int]) -> list[float]:
    """``value - mean(value of its group)``: GRPO's group-centred advantage (no std scaling).

    A group whose values are all equal gets exactly 0: its float mean can miss the common value by an
    ulp (eight rewards of 0.1 sum to 0.7999999999999999), which would give a tied group advantages of
    ~1e-17, train it as if it had signal and hide it from dynamic sampling.
    """
    members: dict[int, list[float]] = defaultdict(list)
    for value, group in zip(values, groups, strict=True):
        members[group].append(value)
    means = {g: sum(v) / len(v) for g, v in members.items()}
    tied = {g for g, v in members.items() if min(v) == max(v)}
    return [0.0 if group in tied else value - means[group] for value, group in zip(values, groups, strict=True)]


def grpo_advantages(rollouts: Sequence[Rollout]) -> list[float]:
    """Every rollout trains, with its reward centred within its question group."""
    return centered_by_group([r.reward for r in rollouts], [r.group for r in rollouts])


def rejection_advantages(rollouts: Sequence[Rollout]) -> list[float]:
    """Rejection sampling: debate winners train with advantage 1, losers not at all."""
    return [1.0 if r.won else 0.0 for r in rollouts]


def rs_grpo_advantages(rollouts: Sequence[Rollout]) -> list[float]:
    """Rejection sampling, then GRPO: winners' task rewards centred across the winners of each group,
    as if the debate had not happened; losers get 0."""
    winners = [i for i, r in enumerate(rollouts) if r.won]
    centred = centered_by_group([rollouts[i].task_reward for i in winners], [rollouts[i].group for i in winners])
    advantages = [0.0] * len(rollouts)
    for i, value in zip(winners, centred, strict=True):
        advantages[i] = value
    return advantages


ADVANTAGE_MODES: dict[str, Callable[[Sequence[Rollout]], list[float]]] = {
    "grpo": grpo_advantages, "rejection": rejection_advantages, "rs_grpo": rs_grpo_advantages,
}


def advantage_mode(name: str) -> Callable[[Sequence[Rollout]], list[float]]:
    if name not in ADVANTAGE_MODES:
        raise ConfigError(f"training mode {name!r} is unknown; use one of {sorted(ADVANTAGE_MODES)}.")
    return ADVANTAGE_MODES[name]


def to_datum(rollout: Rollout, advantage: float) -> types.Datum:
    """The Tinker datum: shifted tokens, sampling logprobs and advantages on own tokens only."""
    mask = rollout.completion_mask
    arrays = build_datum_arrays(
        rollout.prompt_tokens, rollout.completion_tokens,
        [lp * m for lp, m in zip(rollout.completion_logprobs, mask, strict=True)],
        [advantage * m for m in mask],
    )
    return types.Datum(model_input=types.ModelInput.from_ints(arrays.input_tokens),
                       loss_fn_inputs={"target_tokens": arrays.target_tokens, "logprobs": arrays.logprobs,
                                       "advantages": arrays.advantages})


def step_record(rollout: Rollout, advantage: float, centered: float | None) -> dict:
    """The ``training_data`` entry of ``training_step_<k>.json``."""
    mask = rollout.completion_mask
    return {
        "prompt_tokens": rollout.prompt_tokens,
        "completion_tokens": rollout.completion_tokens,
        "completion_logprobs": [lp * m for lp, m in zip(rollout.completion_logprobs, mask, strict=True)],
        "completion_advantages": [advantage * m for m in mask],
        "completion_mask": mask,
        "metadata": {"reward": rollout.reward, "task_reward": rollout.task_reward, "centered_reward": centered,
                     "role": rollout.role, "group": rollout.group, "problem_id": rollout.problem_id,
                     **rollout.metadata},
    }
