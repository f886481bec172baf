"""Splitting a ``forward_backward`` batch into micro-batches of a token budget (pure: token ids in, ranges out).

A micro-batch runs its own forward and backward; the loss being a token sum, the gradients of the micro-batches
add up to the gradient of the whole batch (up to the order of floating-point additions). What a micro-batch
costs in memory grows with the tokens its forward computes, and the trainer computes each distinct prefix once
(:mod:`rlrunbook.engines.shared_prefix`): a group's samples share their prompt. So the budget counts distinct
prefixes, as the trainer does, and datums are kept in order, so a group's samples stay together where the
budget allows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from rlrunbook.prefix_tree import TokenTrie


class MicroBatch(NamedTuple):
    """Datums ``start`` to ``stop`` (exclusive) of a batch, whose forward computes ``tokens`` distinct tokens."""

    start: int
    stop: int
    tokens: int


def distinct_tokens(sequences: Sequence[Sequence[int]]) -> int:
    """Tokens a shared-prefix forward over ``sequences`` computes: their distinct prefixes."""
    trie = TokenTrie()
    for tokens in sequences:
        trie.insert(tokens)
    return len(trie)


def micro_batches(sequences: Sequence[Sequence[int]], budget: int | None, chunks: int = 1) -> list[MicroBatch]:
    """Consecutive micro-batches of ``sequences``, each computing at most ``budget`` distinct tokens.

    ``chunks`` first cuts the batch into that many near-equal parts by count (the older
    ``grad_accum_chunks`` knob), each then split by the budget. A sequence longer than the budget on its own
    is a micro-batch by itself (a sequence is never cut). ``budget=None``: no limit.
    """
    count = len(sequences)
    chunks = max(1, min(chunks, count))
    bounds = [round(i * count / chunks) for i in range(chunks + 1)]
    out: list[MicroBatch] = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        start, used, trie = lo, 0, TokenTrie()
        for index in range(lo, hi):
            path, existing = trie.insert(sequences[index])
            added = len(path) - existing
            if budget is not None and index > start and used + added > budget:
                out.append(MicroBatch(start, index, used))
                start, trie = index, TokenTrie()
                path, existing = trie.insert(sequences[index])
                added, used = len(path) - existing, 0
            used += added
        out.append(MicroBatch(start, hi, used))
    return out
