"""One sampling step as a pure function of logits: the token each row draws and its logprobs.

Shared by every in-process engine, so "the distribution actually sampled" has one definition:
``logits / T`` after the requested filters (:mod:`rlrunbook.engines.filters`), drawn exactly by the
Gumbel-max trick with per-row counter-based noise (:mod:`rlrunbook.engines.noise`), so a row's
token depends on its own seed and step only, never on which rows share its batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlrunbook.engines.filters import SamplingFilters, apply_filters
from rlrunbook.engines.noise import gumbel_noise


@dataclass(frozen=True)
class Draw:
    """Per row: the ``token`` drawn, its logprob under the sampled distribution and under the T = 1 policy."""

    token: torch.Tensor  # [R] long
    sampled_logprob: torch.Tensor  # [R] float32
    policy_logprob: torch.Tensor  # [R] float32


def draw_tokens(logits: torch.Tensor, filters: SamplingFilters, row_seeds: torch.Tensor, step: int) -> Draw:
    """Draw one token per row of ``logits`` (``[R, V]``) with row seeds ``row_seeds`` (``[R]``) at ``step``.

    Greedy (T = 0) takes the argmax and reports T = 1 logprobs for both.
    """
    logits = logits.float()
    policy = torch.log_softmax(logits, dim=-1)
    if filters.greedy:
        token = logits.argmax(dim=-1)
        sampled = policy
    else:
        processed = apply_filters(logits, filters)  # logits / T, filtered tokens -inf
        sampled = policy if processed is logits else torch.log_softmax(processed, dim=-1)
        noise = gumbel_noise(row_seeds, step, logits.shape[-1])
        token = (processed + noise).argmax(dim=-1)  # an exact draw from softmax(processed)
    picked = token[:, None]
    return Draw(token, sampled.gather(-1, picked).squeeze(-1), policy.gather(-1, picked).squeeze(-1))
