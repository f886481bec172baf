"""Judges: the mock judge's rule, and the model judge's reading of letter logprobs."""

from __future__ import annotations

from concurrent.futures import Future

from tinker.lib.public_interfaces.api_future import AwaitableConcurrentFuture

from rlrunbook.rl.rollout.judges import DebateOutcome, MockJudge, ModelJudge


def outcome(i: int, ra: float, rb: float) -> DebateOutcome:
    return DebateOutcome(f"d{i}", "What is 2 + 2?", "4", "5", ra, rb)


def test_mock_judge_prefers_the_higher_task_reward_and_settles_ties_by_id():
    verdicts = MockJudge().judge([outcome(0, 1.0, 0.0), outcome(1, 0.0, 0.5), outcome(2, 0.3, 0.3)])
    assert [v.winner for v in verdicts[:2]] == ["a", "b"]
    again = MockJudge().judge([outcome(2, 0.3, 0.3)])
    assert verdicts[2].winner == again[0].winner, "a tie is settled the same way every time"
    ties = {MockJudge().judge([outcome(i, 0.0, 0.0)])[0].winner for i in range(20)}
    assert ties == {"a", "b"}, "the coin is not constant"


class ScriptedSampler:
    """A sampler whose logprob of the last token is scripted per token id (a true boundary fake)."""

    def __init__(self, last_logprob: dict[int, float]):
        self.last_logprob = last_logprob
        self.prompts: list[list[int]] = []

    def compute_logprobs(self, prompt):
        tokens = prompt.to_ints()
        self.prompts.append(tokens)
        future: Future = Future()
        future.set_result([None] + [-1.0] * (len(tokens) - 2) + [self.last_logprob[tokens[-1]]])
        return AwaitableConcurrentFuture(future)


def test_model_judge_picks_the_letter_with_the_higher_logprob(tiny_host):
    tok = tiny_host.tokenizer
    a, b = (tok.encode(x, add_special_tokens=False)[0] for x in ("A", "B"))
    judge = ModelJudge(ScriptedSampler({a: -0.5, b: -2.0}), tok)
    (verdict,) = judge.judge([outcome(0, 0.0, 1.0)])
    assert verdict.winner == "a" and verdict.scores == {"a": -0.5, "b": -2.0} and verdict.judge == "model"
    judge = ModelJudge(ScriptedSampler({a: -3.0, b: -0.1}), tok)
    assert judge.judge([outcome(0, 1.0, 0.0)])[0].winner == "b", "the task reward does not decide"
    prompt = judge.sampler.prompts[0]
    assert "Debater A's final answer" in tok.decode(prompt)
