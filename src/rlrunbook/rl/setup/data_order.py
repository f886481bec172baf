"""Which problems a run draws, in which order: the seeded order, the held-out split and the data cursor.

The order is a permutation of the data set that depends on the seed alone. With validation on, the
**last** ``validation.num_problems`` problems of that order are held out (never trained on) and the
run trains on the others, in the same order, cycling over them; the held-out set thus depends only
on the data set and the seed, and needs no second file. The :class:`DataCursor` says how far along
the order a run has drawn; every checkpoint stores it, which keeps resume exact.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rlrunbook.errors import ConfigError
from rlrunbook.rl.rollout.tasks import Problem
from rlrunbook.rl.setup.config import ValidationSettings


def problem_order(problems: Sequence[Problem], seed: int) -> list[int]:
    """The seeded permutation of ``range(len(problems))`` in which a run draws its problems."""
    order = list(range(len(problems)))
    random.Random(seed).shuffle(order)
    return order


def check_held_out(settings: ValidationSettings, num_problems: int) -> None:
    """Refuse (before any model loads) a held-out set that would leave nothing to train on."""
    if settings.every > 0 and settings.num_problems >= num_problems:
        raise ConfigError(
            f"validation.num_problems {settings.num_problems} held-out problems leave none of the data set's "
            f"{num_problems} to train on. Lower validation.num_problems (below {num_problems}) or use a "
            "larger data set.")


def split_held_out(problems: Sequence[Problem], order: Sequence[int],
                   settings: ValidationSettings) -> tuple[list[Problem], list[int], list[Problem]]:
    """``(training problems, their order, held-out problems)``; with validation off, nothing is held out.

    The held-out problems are ``order[-num_problems:]``. Training problems are listed in the
    seeded order already, so their order is the identity: step ``s`` group ``g`` then trains on
    ``problems[order[(s * G + g) % (N - P)]]``, the unvalidated choice whenever that index < N - P.
    """
    if settings.every <= 0:
        return list(problems), list(order), []
    check_held_out(settings, len(problems))
    cut = len(order) - settings.num_problems
    training = [problems[i] for i in order[:cut]]
    return training, list(range(len(training))), [problems[i] for i in order[cut:]]


@dataclass
class DataCursor:
    """Where a run is in its problem order: the index of the next problem to draw (cycling over the
    order) and how many steps in a row were skipped. What a checkpoint stores as its data cursor."""

    next_problem: int = 0
    skipped_in_a_row: int = 0

    def to_dict(self) -> dict[str, int]:
        return {"next_problem": self.next_problem, "skipped_in_a_row": self.skipped_in_a_row}

    @classmethod
    def from_checkpoint(cls, stored: dict[str, Any] | None, step: int, num_groups: int) -> DataCursor:
        """The cursor a checkpoint saved; checkpoints made before dynamic sampling drew exactly
        ``num_groups`` problems per step, so theirs is ``step * num_groups``."""
        stored = stored or {}
        return cls(int(stored.get("next_problem", step * num_groups)), int(stored.get("skipped_in_a_row", 0)))
