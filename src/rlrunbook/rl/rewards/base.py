"""The value every reward function returns.

Rewards are pure functions of text: no model, no state, no randomness. A reward carries its
components as metrics so a run log can show why a sample scored what it did.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from rlrunbook.errors import InputError


@dataclass(frozen=True)
class RewardResult:
    """A scalar ``reward`` and named float ``metrics`` (components, flags as 0.0 / 1.0)."""

    reward: float
    metrics: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # A NaN reward silently poisons group advantages; refuse it where it is made.
        if not math.isfinite(self.reward):
            raise InputError(f"reward={self.reward!r} must be a finite number; check the reward function.")
