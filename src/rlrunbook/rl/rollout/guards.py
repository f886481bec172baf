"""Rollout guards: prompt length limits, the completion blocklist, and the finite-reward check.

* **Prompt limit** (``data.max_prompt_tokens``, ``data.truncate_prompts``). A prompt is measured as
  the token ids sent to the sampler: the chat template with the task's system and user turns and
  the generation prompt. Every problem is measured once before the first step (:func:`check_prompts`,
  tokenizer only, no model: one template render per problem and paradigm suffix), and again whenever a
  paradigm renders a prompt (:meth:`PromptLimit.fit`). Over the limit, the run is refused naming the problem,
  its length and the fixes; with truncation, the problem text (the user message, before any
  paradigm suffix such as the debate instructions) is cut by tokens and the template is rendered
  again, so the system turn, the suffix and the generation prompt stay intact. Debate prompts of
  rounds 2 and 3 grow by the debaters' own turns and the injected opponent turns; they are not
  limited (each round adds at most ``2 * max_tokens`` plus a few framing tokens).
* **Blocklist** (``reward.blocklist``, ``reward.reject_blocklisted``). A completion is blocked when
  it contains a listed string, compared case-insensitively (``str.casefold``) as a plain
  substring: ``"bad"`` also blocks ``"Badge"``. Blocked completions are counted each step
  (``blocklist/hits``); with rejection their reward is 0, set where the task reward is computed,
  before advantages and before a debate is judged.

The guards of the update itself (a non-finite step, the sampler-trainer mismatch) are
:mod:`rlrunbook.rl.training.step_guards`.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rlrunbook.errors import InputError
from rlrunbook.rl.rewards.base import RewardResult
from rlrunbook.rl.rewards.multi_signal import SIGNALS
from rlrunbook.rl.rollout.prompts import render_prompt

# --- prompt length ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class PromptLimit:
    """``max_tokens`` per rendered prompt (None: no limit); ``truncate`` cuts instead of refusing."""

    max_tokens: int | None = None
    truncate: bool = False

    def fit(self, tokenizer, problem_id: str, user: str, system: str | None,
            suffix: str = "") -> tuple[list[int], bool]:
        """The prompt tokens of ``user + suffix`` within the limit, and whether ``user`` was cut.

        Raises ``InputError`` for an over-long prompt without truncation, or when even an empty
        ``user`` does not fit (the template, system turn and suffix alone exceed the limit).
        """
        tokens = render_prompt(tokenizer, user + suffix, system)
        if self.max_tokens is None or len(tokens) <= self.max_tokens:
            return tokens, False
        if not self.truncate:
            raise InputError(
                f"the prompt of problem {problem_id} is {len(tokens)} tokens, over --max-prompt-tokens "
                f"{self.max_tokens}. Raise the limit, or pass --truncate-prompts to cut the problem text.")
        bare = render_prompt(tokenizer, suffix, system)
        if len(bare) > self.max_tokens:
            raise InputError(
                f"problem {problem_id}: the chat template, system turn and instructions alone take {len(bare)} "
                f"tokens, over --max-prompt-tokens {self.max_tokens}; cutting the problem text cannot fit it. "
                "Raise --max-prompt-tokens.")
        text_ids = tokenizer.encode(user, add_special_tokens=False)
        keep = min(len(text_ids), self.max_tokens - len(bare))
        while keep > 0:  # a cut can decode to text that encodes longer: shorten until it fits
            tokens = render_prompt(tokenizer, tokenizer.decode(text_ids[:keep]) + suffix, system)
            if len(tokens) <= self.max_tokens:
                return tokens, True
            keep -= 1
        return bare, True


def check_prompts(tokenizer, task, problems: Sequence, limit: PromptLimit, suffixes: Iterable[str] = ("",),
                  log=print) -> int:
    """Measure every problem's prompt (with each paradigm suffix) against ``limit`` before training.

    Returns how many prompts truncation will cut; raises ``InputError`` for the first one that
    cannot be used, naming the problem, its length and the fix.
    """
    if limit.max_tokens is None:
        return 0
    system = task.system_message()
    cut = sum(limit.fit(tokenizer, p.id, task.user_message(p), system, suffix)[1]
              for p in problems for suffix in suffixes)
    log(f"[prompts] {len(problems)} problems checked against --max-prompt-tokens {limit.max_tokens}: "
        + (f"{cut} prompts will be truncated" if cut else "all fit"))
    return cut


# --- blocklist -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Blocklist:
    """Forbidden substrings, matched case-insensitively; ``reject`` zeroes the reward of a hit."""

    words: tuple[str, ...] = ()
    reject: bool = False

    def hits(self, text: str) -> list[str]:
        """The listed strings that occur in ``text`` (case-insensitive)."""
        folded = text.casefold()
        return [word for word in self.words if word.casefold() in folded]

    def apply(self, result: RewardResult, text: str) -> tuple[RewardResult, bool]:
        """``result`` with metric ``blocked`` (and reward 0 when rejecting a hit), and whether ``text`` hit."""
        if not self.words:
            return result, False
        blocked = bool(self.hits(text))
        metrics = {**result.metrics, "blocked": float(blocked)}
        if blocked and self.reject:
            return RewardResult(0.0, {**metrics, "reward_before_block": result.reward}), True
        return RewardResult(result.reward, metrics), blocked


# --- per-step tallies of scoring and prompts -------------------------------------------------------

@dataclass
class StepTally:
    """What a step's scoring and prompt rendering saw, as step metrics."""

    blocked: int = 0
    truncated: int = 0
    signal_sums: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    signal_counts: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def scored(self, result: RewardResult, blocked: bool) -> None:
        self.blocked += blocked
        for name in SIGNALS:
            if name in result.metrics:
                self.signal_sums[name] += result.metrics[name]
                self.signal_counts[name] += 1

    def metrics(self) -> dict[str, float]:
        """``blocklist/hits``, ``prompts/truncated`` and ``reward_signal/<name>`` means (multi_signal)."""
        means = {f"reward_signal/{name}": self.signal_sums[name] / self.signal_counts[name]
                 for name in SIGNALS if self.signal_counts.get(name)}
        return {"blocklist/hits": float(self.blocked), "prompts/truncated": float(self.truncated), **means}


def checked_reward(result: Any, task_name: str, problem_id: str) -> RewardResult:
    """``result`` if it is a finite ``RewardResult``; else an ``InputError`` naming the task and problem."""
    if not isinstance(result, RewardResult) or not math.isfinite(result.reward):
        reward = getattr(result, "reward", result)
        raise InputError(f"task {task_name!r} gave reward {reward!r} for problem {problem_id}: a reward must be a "
                         "finite RewardResult (a NaN would poison the group's advantages). Fix the task's reward.")
    return result
