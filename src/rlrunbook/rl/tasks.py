"""Tasks: where the questions come from, how they are asked, and how answers are rewarded.

A task gives prompts (as a user message, turned into tokens by the model's chat template), and a
task reward of a completion's text. Tasks plug in through :func:`register_task`; the loop and the
paradigms only see the :class:`Task` interface, so a new task needs no change anywhere else.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from rlrunbook.errors import ConfigError
from rlrunbook.rl.data import (
    QARecord,
    SummaryRecord,
    arithmetic_problems,
    default_local_path,
    fingerprint_records,
    load_cnn_dailymail,
    load_gsm8k,
    load_nq_open,
)
from rlrunbook.rl.rewards.base import RewardResult
from rlrunbook.rl.rewards.math import math_reward
from rlrunbook.rl.rewards.symbolic import DEFAULT_TIMEOUT_S
from rlrunbook.rl.rewards.multi_signal import BOXED, TRAILING_NUMBER, SignalWeights, multi_signal_reward
from rlrunbook.rl.rewards.qa import qa_numeric_reward, qa_text_reward
from rlrunbook.rl.rewards.summary import compression_reward, rouge_reward


@dataclass(frozen=True)
class Problem:
    """One question of a task: an id and the task's own record."""

    id: str
    record: Any


class Task(ABC):
    """A source of problems with a task reward. Subclasses set the class attributes and register."""

    name: ClassVar[str]
    reward_fns: ClassVar[tuple[str, ...]]  # the first is the default
    rollout_kind: ClassVar[str] = "baseline"  # which rollout file single-turn runs write: baseline | summary
    default_dataset: ClassVar[str]
    cache_info: dict | None = None  # set by rl.dataset_cache when the problems came through --cache-dataset

    def __init__(self, dataset: str | None, reward_fn: str | None, seed: int, options: dict | None = None):
        self.dataset = dataset or self.default_dataset
        self.reward_fn = reward_fn or self.reward_fns[0]
        if self.reward_fn not in self.reward_fns:
            raise ConfigError(f"--reward-fn {self.reward_fn!r} does not apply to --env {self.name}; "
                              f"use one of {list(self.reward_fns)}.")
        self.seed = seed
        self.options = options or {}

    @abstractmethod
    def load(self) -> list[Problem]:
        """Every problem of the data set, in a fixed order."""

    @abstractmethod
    def user_message(self, problem: Problem) -> str:
        """The user turn that asks the question."""

    @abstractmethod
    def reward(self, problem: Problem, completion_text: str) -> RewardResult:
        """The task reward of a completion, from its decoded text."""

    def system_message(self) -> str | None:
        """An optional system turn; ``None`` keeps the model's default."""
        return None

    def reference(self, problem: Problem) -> str:
        """A short reference answer for logs."""
        return ""

    def dataset_info(self, problems: list[Problem]) -> dict:
        """Name, row count and fingerprint of the data set (and, when cached, where the copy is)."""
        info = {"name": self.dataset, "rows": len(problems),
                "fingerprint": fingerprint_records([p.record for p in problems])}
        return info if self.cache_info is None else {**info, "cache": dict(self.cache_info)}


TASKS: dict[str, type[Task]] = {}


def register_task(cls: type[Task]) -> type[Task]:
    """Class decorator: make a task selectable as ``--env <cls.name>``."""
    if cls.name in TASKS and TASKS[cls.name] is not cls:
        raise ConfigError(f"a task named {cls.name!r} is already registered ({TASKS[cls.name].__name__}).")
    TASKS[cls.name] = cls
    return cls


def get_task_class(name: str) -> type[Task]:
    if name not in TASKS:
        raise ConfigError(f"--env {name!r} is not a registered task; registered: {sorted(TASKS)}.")
    return TASKS[name]


def _local_or_name(dataset: str, kind: str) -> str | Path:
    """A short data set name means the project's local copy where one exists, else the hub."""
    if dataset == kind:
        local = default_local_path(kind)
        if local is not None:
            return local
    return dataset


def _qa_loader(dataset: str) -> Callable[[str | Path], list[QARecord]]:
    """GSM8K and NQ-open differ in their ``answer`` field: a string or a list of aliases."""
    if "nq" in dataset.lower() and not Path(dataset).is_file():
        return load_nq_open
    path = Path(dataset)
    if path.is_file():
        with path.open() as f:
            for line in f:
                if line.strip():
                    try:
                        return load_nq_open if isinstance(json.loads(line).get("answer"), list) else load_gsm8k
                    except (json.JSONDecodeError, AttributeError):
                        break  # the loader reports the malformed row with its line number
    return load_gsm8k


def _require_numeric_answers(records: list[QARecord], dataset: str) -> None:
    """qa's multi_signal reward verifies numbers: refuse a data set with a non-numeric reference answer."""
    for record in records:
        # An answer is numeric when the numeric reward accepts it as its own completion.
        if not any(qa_numeric_reward(answer, answer).reward >= 1.0 for answer in record.answers):
            raise ConfigError(
                f"--reward-fn multi_signal on --env qa verifies numeric answers, but problem {record.id} of "
                f"{dataset!r} has the answer {record.answers[0]!r}. Use --reward-fn text for text answers "
                "(NQ-open), or a numeric data set (test, gsm8k).")


