"""Reward functions: pure functions of text returning a ``RewardResult`` (reward and named metrics).

QA (``qa_numeric_reward``, ``qa_text_reward``), summarisation (``compression_reward``,
``rouge_reward``) and math with a real answer checker (``math_reward``).
"""

from rlrunbook.rl.rewards.base import RewardResult
from rlrunbook.rl.rewards.math import extract_math_answer, math_answers_equal, math_reward, parse_math_value
from rlrunbook.rl.rewards.qa import extract_last_number, normalize_answer, qa_numeric_reward, qa_text_reward
from rlrunbook.rl.rewards.summary import MIN_WORDS, compression_reward, rouge_reward

__all__ = [
    "MIN_WORDS",
    "RewardResult",
    "compression_reward",
    "extract_last_number",
    "extract_math_answer",
    "math_answers_equal",
    "math_reward",
    "normalize_answer",
    "parse_math_value",
    "qa_numeric_reward",
    "qa_text_reward",
    "rouge_reward",
]
