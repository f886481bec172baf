"""pass@k, mean@k and bootstrap confidence intervals for sampled evaluations (pure functions).

An evaluation samples ``n`` completions for each of ``P`` problems and scores each one; these
functions turn the ``P x n`` rewards into the numbers a report quotes:

- ``pass_at_k(n, c, k)``: the unbiased estimator of Chen et al. 2021, "Evaluating Large Language
  Models Trained on Code", eq. 1: ``1 - C(n-c, k) / C(n, k)``, the probability that at least one of
  ``k`` samples drawn without replacement from the ``n`` is correct. Not ``1 - (1 - c/n)^k``, which
  is biased low for ``k > 1``.
- ``mean_at_k``: the expected mean reward of ``k`` samples. By linearity of expectation it equals
  the mean of the per-problem means for every ``k <= n``: ``k`` changes the variance, not the mean.
  (The seed guide's "mean@5 = average of best-of-5" is a different number: ``expected_max_at_k``.)
- ``bootstrap_ci``: percentile bootstrap over problems. Problems, not samples, are resampled
  because samples of one problem are correlated; resampling them would make the interval too narrow.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from rlrunbook.errors import ConfigError, InputError

# Bootstrap index matrices are built in chunks of at most this many entries (~64 MB of int64),
# so 2000 resamples of 100k problems do not allocate 1.6 GB at once.
_BOOTSTRAP_CHUNK_ENTRIES = 8_000_000


def _check_count(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise InputError(f"{name}={value!r} must be a non-negative int")
    return int(value)


def _check_k(k: int, n: int) -> int:
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise ConfigError(f"k={k!r} must be a positive int (pass@k needs at least one sample)")
    if k > n:
        raise ConfigError(f"k={k} is larger than the {n} samples per problem: pass@{k} cannot be "
                          f"estimated from {n}; drop k={k} or sample at least {k} completions per problem")
    return int(k)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem with ``c`` correct among ``n`` samples (Chen et al. 2021, eq. 1).

    ``1 - C(n-c, k)/C(n, k)`` as the product ``1 - prod_{i=n-c+1}^{n} (1 - k/i)`` (the paper's
    numpy form): C(2000, 1000) ~ 1e600 is past float range, while every factor lies in [0, 1].
    Example: n=5, c=2, k=2 -> 1 - C(3,2)/C(5,2) = 1 - 3/10 = 0.7.
    """
    n, c = _check_count("n", n), _check_count("c", c)
    if c > n:
        raise InputError(f"c={c} correct samples is more than the n={n} samples drawn")
    k = _check_k(k, n)
    if n - c < k:  # every k-subset contains a correct sample
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def expected_max_at_k(rewards: Sequence[float], k: int) -> float:
    """Unbiased expected best reward of ``k`` of these samples drawn without replacement ("best-of-k").

    With rewards sorted ascending, ``r_(i)`` (1-based) is the maximum of ``C(i-1, k-1)`` of the
    ``C(n, k)`` subsets; with 0/1 rewards this equals ``pass_at_k``.
    """
    values = np.sort(_finite_array(rewards, "rewards"))
    n = len(values)
    k = _check_k(k, n)
    # weight_i = C(i-1, k-1) / C(n, k), built as a running product so it never overflows.
    weights = np.zeros(n)
    weight = k / n  # i = n: C(n-1, k-1) / C(n, k)
    for i in range(n, k - 1, -1):
        weights[i - 1] = weight
        weight *= (i - k) / (i - 1) if i > 1 else 0.0  # C(i-2,k-1)/C(i-1,k-1)
    return float(np.dot(weights, values))


def _finite_array(values: Sequence[float], what: str) -> np.ndarray:
    try:
        array = np.asarray(values, dtype=float)
    except (TypeError, ValueError) as exc:
        raise InputError(f"{what} must be numbers: {exc}") from None
    if array.ndim != 1 or array.size == 0:
        raise InputError(f"{what} must be a non-empty flat sequence of numbers, got shape {array.shape}")
    if not np.all(np.isfinite(array)):
        first = int(np.argmin(np.isfinite(array)))
        raise InputError(f"{what} holds a NaN or infinite value at index {first}")
    return array


def _per_problem(values_per_problem: Sequence[Sequence[float]], what: str) -> list[np.ndarray]:
    if len(values_per_problem) == 0:
        raise InputError(f"{what} is empty: evaluate at least one problem")
    return [_finite_array(v, f"{what}[{i}]") for i, v in enumerate(values_per_problem)]


def mean_at_k(rewards_per_problem: Sequence[Sequence[float]], k: int) -> float:
    """Expected mean reward of ``k`` samples per problem: the mean of the per-problem means.

    Unbiased for every ``k <= n`` (linearity of expectation), so the value does not depend on ``k``;
    ``k`` is still checked against each problem's sample count so a typo is not reported as a number.
    """
    problems = _per_problem(rewards_per_problem, "rewards_per_problem")
    for rewards in problems:
        _check_k(k, len(rewards))
    return float(np.mean([rewards.mean() for rewards in problems]))


def _pass_at_k_each(correct_per_problem: Sequence[Sequence[bool]], k: int) -> list[float]:
    if len(correct_per_problem) == 0:
        raise InputError("correct_per_problem is empty: evaluate at least one problem")
    return [pass_at_k(len(correct), sum(bool(x) for x in correct), k) for correct in correct_per_problem]


