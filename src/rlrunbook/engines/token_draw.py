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
from rlrunbook.kernels import ops as fixed

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


def draw_tokens_fused(logits: torch.Tensor, filters: SamplingFilters, row_seeds: torch.Tensor, step: int) -> Draw:
    """:func:`draw_tokens` with the fixed-order :func:`~rlrunbook.kernels.ops.log_softmax_at`, bit for bit, in one
    kernel (:func:`~rlrunbook.kernels.ops.seeded_draw`: noise, argmax and both logprobs) on CPU or CUDA.

    Temperature is applied inside the kernel; filters that remove tokens (top-k, top-p, min-p) are applied first by
    :func:`~rlrunbook.engines.filters.apply_filters`, whose scores the kernel then draws from.
    """
    logits = logits.float()
    filtered = apply_filters(logits, filters) if filters.filters_tokens and not filters.greedy else None
    token, sampled, policy = fixed.seeded_draw(logits, row_seeds, step, temperature=filters.temperature,
                                               filtered=filtered, greedy=filters.greedy)
    return Draw(token, sampled, policy)


class StepDraws:
    """The draws of up to ``width`` consecutive decode steps of ``rows`` rows, kept on the device and read back to
    the host at once (:meth:`read`): column ``j`` holds step ``j``'s tokens and logprobs.

    ``fused`` chooses how a step is drawn into them: :func:`draw_tokens_fused` writing in place (one kernel, which
    also writes the next step's input ``feed``), or :func:`draw_tokens` and copies (the reference, and what numerics
    other than the fixed-order ones use, with their ``log_softmax_at``)."""

    def __init__(self, rows: int, width: int, device: torch.device, fused: bool,
                 log_softmax_at: LogSoftmaxAt = torch_log_softmax_at):
        self.token = torch.zeros(rows, width, dtype=torch.int64, device=device)
        self.sampled = torch.zeros(rows, width, dtype=torch.float32, device=device)
        self.policy = torch.zeros(rows, width, dtype=torch.float32, device=device)
        self.fused = fused
        self.log_softmax_at = log_softmax_at

    def draw(self, logits: torch.Tensor, filters: SamplingFilters, row_seeds: torch.Tensor, step: int, column: int,
             feed: torch.Tensor, feed_index: torch.Tensor) -> None:
        """Draw step ``step`` for the ``R`` rows of ``logits`` into column ``column`` of the first ``R`` rows, and
        set ``feed[feed_index[r]]`` to row ``r``'s token."""
        if self.fused:
            logits = logits if logits.dtype == torch.float32 else logits.float()
            filtered = apply_filters(logits, filters) if filters.filters_tokens and not filters.greedy else None
            fixed.seeded_draw(logits, row_seeds, step, temperature=filters.temperature, filtered=filtered,
                              greedy=filters.greedy, out=(self.token, self.sampled, self.policy), column=column,
                              feed=feed, feed_index=feed_index)
            return
        draw = draw_tokens(logits, filters, row_seeds, step, self.log_softmax_at)
        rows = draw.token.shape[0]
        self.token[:rows, column] = draw.token
        self.sampled[:rows, column] = draw.sampled_logprob
        self.policy[:rows, column] = draw.policy_logprob
        feed[feed_index] = draw.token

    def read(self, rows: int, columns: int, flag: torch.Tensor | None = None
             ) -> tuple[list[list[int]], list[list[float]], list[list[float]], bool]:
        """The first ``columns`` steps of the first ``rows`` rows as host lists ``[rows][columns]`` (tokens,
        sampled and policy logprobs), and ``flag`` (a device bool, e.g. a failed check; ``False`` if ``None``),
        in one device-to-host transfer."""
        parts = [self.token[:rows, :columns].double(), self.sampled[:rows, :columns].double(),
                 self.policy[:rows, :columns].double()]
        flat = torch.cat([p.flatten() for p in parts] + ([flag.double().reshape(1)] if flag is not None else []))
        values = flat.tolist()
        size = rows * columns
        grid = [[values[k * size + r * columns:k * size + (r + 1) * columns] for r in range(rows)] for k in range(3)]
        tokens = [[int(t) for t in row] for row in grid[0]]
        return tokens, grid[1], grid[2], bool(flag is not None and values[-1])
