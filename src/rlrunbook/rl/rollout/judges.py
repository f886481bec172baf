"""Debate judges: who won a debate. A deterministic mock for tests, and a model judge.

The model judge reads its verdict from a judge model's logprobs of the answer letters ``A`` and
``B`` after a question that shows both final answers (decoded text: judging is one of the places
where text is allowed). It is the base model unless another is named.
"""

from __future__ import annotations

import zlib
from abc import ABC, abstractmethod
from dataclasses import dataclass

from tinker import types

from rlrunbook.errors import ConfigError
from rlrunbook.rl.rollout.prompts import render_prompt


@dataclass(frozen=True)
class Verdict:
    winner: str  # "a" | "b"
    judge: str
    scores: dict[str, float]


@dataclass(frozen=True)
class DebateOutcome:
    """What a judge sees of one debate."""

    debate_id: str
    question: str
    final_a: str
    final_b: str
    task_reward_a: float
    task_reward_b: float


class Judge(ABC):
    name: str

    @abstractmethod
    def judge(self, debates: list[DebateOutcome]) -> list[Verdict]:
        """One verdict per debate, in order."""


class MockJudge(Judge):
    """Deterministic: the debater whose final answer has the higher task reward wins; a tie is settled
    by a coin that depends only on the debate id, so reruns agree."""

    name = "mock"

    def judge(self, debates: list[DebateOutcome]) -> list[Verdict]:
        verdicts = []
        for d in debates:
            if d.task_reward_a != d.task_reward_b:
                winner = "a" if d.task_reward_a > d.task_reward_b else "b"
            else:
                winner = "a" if zlib.crc32(d.debate_id.encode()) % 2 == 0 else "b"
            verdicts.append(Verdict(winner, self.name, {"a": d.task_reward_a, "b": d.task_reward_b}))
        return verdicts


class ModelJudge(Judge):
    """Asks a model which final answer is better and compares its logprobs of ``A`` and ``B``."""

    name = "model"

    def __init__(self, sampler, tokenizer):
        self.sampler = sampler
        self.tokenizer = tokenizer
        self.letters = {}
        for letter in ("A", "B"):
            ids = tokenizer.encode(letter, add_special_tokens=False)
            if len(ids) != 1:
                raise ConfigError(f"the judge's tokenizer splits {letter!r} into {ids}; it needs one token per letter.")
            self.letters[letter.lower()] = ids[0]

    def _prompt(self, d: DebateOutcome) -> list[int]:
        user = (f"Question:\n{d.question}\n\nDebater A's final answer:\n{d.final_a}\n\n"
                f"Debater B's final answer:\n{d.final_b}\n\n"
                "Which debater's answer is better? Reply with a single letter: A or B.")
        return render_prompt(self.tokenizer, user)

    def judge(self, debates: list[DebateOutcome]) -> list[Verdict]:
        futures = []
        for d in debates:
            prompt = self._prompt(d)
            futures.append({side: self.sampler.compute_logprobs(types.ModelInput.from_ints(prompt + [token]))
                            for side, token in self.letters.items()})
        verdicts = []
        for pending in futures:
            scores = {side: float(f.result()[-1]) for side, f in pending.items()}
            verdicts.append(Verdict("a" if scores["a"] >= scores["b"] else "b", self.name, scores))
        return verdicts


@dataclass(frozen=True)
class JudgeChoice:
    """Which judge a run uses, chosen from its options before any model loads and built once a service exists.

    ``kind`` ``none`` (single-turn runs), ``mock`` (:class:`MockJudge`) or ``model`` (a :class:`ModelJudge`
    of base model ``model``, reading with that model's own tokenizer when ``own_tokenizer``, else the policy's).
    """

    kind: str = "none"
    model: str | None = None
    own_tokenizer: bool = False

    def build(self, service, tokenizer) -> Judge | None:
        """The judge: ``service`` makes the model judge's sampler; ``tokenizer`` is the policy's."""
        if self.kind == "none":
            return None
        if self.kind == "mock":
            return MockJudge()
        sampler = service.create_sampling_client(base_model=self.model).result()
        return ModelJudge(sampler, sampler.get_tokenizer() if self.own_tokenizer else tokenizer)
