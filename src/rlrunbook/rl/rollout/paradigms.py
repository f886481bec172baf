"""Paradigms: the interaction protocol that turns problems into scored rollouts.

``single_turn``: each rollout answers the question once. ``debate``: two rollouts of the policy
argue one question over three rounds; from round 2 each sees the opponent's previous turn,
injected as token ids; a judge picks the winner. Every round is one batched sampling call across
all debates (the requests are submitted together and the local backend coalesces them).
New paradigms plug in through :func:`register_paradigm`.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Mapping
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, ClassVar

from tinker import types

from rlrunbook.engines.noise import mix_seed
from rlrunbook.errors import ConfigError, InputError
from rlrunbook.rl.rollout.guards import Blocklist, PromptLimit, StepTally, checked_reward
from rlrunbook.rl.rollout.judges import DebateOutcome, Judge
from rlrunbook.rl.rollout.prompts import TurnSplicer
from rlrunbook.rl.rollout.rollouts import Rollout
from rlrunbook.rl.rollout.task_options import TaskOption
from rlrunbook.rl.rollout.tasks import Problem, Task

ROUNDS = 3


@dataclass
class RolloutBatch:
    """A step's rollouts and the rollout file that records them (``<kind>_<step>.json``)."""

    rollouts: list[Rollout]
    kind: str
    payload: dict
    sampled_tokens: int
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class RolloutSettings:
    """What a rollout needs of a run's config: sampling, group size, seed and the rollout guards.

    Built once from the config (``TrainConfig.rollout_settings``), so paradigms, validation and
    evaluation see these values and nothing else of the run.
    """

    group_size: int = 1  # rollouts per question group (debate: two debaters per debate)
    seed: int = 0  # mixed with the step and the group into every sampling seed
    max_tokens: int = 64  # per completion (per debate turn)
    temperature: float = 1.0
    min_p: float = 0.0  # 0: off (not sent)
    prompt_limit: PromptLimit = field(default_factory=PromptLimit)
    blocklist: Blocklist = field(default_factory=Blocklist)


@dataclass
class RolloutContext:
    """What a paradigm may use: the sampler of the current weights, the tokenizer, task and rollout settings.

    ``score`` and ``prompt`` apply the run's guards (blocklist, prompt limit; see ``rlrunbook.rl.rollout.guards``)
    and count what they did in ``tally``; ``step_metrics`` hands the counts to the step log.
    """

    sampler: Any
    tokenizer: Any
    task: Task
    settings: RolloutSettings
    eos_ids: list[int]
    judge: Judge | None = None
    log: Any = print
    score_seconds: float = 0.0
    tally: StepTally = field(default_factory=StepTally)
    # The step-global index of each problem handed to the paradigm (None: 0, 1, 2, ...). Under
    # data parallelism a process gets a block of the step's groups; seeds, group ids and debate
    # ids use the global index, so a group samples the same tokens whichever process samples it.
    group_ids: list[int] | None = None

    def group_index(self, g: int) -> int:
        """The step-global index of ``problems[g]``: its group id and the seed of its samples."""
        return g if self.group_ids is None else self.group_ids[g]

    def score(self, problem: Problem, text: str, guarded_text: str | None = None):
        """The task reward of ``text``, timed (the step log separates scoring from sampling).

        A non-finite reward is refused here, naming the task and problem. The blocklist is checked
        on ``guarded_text`` (default ``text``; debate passes all of a debater's own turns): a hit is
        counted, marked ``blocked`` in the metrics, and scores 0 under ``reward.reject_blocklisted``.
        """
        started = time.perf_counter()
        try:
            try:
                raw = self.task.reward(problem, text)
            except InputError as error:  # e.g. RewardResult refusing a NaN: say which task and problem
                raise InputError(f"task {self.task.name!r}, problem {problem.id}: {error}") from error
            result = checked_reward(raw, self.task.name, problem.id)
            result, blocked = self.blocklist.apply(result, text if guarded_text is None else guarded_text)
            self.tally.scored(result, blocked)
            return result
        finally:
            self.score_seconds += time.perf_counter() - started

    @property
    def blocklist(self) -> Blocklist:
        return self.settings.blocklist

    def step_metrics(self) -> dict[str, float]:
        """Scoring time and the guards' counts: ``blocklist/hits``, ``prompts/truncated``, ``reward_signal/*``."""
        return {"time/score_s": self.score_seconds, **self.tally.metrics()}

    def params(self, seed: int) -> types.SamplingParams:
        return types.SamplingParams(max_tokens=self.settings.max_tokens, temperature=self.settings.temperature,
                                    seed=seed, stop=self.eos_ids)

    def sample(self, prompt: list[int], num_samples: int, seed: int):
        """Submit one sampling request (returns a future); ``min_p`` only where it was asked for."""
        extra = {"min_p": self.settings.min_p} if self.settings.min_p > 0 else {}
        return self.sampler.sample(types.ModelInput.from_ints(prompt), num_samples, self.params(seed), **extra)

    def batch(self):
        """Submit a round's requests inside this block: on the local backend they become one engine
        call whatever the timing (``LocalSamplingClient.batch``); elsewhere it changes nothing."""
        hold = getattr(self.sampler, "batch", None)
        return hold() if callable(hold) else nullcontext()

    def decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def prompt(self, problem: Problem, suffix: str = "") -> list[int]:
        """The prompt tokens of ``problem`` (user message + ``suffix``), within ``data.max_prompt_tokens``."""
        tokens, truncated = self.settings.prompt_limit.fit(self.tokenizer, problem.id, self.task.user_message(problem),
                                      self.task.system_message(), suffix)
        self.tally.truncated += truncated
        return tokens