def pass_at_k_dataset(correct_per_problem: Sequence[Sequence[bool]], k: int) -> float:
    """The mean over problems of each problem's unbiased pass@k (problems may have different ``n``)."""
    return float(np.mean(_pass_at_k_each(correct_per_problem, k)))


def bootstrap_ci(
    per_problem_values: Sequence[float], confidence: float = 0.95, resamples: int = 2000, seed: int = 0
) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of ``per_problem_values``, resampling problems.

    Deterministic for a given ``seed``. One problem gives ``(v, v)``: a bootstrap cannot see
    variance that was never sampled, so an interval from few problems is optimistic.
    """
    values = _finite_array(per_problem_values, "per_problem_values")
    if not 0.0 < confidence < 1.0:
        raise ConfigError(f"confidence={confidence!r} must lie strictly between 0 and 1 (e.g. 0.95)")
    if isinstance(resamples, bool) or not isinstance(resamples, int) or resamples < 1:
        raise ConfigError(f"resamples={resamples!r} must be a positive int (e.g. 2000)")
    rng = np.random.default_rng(seed)
    m = len(values)
    per_chunk = max(1, _BOOTSTRAP_CHUNK_ENTRIES // m)
    means = np.concatenate([
        values[rng.integers(0, m, size=(min(per_chunk, resamples - start), m))].mean(axis=1)
        for start in range(0, resamples, per_chunk)
    ])
    alpha = (1.0 - confidence) / 2.0
    low, high = np.quantile(means, [alpha, 1.0 - alpha])
    return float(low), float(high)


@dataclass(frozen=True)
class EvalSummary:
    """What ``summarize_eval`` reports; ``pass_at``/``pass_ci``/``mean_at`` are keyed by k."""

    num_problems: int
    samples_per_problem: int
    mean_reward: float
    pass_at: dict[int, float]
    pass_ci: dict[int, tuple[float, float]]
    mean_at: dict[int, float]
    mean_ci: tuple[float, float]
    threshold: float
    """A sample passes when its reward is ``>= threshold``."""
    confidence: float

    def to_dict(self) -> dict[str, object]:
        """A flat JSON-able dict: ``pass@1``, ``pass@1_ci``, ``mean@1`` ... (for logs and tables)."""
        out: dict[str, object] = {"num_problems": self.num_problems,
                                  "samples_per_problem": self.samples_per_problem,
                                  "mean_reward": self.mean_reward, "mean_ci": list(self.mean_ci),
                                  "threshold": self.threshold, "confidence": self.confidence}
        for k in self.pass_at:
            out[f"pass@{k}"] = self.pass_at[k]
            out[f"pass@{k}_ci"] = list(self.pass_ci[k])
            out[f"mean@{k}"] = self.mean_at[k]
        return out


def summarize_eval(
    rewards_per_problem: Sequence[Sequence[float]],
    ks: Sequence[int] = (1, 4, 8),
    threshold: float = 1.0,
    confidence: float = 0.95,
    resamples: int = 2000,
    seed: int = 0,
) -> EvalSummary:
    """pass@k and mean@k with bootstrap intervals for a ``P x n`` table of rewards.

    Every problem must have the same ``n`` (a ragged table usually means lost samples), and every
    k must be ``<= n``. All intervals use the same ``seed``, hence the same resampled problem sets.
    """
    problems = _per_problem(rewards_per_problem, "rewards_per_problem")
    n = len(problems[0])
    ragged = [(i, len(r)) for i, r in enumerate(problems) if len(r) != n]
    if ragged:
        i, count = ragged[0]
        raise InputError(f"problem {i} has {count} samples but problem 0 has {n}: every problem needs "
                         f"the same number ({len(ragged)} differ); re-run the lost samples or drop them")
    if len(ks) == 0:
        raise ConfigError("ks is empty: give at least one k, e.g. (1, 4, 8)")
    bad = [k for k in ks if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1]
    if bad:
        raise ConfigError(f"ks={list(ks)} holds {bad}: every k must be a positive int")
    too_large = sorted({int(k) for k in ks if k > n})
    if too_large:
        raise ConfigError(f"ks {too_large} exceed the {n} samples per problem: pass@k needs k <= samples; "
                          f"drop them or sample at least {too_large[-1]} completions per problem")
    if not math.isfinite(threshold):
        raise ConfigError(f"threshold={threshold!r} must be a finite reward")
    correct = [(rewards >= threshold).tolist() for rewards in problems]
    means = [float(rewards.mean()) for rewards in problems]
    mean_reward = float(np.mean(means))
    mean_ci = bootstrap_ci(means, confidence, resamples, seed)
    pass_at: dict[int, float] = {}
    pass_ci: dict[int, tuple[float, float]] = {}
    for k in sorted({int(k) for k in ks}):
        each = _pass_at_k_each(correct, k)
        pass_at[k] = float(np.mean(each))
        pass_ci[k] = bootstrap_ci(each, confidence, resamples, seed)
    return EvalSummary(
        num_problems=len(problems), samples_per_problem=n, mean_reward=mean_reward, pass_at=pass_at,
        pass_ci=pass_ci, mean_at={k: mean_reward for k in pass_at}, mean_ci=mean_ci,
        threshold=float(threshold), confidence=float(confidence),
    )
