"""One sampling step as a pure function of logits: the token each row draws and its logprobs.

Shared by every in-process engine, so "the distribution actually sampled" has one definition:
``logits / T`` after the requested filters (:mod:`rlrunbook.engines.filters`), drawn exactly by the
Gumbel-max trick with per-row counter-based noise (:mod:`rlrunbook.engines.noise`), so a row's
token depends on its own seed and step only, never on which rows share its batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from rlrunbook.engines.filters import SamplingFilters, apply_filters
from rlrunbook.engines.noise import gumbel_noise

LogSoftmaxAt = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def torch_log_softmax_at(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``log_softmax(logits, -1)[targets]`` by PyTorch's kernel (``[R, V]`` logits, ``[R]`` targets)."""
    return torch.log_softmax(logits, dim=-1).gather(-1, targets[:, None]).squeeze(-1)


@dataclass(frozen=True)
class Draw:
    """Per row: the ``token`` drawn, its logprob under the sampled distribution and under the T = 1 policy."""

    token: torch.Tensor  # [R] long
    sampled_logprob: torch.Tensor  # [R] float32
    policy_logprob: torch.Tensor  # [R] float32


def draw_tokens(logits: torch.Tensor, filters: SamplingFilters, row_seeds: torch.Tensor, step: int,
                log_softmax_at: LogSoftmaxAt = torch_log_softmax_at) -> Draw:
    """Draw one token per row of ``logits`` (``[R, V]``) with row seeds ``row_seeds`` (``[R]``) at ``step``.

    ``log_softmax_at`` computes the reported logprobs: the trainer's own function (the decoder's
    :meth:`~rlrunbook.engines.decoder.Decoder.log_softmax_at`), so the two agree on what a logprob is.
    Greedy (T = 0) takes the argmax and reports T = 1 logprobs for both.
    """
    logits = logits.float()
    if filters.greedy:
        token = logits.argmax(dim=-1)
        policy = log_softmax_at(logits, token)
        return Draw(token, policy, policy)
    processed = apply_filters(logits, filters)  # logits / T, filtered tokens -inf
    noise = gumbel_noise(row_seeds, step, logits.shape[-1])
    token = (processed + noise).argmax(dim=-1)  # an exact draw from softmax(processed)
    policy = log_softmax_at(logits, token)
    sampled = policy if processed is logits else log_softmax_at(processed, token)
    return Draw(token, sampled, policy)
