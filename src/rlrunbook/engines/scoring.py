"""Teacher-forced logprobs: the trainer's view of a token sequence, shared by trainer and checks."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rlrunbook.engines.filters import SamplingFilters, apply_filters
from rlrunbook.tokens import pad_batch


def gather_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``log_softmax(logits)[..., target]`` without materialising a second ``[..., V]`` tensor.

    ``logits``: ``[B, L, V]`` (any float dtype, computed in fp32); ``targets``: ``[B, L]`` → ``[B, L]``.
    """
    logits = logits.float()
    picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # [B, L]
    return picked - torch.logsumexp(logits, dim=-1)


@torch.no_grad()
def teacher_forced_logprobs(
    model: torch.nn.Module,
    sequences: Sequence[Sequence[int]],
    pad_id: int,
    filters: SamplingFilters | None = None,
    batch_size: int = 16,
) -> list[torch.Tensor]:
    """Logprob of each token given the tokens before it, for every sequence.

    Returns one fp32 tensor of length ``len(seq) - 1`` per sequence (the first token has no
    context). With ``filters`` the logprobs are under that sampling distribution (logits / T,
    top-k, top-p, min-p), computed by :mod:`rlrunbook.engines.filters`, independently of the
    engine that sampled; without, under the raw T = 1 policy.
    """
    device = next(model.parameters()).device
    results: list[torch.Tensor] = []
    for start in range(0, len(sequences), batch_size):
        chunk = sequences[start:start + batch_size]
        batch = pad_batch(chunk, pad_id, side="right")
        logits = model(
            input_ids=batch.input_ids.to(device),
            attention_mask=batch.attention_mask.to(device),
            position_ids=batch.position_ids.to(device),
        ).logits[:, :-1]  # [B, L-1, V]: position i predicts token i+1
        targets = batch.input_ids[:, 1:].to(device)
        if filters is None:
            lp = gather_logprobs(logits, targets)
        else:
            scores = torch.log_softmax(apply_filters(logits.float(), filters), dim=-1)
            lp = scores.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        for row, seq in enumerate(chunk):
            results.append(lp[row, : len(seq) - 1].cpu())
    return results
