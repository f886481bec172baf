r"""The multi-signal reward α·verify + β·format + γ·reflect against hand-derived values.

Each row: a completion, the task's verdict inputs, and the signals read off by hand from the
definitions in ``rlrunbook.rl.rewards.multi_signal`` (default weights 1.0 / 0.5 / 0.5, so
total = verify + 0.5·format + 0.5·reflect).
"""

from __future__ import annotations

import pydantic
import pytest

from rlrunbook.errors import ConfigError
from rlrunbook.rl.data import QARecord
from rlrunbook.rl.rewards.multi_signal import (
    BOXED,
    TRAILING_NUMBER,
    SignalWeights,
    format_signal,
    multi_signal_reward,
    reflect_signal,
)
from rlrunbook.rl.rollout.tasks import MathTask, Problem, QATask
from rlrunbook.rl.setup.config import TrainConfig
from rlrunbook.rl.setup.prepare import prepare

# math, reference "12": (completion, verify, format, reflect, total)
MATH_CASES = [
    # answer boxed once, no check
    (r"3*4 = 12, so \boxed{12}", 1, 1, 0, 1.5),
    # answer (12), cue "check", the same answer again (boxed): all three
    (r"3*4 = 12. Let me check: 12/4 = 3, so the answer is \boxed{12}.", 1, 1, 1, 2.0),
    # right answer in words: verified, but not boxed
    ("The answer is 12.", 1, 0, 0, 1.0),
    # boxed wrong answer: format only
    (r"\boxed{13}", 0, 1, 0, 0.5),
    # wrong answer, checked and restated: format and reflect (reflect does not need correctness)
    (r"I get 13. Double-check: 13. \boxed{13}", 0, 1, 1, 1.0),
    # two different boxed answers: the last (13) is read, and the form is not "one answer"
    (r"\boxed{12} or maybe \boxed{13}", 0, 0, 0, 0.0),
    # the same answer boxed twice around a cue: still one answer
    (r"\boxed{12}. Verify: 3*4 = 12 \boxed{12}", 1, 1, 1, 2.0),
    # cue before any answer: nothing to re-check yet
    (r"Let me check. 3*4 = 12 \boxed{12}", 1, 1, 0, 1.5),
    # "checkers" is not a cue word
    (r"12 checkers. \boxed{12}", 1, 1, 0, 1.5),
    # empty box: no answer at all
    (r"\boxed{}", 0, 0, 0, 0.0),
    # unclosed box: not well-formed; the last-number fallback still verifies 12
    (r"\boxed{12", 1, 0, 0, 1.0),
]

# qa, reference "56"
QA_CASES = [
    ("7 * 8 = 56", 1, 1, 0, 1.5),
    # the answer is not the last thing said
    ("56 is the answer", 1, 0, 0, 1.0),
    ("7*8 = 56. Check: 56 / 8 = 7. So 56.", 1, 1, 1, 2.0),
    # the check ends on another number: that is the final answer now (7), wrong, and not restated
    ("7*8 = 56. Check: 56 / 8 = 7", 0, 1, 0, 0.5),
    ("no idea", 0, 0, 0, 0.0),
    # closing markdown and punctuation do not hide a trailing number
    ("It is **56**.", 1, 1, 0, 1.5),
    ("57. Verify: 57", 0, 1, 1, 1.0),
]


def _math_task(**options) -> MathTask:
    return MathTask(None, "multi_signal", 0, options)


def _qa_task(**options) -> QATask:
    return QATask("test", "multi_signal", 0, options)


@pytest.mark.parametrize(("text", "verify", "form", "reflect", "total"), MATH_CASES)
def test_math_signals_and_total(text, verify, form, reflect, total):
    result = _math_task().reward(Problem("p", QARecord("p", "What is 3*4?", ("12",))), text)
    assert (result.metrics["verify"], result.metrics["format"], result.metrics["reflect"]) == (verify, form, reflect)
    assert result.reward == pytest.approx(total)
    assert format_signal(text, BOXED) == form and reflect_signal(text, BOXED) == reflect


@pytest.mark.parametrize(("text", "verify", "form", "reflect", "total"), QA_CASES)
def test_qa_signals_and_total(text, verify, form, reflect, total):
    result = _qa_task().reward(Problem("p", QARecord("p", "What is 7*8?", ("56",))), text)
    assert (result.metrics["verify"], result.metrics["format"], result.metrics["reflect"]) == (verify, form, reflect)
    assert result.reward == pytest.approx(total)
    assert format_signal(text, TRAILING_NUMBER) == form and reflect_signal(text, TRAILING_NUMBER) == reflect


def test_weights_scale_each_signal_and_are_not_normalised():
    text = "7*8 = 56. Check: 56 / 8 = 7. So 56."  # all three signals 1
    assert multi_signal_reward(text, True, TRAILING_NUMBER, SignalWeights(2.0, 1.0, 0.0)).reward == 3.0
    assert multi_signal_reward(text, False, TRAILING_NUMBER, SignalWeights(2.0, 1.0, 0.25)).reward == 1.25
    problem = Problem("p", QARecord("p", "What is 7*8?", ("56",)))
    task = _qa_task(verify_weight=2.0, format_weight=1.0, reflect_weight=0.0)
    assert task.reward(problem, text).reward == 3.0


def test_negative_weights_are_refused():
    with pytest.raises(ConfigError, match="must be >= 0"):
        SignalWeights(verify=-1.0)
    with pytest.raises(pydantic.ValidationError, match="reward.format_weight|greater than or equal"):
        TrainConfig(reward={"format_weight": -0.5})


def test_prepare_hands_the_weights_to_the_task(generated_data):
    config = TrainConfig(env="math", reward_fn="multi_signal", reward={"verify_weight": 2.0, "reflect_weight": 0.0})
    _, _, task, problems = prepare(config)
    problem = problems[0]
    boxed = rf"\boxed{{{problem.record.answers[0]}}}"
    assert task.reward(problem, boxed).reward == 2.0 + 0.5  # verify and format, weights 2.0 / 0.5


def test_qa_multi_signal_refuses_text_answers(generated_data):
    with pytest.raises(ConfigError, match="verifies numeric answers"):
        prepare(TrainConfig(env="qa", dataset="nq_open", reward_fn="multi_signal"))


def test_the_h100_rlvr_preset_validates_strictly(capsys):
    from rlrunbook import cli

    assert cli.main(["show-config", "--config-file", "h100-rlvr", "--strict-config"]) == 0
    assert "reward_fn: multi_signal" in capsys.readouterr().out
