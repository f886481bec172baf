"""The sampling distribution as a pure function of logits: temperature, top-k, top-p, min-p.

This is the project's own statement of what "the distribution actually sampled" is. The HF
engine lets transformers apply its warpers while generating; the teacher-forced side of every
parity check applies these functions instead, so the two are independent implementations
that must agree. Semantics follow transformers' warpers, in the same order
(temperature → top-k → top-p → min-p): ties at the top-k boundary are kept, top-p keeps the
smallest set whose mass is at least ``top_p`` and always at least one token, min-p drops tokens
whose probability is below ``min_p`` times the top token's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlrunbook.errors import ConfigError
from rlrunbook.kernels import ops as fixed


@dataclass(frozen=True)
class SamplingFilters:
    """Validated sampling knobs. ``temperature == 0`` means greedy; ``top_k = -1`` means no limit."""

    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ConfigError(f"temperature={self.temperature} must be >= 0 (0 = greedy).")
        if self.top_k == 0 or self.top_k < -1:
            raise ConfigError(f"top_k={self.top_k} must be -1 (no limit) or a positive count.")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p={self.top_p} must be in (0, 1]; 1 disables nucleus filtering.")
        if not 0 <= self.min_p < 1:
            raise ConfigError(f"min_p={self.min_p} must be in [0, 1); 0 disables min-p filtering.")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def filters_tokens(self) -> bool:
        """Whether any knob can remove tokens from the distribution (temperature alone cannot)."""
        return self.top_k != -1 or self.top_p < 1 or self.min_p > 0


def _probabilities(scores: torch.Tensor) -> torch.Tensor:
    """``softmax(scores, -1)`` of float32 scores as ``exp(scores - logsumexp(scores))`` by the fixed-order kernels
    (:mod:`rlrunbook.kernels`): a row's probabilities, and so which tokens a filter keeps, do not depend on its
    batch."""
    shape = scores.shape
    flat = scores.reshape(-1, shape[-1]).float()
    return fixed.exp(flat - fixed.row_logsumexp(flat)[:, None]).view(shape)


def apply_filters(logits: torch.Tensor, filters: SamplingFilters) -> torch.Tensor:
    """Scores of the sampling distribution: ``logits / T`` with removed tokens set to ``-inf``.

    ``logits``: ``[..., V]`` float. Greedy (T = 0) returns the logits unchanged: the reported
    logprobs of a greedy sample are those of the T = 1 policy.
    """
    if filters.greedy:
        return logits
    scores = logits / filters.temperature if filters.temperature != 1.0 else logits
    if filters.top_k != -1:
        k = min(filters.top_k, scores.shape[-1])
        kth = torch.topk(scores, k, dim=-1).values[..., -1:]  # [..., 1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if filters.top_p < 1:
        sorted_scores, order = torch.sort(scores, dim=-1, descending=False)
        cumulative = _probabilities(sorted_scores).cumsum(dim=-1)  # ascending mass, summed in order
        remove_sorted = cumulative <= (1 - filters.top_p)
        remove_sorted[..., -1:] = False  # the most likely token always stays
        remove = remove_sorted.scatter(-1, order, remove_sorted)
        scores = scores.masked_fill(remove, float("-inf"))
    if filters.min_p > 0:
        probs = _probabilities(scores)
        threshold = filters.min_p * probs.amax(dim=-1, keepdim=True)
        remove = probs < threshold
        remove.scatter_(-1, probs.argmax(dim=-1, keepdim=True), False)
        scores = scores.masked_fill(remove, float("-inf"))
    return scores


def sampling_logprobs(logits: torch.Tensor, filters: SamplingFilters) -> torch.Tensor:
    """Log-probabilities ``[..., V]`` of the distribution that ``filters`` sample from."""
    return torch.log_softmax(apply_filters(logits.float(), filters), dim=-1)