class Paradigm(ABC):
    """An interaction protocol. ``declared_options`` names the ``extra.*`` options it reads (none of the
    built-in paradigms reads any); undeclared keys are refused before any work, as for tasks."""

    name: ClassVar[str]
    prompt_suffixes: ClassVar[tuple[str, ...]] = ("",)  # what ``rollout`` appends to user messages
    declared_options: ClassVar[Mapping[str, TaskOption]] = {}

    @abstractmethod
    def rollout(self, ctx: RolloutContext, problems: list[Problem], step: int) -> RolloutBatch:
        """Scored rollouts for one step; ``problems[g]`` is the question of group ``g``."""


PARADIGMS: dict[str, type[Paradigm]] = {}


def register_paradigm(cls: type[Paradigm]) -> type[Paradigm]:
    """Class decorator: make a paradigm selectable as ``--mode <cls.name>``."""
    PARADIGMS[cls.name] = cls
    return cls


def get_paradigm_class(name: str) -> type[Paradigm]:
    """The paradigm registered as ``name``; ``ConfigError`` naming the registered ones otherwise."""
    if name not in PARADIGMS:
        raise ConfigError(f"--mode {name!r} is not a registered paradigm; registered: {sorted(PARADIGMS)}.")
    return PARADIGMS[name]


def get_paradigm(name: str) -> Paradigm:
    return get_paradigm_class(name)()


@register_paradigm
class SingleTurn(Paradigm):
    name = "single_turn"

    def rollout(self, ctx: RolloutContext, problems: list[Problem], step: int) -> RolloutBatch:
        size = ctx.settings.group_size
        prompts = [ctx.prompt(p) for p in problems]
        with ctx.batch():
            futures = [ctx.sample(prompt, size, mix_seed(ctx.settings.seed, step, ctx.group_index(g)))
                       for g, prompt in enumerate(prompts)]
        rollouts, records, sampled = [], [], 0
        for local, (problem, prompt, future) in enumerate(zip(problems, prompts, futures, strict=True)):
            g = ctx.group_index(local)
            for sequence in future.result().sequences:
                tokens = list(sequence.tokens)
                text = ctx.decode(tokens)
                scored = ctx.score(problem, text)
                sampled += len(tokens)
                rollouts.append(Rollout(prompt, tokens, list(sequence.logprobs), [1] * len(tokens), problem.id, g,
                                        "single", scored.reward, scored.reward,
                                        metadata={"stop_reason": sequence.stop_reason}))
                records.append({"problem_id": problem.id, "group": g, "completion_text": text,
                                "completion_tokens": tokens, "reward": scored.reward,
                                "reward_metrics": dict(scored.metrics), "stop_reason": sequence.stop_reason,
                                "reference": ctx.task.reference(problem)})
        payload = {"step": step, "env": ctx.task.name, "records": records}
        return RolloutBatch(rollouts, ctx.task.rollout_kind, payload, sampled, metrics=ctx.step_metrics())


DEBATE_INSTRUCTIONS = ("\n\nYou are debater {side}. Another debater answers the same question. Over three "
                       "rounds you will see its latest answer; argue for the best answer.")
OPPONENT_INTRO = "Your opponent's answer:\n"
OPPONENT_OUTRO = "\n\nGive your improved answer."


