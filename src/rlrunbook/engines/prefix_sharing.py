"""Which rows of a decode cache hold copies of one prefix, and how a decode step reads each such prefix once.

Samples of one prompt, and a debate's turns over one article, decode side by side with the same prompt keys and
values in many rows: :class:`~rlrunbook.engines.layouts.RowCache` copies them from the engine's prefix pool, so
rows whose prompts share their first ``n`` tokens hold bit-identical keys and values at indices below ``n``.
A decode step's attention reads every row's keys and values, each row its own copy of the shared prompt.

Here the rows are put in the lexicographic order of their prompts, and each row's *reload* length is its common
prefix with the row before it in that order (0 under :data:`MIN_SHARED`). The fused decode attention
(:func:`rlrunbook.kernels.fused.cached_attention`) takes the rows in that order, cut into parts for the threads:
a part's first row is loaded whole, and each later row only from its reload length on, over what the rows
before it left in the buffer. That is correct because in lexicographic order a row's common prefix with any
earlier row of its part is the least of the neighbours' common prefixes between them: every buffer entry below
a row's reload length holds the bits that row holds there. A prefix shared by a part's rows is read once per
part and key/value head, not once per row. Every score, weight and sum is the one the unshared kernel computes
(the keys and values read are the same bits), so tokens and logprobs are unchanged: sampler = trainer holds.

Memory: the plan is three int64 vectors of at most ``rows + 1`` entries; planning sorts the rows' prompts
(``O(rows log rows x prompt length)``) once per cache fill or shrink, never per step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

import torch

MIN_SHARED = 16  # a shorter common prefix is loaded again: not worth tying a row to its neighbour


@dataclass(frozen=True)
class Sharing:
    """The cache rows in the order a decode step takes them (``order``), and per row (``reload[r]``) how many
    leading entries row ``r`` holds as copies of the row before it in that order (0: none)."""

    order: tuple[int, ...]
    reload: tuple[int, ...]

    @staticmethod
    def none(rows: int) -> Sharing:
        return Sharing(tuple(range(rows)), (0,) * rows)

    @property
    def any(self) -> bool:
        return any(self.reload)


def common_prefixes(sequences: Sequence[Sequence[int]], rows: int, min_shared: int = MIN_SHARED) -> Sharing:
    """The sharing of cache rows ``0..len(sequences)-1``, row ``i`` holding copies of ``sequences[i]``'s entries
    (slot ids of the prefix pool: equal ids are the same stored keys and values); rows past them share nothing
    and come last."""
    order = sorted(range(len(sequences)), key=lambda i: (tuple(sequences[i]), i))
    reload = [0] * rows
    for previous, row in pairwise(order):
        common = _common(sequences[previous], sequences[row])
        reload[row] = common if common >= min_shared else 0
    return Sharing(tuple(order) + tuple(range(len(sequences), rows)), tuple(reload))


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def kept_rows(sharing: Sharing, kept: Sequence[int], rows: int) -> Sharing:
    """The sharing after the cache's rows ``kept`` become rows ``0..len(kept)-1`` of a cache of ``rows`` rows, in
    the same order: a kept row shares with the kept row before it the least of the reload lengths from there to it
    (the common prefix of two rows in lexicographic order is the least of their neighbours' between them)."""
    new_index = {old: new for new, old in enumerate(kept)}
    order, reload = [], [0] * rows
    least = math.inf
    for old in sharing.order:
        least = min(least, sharing.reload[old])
        if old in new_index:
            reload[new_index[old]] = int(least) if order else 0
            order.append(new_index[old])
            least = math.inf
    order += range(len(kept), rows)
    return Sharing(tuple(order), tuple(reload))


@dataclass(frozen=True)
class DecodeParts:
    """The fused decode attention's plan (``attention_fwd_parts`` in ``kernels/c/attention.c``): the rows in
    ``order``, part ``c`` being ``order[starts[c]:starts[c + 1]]``; row ``r`` after its part's first loads its
    keys and values from index ``reload[r]`` on."""

    order: torch.Tensor
    starts: torch.Tensor
    reload: torch.Tensor

    @property
    def parts(self) -> int:
        return self.starts.numel() - 1


def decode_parts(sharing: Sharing, kv_heads: int, threads: int) -> DecodeParts:
    """``sharing``'s order cut into parts of about equal rows, enough for two work items (part x key/value head)
    per thread; each cut moved, within a quarter of a part, to where the least is shared (a part's first row is
    loaded whole)."""
    rows = len(sharing.order)
    count = min(rows, max(1, math.ceil(2 * max(1, threads) / max(1, kv_heads))))
    starts = [0]
    for part in range(1, count):
        ideal, slack = round(part * rows / count), rows // (4 * count)
        lowest, highest = starts[-1] + 1, rows - (count - part)  # every part keeps at least one row
        window = range(max(lowest, ideal - slack), min(highest, ideal + slack) + 1)
        starts.append(min(window, key=lambda at: (sharing.reload[sharing.order[at]], abs(at - ideal)),
                          default=min(max(lowest, ideal), highest)))
    starts.append(rows)
    return DecodeParts(torch.tensor(sharing.order, dtype=torch.int64), torch.tensor(starts, dtype=torch.int64),
                       torch.tensor(sharing.reload, dtype=torch.int64))