@register_task
class QATask(Task):
    """Short-answer questions: the built-in arithmetic set ``test``, GSM8K, or NQ-open."""

    name = "qa"
    reward_fns = ("numeric", "text", "multi_signal")
    default_dataset = "test"

    def load(self) -> list[Problem]:
        if self.dataset == "test":
            records = arithmetic_problems(int(self.options.get("test_size", 256)), seed=self.seed)
        else:
            kind = "nq_open" if "nq" in self.dataset.lower() else "gsm8k"
            source = _local_or_name(self.dataset, kind)
            records = _qa_loader(str(source))(source)
        if self.reward_fn == "multi_signal":
            _require_numeric_answers(records, self.dataset)
        return [Problem(r.id, r) for r in records]

    def system_message(self) -> str | None:
        return "Answer the question. End with the final answer as a number or a short phrase."

    def user_message(self, problem: Problem) -> str:
        return problem.record.question

    def reward(self, problem: Problem, completion_text: str) -> RewardResult:
        """1 for a correct answer; a wrong answer that at least states a number gets ``format_bonus``
        (0.1 by default, ``numeric`` only). The bonus gives weak models (and the random ``tiny``) reward
        variance to learn from; a correct answer always outscores any wrong one. ``multi_signal``:
        see ``rlrunbook.rl.rewards.multi_signal`` (numeric answers only)."""
        if self.reward_fn == "text":
            return qa_text_reward(completion_text, problem.record.answers)
        result = qa_numeric_reward(completion_text, problem.record.answers)
        if self.reward_fn == "multi_signal":  # verify = the numeric match, without the format bonus
            return multi_signal_reward(completion_text, result.reward >= 1.0, TRAILING_NUMBER,
                                       SignalWeights.from_options(self.options))
        if result.reward >= 1.0:
            return result
        bonus = float(self.options.get("format_bonus", 0.1)) * result.metrics.get("has_number", 0.0)
        return RewardResult(bonus, {**result.metrics, "format_bonus": bonus})

    def reference(self, problem: Problem) -> str:
        return problem.record.answers[0]


@register_task
class MathTask(Task):
    """Math word problems (GSM8K, or MATH-style JSONL with ``question``/``answer``) with an answer checker."""

    name = "math"
    reward_fns = ("math", "multi_signal")
    default_dataset = "gsm8k"

    def __init__(self, dataset: str | None, reward_fn: str | None, seed: int, options: dict | None = None):
        super().__init__(dataset, reward_fn, seed, options)
        raw = self.options.get("math_timeout_s", DEFAULT_TIMEOUT_S)
        try:
            self.timeout_s = float(raw)
        except (TypeError, ValueError):
            self.timeout_s = float("nan")
        if not 0 < self.timeout_s < float("inf"):
            raise ConfigError(f"extra.math_timeout_s={raw!r} must be a finite number of seconds > 0 (the longest "
                              f"a symbolic answer comparison may take; default {DEFAULT_TIMEOUT_S}).")

    def load(self) -> list[Problem]:
        source = _local_or_name(self.dataset, "gsm8k")
        return [Problem(r.id, r) for r in load_gsm8k(source)]

    def system_message(self) -> str | None:
        return "Solve the problem step by step, then give the final answer as \\boxed{answer}."

    def user_message(self, problem: Problem) -> str:
        return problem.record.question

    def reward(self, problem: Problem, completion_text: str) -> RewardResult:
        result = math_reward(completion_text, problem.record.answers[0], self.timeout_s)
        if self.reward_fn == "multi_signal":  # verify = the answer checker's verdict
            return multi_signal_reward(completion_text, result.reward >= 1.0, BOXED,
                                       SignalWeights.from_options(self.options))
        return result

    def reference(self, problem: Problem) -> str:
        return problem.record.answers[0]


@register_task
class SummaryTask(Task):
    """Summarise a news article (CNN/DailyMail); reward ``compression`` or ``rouge`` against the highlights.

    The article is cut to ``summary_max_words`` words (150 by default) before it goes into the
    prompt, which keeps prompts inside small models' contexts and CPU steps short; rewards are
    computed against the same cut text (compression) or the reference highlights (rouge).
    """

    name = "summary"
    reward_fns = ("compression", "rouge")
    rollout_kind = "summary"
    default_dataset = "cnn_dailymail"

    def load(self) -> list[Problem]:
        source = _local_or_name(self.dataset, "cnn_dailymail")
        return [Problem(r.id, r) for r in load_cnn_dailymail(source)]

    def _document(self, problem: Problem) -> str:
        limit = int(self.options.get("summary_max_words", 150))
        return " ".join(problem.record.document.split()[:limit])

    def user_message(self, problem: Problem) -> str:
        return f"Summarize the following article in one or two sentences.\n\n{self._document(problem)}"

    def reward(self, problem: Problem, completion_text: str) -> RewardResult:
        record: SummaryRecord = problem.record
        if self.reward_fn == "rouge":
            return rouge_reward(completion_text, record.highlights)
        return compression_reward(self._document(problem), completion_text)

    def reference(self, problem: Problem) -> str:
        return problem.record.highlights