@register_paradigm
class Debate(Paradigm):
    name = "debate"
    prompt_suffixes = tuple(DEBATE_INSTRUCTIONS.format(side=side) for side in "AB")

    def rollout(self, ctx: RolloutContext, problems: list[Problem], step: int) -> RolloutBatch:
        if ctx.judge is None:
            raise ConfigError("debate needs a judge: pass --mock-judge or let the model judge run.")
        tok = ctx.tokenizer
        splicer = TurnSplicer.from_tokenizer(tok)
        intro = tok.encode(OPPONENT_INTRO, add_special_tokens=False)
        outro = tok.encode(OPPONENT_OUTRO, add_special_tokens=False)
        debates = [(g, d) for g in range(len(problems)) for d in range(ctx.settings.group_size // 2)]
        # Per debater: the round-1 prompt, the completion so far, its logprobs and its own-token mask.
        state = {}
        for g, d in debates:
            for side in ("a", "b"):
                state[(g, d, side)] = {"prompt": ctx.prompt(problems[g], DEBATE_INSTRUCTIONS.format(side=side.upper())),
                                       "tokens": [], "logprobs": [], "mask": [], "turns": []}
        sampled = 0
        for round_index in range(1, ROUNDS + 1):
            ctx.log(f"[debate] Round {round_index}/{ROUNDS}: {2 * len(debates)} turns in one batched call")
            if round_index > 1:
                for g, d in debates:
                    for side, other in (("a", "b"), ("b", "a")):
                        me, them = state[(g, d, side)], state[(g, d, other)]
                        injected = splicer.inject_user_turn(me["turns"][-1], ctx.eos_ids, intro,
                                                            them["turns"][-1], outro)
                        me["tokens"] += injected
                        me["logprobs"] += [0.0] * len(injected)
                        me["mask"] += [0] * len(injected)
            keys = [(g, d, side) for g, d in debates for side in ("a", "b")]
            with ctx.batch():
                futures = [ctx.sample(state[k]["prompt"] + state[k]["tokens"], 1,
                                      mix_seed(ctx.settings.seed, step, round_index, ctx.group_index(k[0]), k[1],
                                               ord(k[2]))) for k in keys]
            for key, future in zip(keys, futures, strict=True):
                sequence = future.result().sequences[0]
                turn = list(sequence.tokens)
                me = state[key]
                me["turns"].append(turn)
                me["tokens"] += turn
                me["logprobs"] += list(sequence.logprobs)
                me["mask"] += [1] * len(turn)
                sampled += len(turn)
        outcomes, blocked = [], {}
        for g, d in debates:
            finals = {side: ctx.decode(state[(g, d, side)]["turns"][-1]) for side in ("a", "b")}
            # The final turn is scored; the blocklist sees every own turn (never the opponent's injected one).
            scored = {side: ctx.score(problems[g], finals[side], "\n".join(
                ctx.decode(turn) for turn in state[(g, d, side)]["turns"])) for side in ("a", "b")}
            blocked.update({(g, d, side): scored[side].metrics.get("blocked", 0.0) > 0 for side in ("a", "b")})
            outcomes.append(DebateOutcome(f"s{step}-g{ctx.group_index(g)}-d{d}", ctx.task.user_message(problems[g]),
                                          finals["a"], finals["b"], scored["a"].reward, scored["b"].reward))
        verdicts = ctx.judge.judge(outcomes)
        rollouts, records = [], []
        for (g, d), outcome, verdict in zip(debates, outcomes, verdicts, strict=True):
            for side in ("a", "b"):
                me = state[(g, d, side)]
                # A rejected (blocklisted) debater never wins: reward 0, no rejection-sampling datum.
                won = verdict.winner == side and not (blocked[(g, d, side)] and ctx.blocklist.reject)
                task_reward = outcome.task_reward_a if side == "a" else outcome.task_reward_b
                rollouts.append(Rollout(me["prompt"], me["tokens"], me["logprobs"], me["mask"], problems[g].id,
                                        ctx.group_index(g),
                                        f"debater_{side}", 1.0 if won else 0.0, task_reward, won=won,
                                        metadata={"debate_id": outcome.debate_id, "rounds": ROUNDS}))
            records.append({
                "debate_id": outcome.debate_id, "problem_id": problems[g].id, "group": ctx.group_index(g),
                "rounds": [{"round": r + 1,
                            **{side: {"text": ctx.decode(state[(g, d, side)]["turns"][r]),
                                      "tokens": state[(g, d, side)]["turns"][r]} for side in ("a", "b")}}
                           for r in range(ROUNDS)],
                "verdict": {"winner": verdict.winner, "judge": verdict.judge, "scores": verdict.scores},
                "task_rewards": {"a": outcome.task_reward_a, "b": outcome.task_reward_b},
                "blocked": {side: blocked[(g, d, side)] for side in ("a", "b")},
            })
        wins_a = sum(1 for v in verdicts if v.winner == "a")
        payload = {"step": step, "env": ctx.task.name, "debates": records}
        return RolloutBatch(rollouts, "debate", payload, sampled,
                            metrics={"debate/a_win_fraction": wins_a / max(1, len(verdicts)), **ctx.step_metrics()})
