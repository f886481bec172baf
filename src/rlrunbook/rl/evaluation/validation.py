"""In-training validation: mean reward and pass@k on held-out problems, with the weights of the moment.

Held out means never trained on. With ``validation.every > 0`` the run reserves the **last**
``validation.num_problems`` problems of its seeded order (the permutation of the data set that
``seed`` gives) and trains on the others, in the same order, cycling over them as before. So the
training sequence is the unvalidated run's sequence with the reserved problems taken out, and
the held-out set depends only on the data set and the seed. The split needs no second file and
works for every task (:mod:`rlrunbook.rl.setup.data_order`); ``prepare`` refuses a data set too
small to leave a training problem.

Schedule (``run.schema.validation_schedule``): a row's ``step`` is the number of optimizer steps
applied before it: 0 (initial weights), every multiple of ``every``, and the last step's
count, once. ``-s 3 --val-every 2`` validates at 0, 2 and 3.

Every validation samples ``validation.samples`` completions of each held-out problem with the
run's temperature and max_tokens (single-turn, whatever the paradigm: it measures the policy's
own answers) under one fixed seed derived from the run's seed. Sampling noise is counter-based
(``engines.noise``), so the same weights give the same numbers and a change between two rows
is a change of the weights, not of the dice; it also leaves the training samples untouched.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from rlrunbook.engines.noise import mix_seed
from rlrunbook.rl.evaluation.evaluate import rewards_per_problem
from rlrunbook.rl.evaluation.passk import EvalSummary, summarize_eval
from rlrunbook.rl.rollout.paradigms import RolloutContext, RolloutSettings
from rlrunbook.rl.rollout.tasks import Problem, Task
from rlrunbook.rl.setup.config import ValidationSettings
from rlrunbook.run.schema import validation_ks, validation_schedule

_SALT = 0x76616C  # "val": validation draws its own seed stream, apart from the training steps'


def validation_seed(seed: int) -> int:
    """The sampling and bootstrap seed of every validation of a run seeded ``seed``."""
    return mix_seed(seed, _SALT)


def measure(ctx: RolloutContext, problems: Sequence[Problem], settings: ValidationSettings,
            seed: int) -> tuple[EvalSummary, list[list[float]]]:
    """Sample ``settings.samples`` completions per problem and summarise them (pass@1, pass@k, mean reward)."""
    rewards = rewards_per_problem(ctx, problems, settings.samples, seed=seed)
    summary = summarize_eval(rewards, ks=validation_ks(settings.samples), threshold=settings.threshold, seed=seed)
    return summary, rewards


class Validator:
    """Called with the number of optimizer steps applied so far; validates when the schedule says so.

    With validation off (or no held-out problems) every call is a no-op, so the loop calls it
    unconditionally. Rows go to ``writer.log_validation`` (``validation.jsonl``).
    """

    def __init__(self, task: Task, held_out: Sequence[Problem], settings: ValidationSettings,
                 rollout: RolloutSettings, seed: int, steps: int):
        self.task, self.held_out, self.settings, self.rollout = task, list(held_out), settings, rollout
        self.seed = validation_seed(seed)
        self.due = set(validation_schedule(steps, settings.every)) if self.held_out else set()

    def __call__(self, steps_done: int, training: Any, tokenizer: Any, writer: Any,
                 log: Callable[[str], None] = print) -> dict | None:
        """Validate the current weights of ``training`` if ``steps_done`` is scheduled; return the row written."""
        if steps_done not in self.due:
            return None
        started = time.perf_counter()
        ctx = RolloutContext(training.save_weights_and_get_sampling_client().result(), tokenizer, self.task, self.rollout,
                             [tokenizer.eos_token_id])
        summary, _ = measure(ctx, self.held_out, self.settings, self.seed)
        elapsed = time.perf_counter() - started
        row = {"step": steps_done, **summary.to_dict(), "seed": self.seed,
               "problem_ids": [p.id for p in self.held_out], "time/validation_s": elapsed}
        writer.log_validation(row)
        passes = ", ".join(f"pass@{k} {v:.4f} [{summary.pass_ci[k][0]:.4f}, {summary.pass_ci[k][1]:.4f}]"
                           for k, v in summary.pass_at.items())
        log(f"[val] step {steps_done}: mean reward {summary.mean_reward:.4f} "
            f"[{summary.mean_ci[0]:.4f}, {summary.mean_ci[1]:.4f}], {passes} "
            f"({summary.num_problems} held-out problems x {summary.samples_per_problem} samples, "
            f"{elapsed:.1f}s)")
        return row
