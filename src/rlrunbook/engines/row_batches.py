"""Attention rows into batches, and the padding a grouping computes (pure: row shapes in, groups out).

A batch of rows (:class:`rlrunbook.prefix_tree.Row`) runs as one ``[R, T, H, D]`` call of the attention core,
every row padded to the batch's most queries ``T`` and most keys ``S``. The CUDA kernel computes all
``R x T x S`` score elements of a batch per head (a padded query or key weighs exactly 0, so it changes no bit,
but it costs time); the C kernel skips padded queries and reads a query's keys only up to its last allowed one.
Rows of different shapes in one batch cost padded work; one call per row costs launches.

:func:`group_rows` sorts rows by (keys, queries) and grows a batch while its padded score elements stay within
``tolerance`` of its real ones and it holds at most ``bound`` elements. Rows cut at the same position blocks
(:func:`rlrunbook.prefix_tree.plan_rows` with ``ROW_QUERIES``) have the same shape and batch without padding;
a path's first and last rows, shorter, join a batch only where they pad it little. Every batch pads at most
``tolerance`` of its real elements, so a whole pass does too, whatever the sequences' lengths, and its padded
query positions are at most ``tolerance`` of its real queries (a padded query costs ``S`` elements, a real one
at most ``S``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from rlrunbook.prefix_tree import Row

ROW_QUERIES = 128  # queries per attention row of a training pass or a prefill (a row is cut at multiples of it)
# Rows are batched while rows x queries x keys stays within the attention core's chunk budget over this many
# heads; the core splits a batch's queries into chunks itself.
HEADS_PER_BATCH = 8
PADDING_TOLERANCE = 0.01  # padded score elements a batch may compute, as a share of its real ones


class Padding(NamedTuple):
    """``real`` positions (or score elements) a pass needs and ``computed`` ones it runs, padding included."""

    real: int
    computed: int

    @property
    def fraction(self) -> float:
        """Padded over real (0 when nothing is real)."""
        return (self.computed - self.real) / self.real if self.real else 0.0

    def plus(self, other: Padding) -> Padding:
        return Padding(self.real + other.real, self.computed + other.computed)


def group_rows(rows: Sequence[Row], bound: int, tolerance: float = PADDING_TOLERANCE) -> list[list[Row]]:
    """``rows`` sorted by (keys, queries) and cut into batches of at most ``bound`` padded rows x queries x keys
    whose padded elements are at most ``tolerance`` of their real ones (a single row is a batch whatever its
    size). ``tolerance=math.inf``: cut by ``bound`` alone."""
    ordered = sorted(rows, key=lambda r: (len(r.keys), len(r.queries)))
    groups: list[list[Row]] = []
    current: list[Row] = []
    real = queries = keys = 0
    for row in ordered:
        q, k = len(row.queries), len(row.keys)
        grown_queries, grown_keys, grown_real = max(queries, q), max(keys, k), real + q * k
        size = (len(current) + 1) * grown_queries * grown_keys
        if current and (size > bound or size - grown_real > tolerance * grown_real):
            groups.append(current)
            current, real, queries, keys = [row], q * k, q, k
        else:
            current.append(row)
            real, queries, keys = grown_real, grown_queries, grown_keys
    if current:
        groups.append(current)
    return groups


def batch_padding(groups: Sequence[Sequence[Row]]) -> tuple[Padding, Padding]:
    """(query positions, score elements per head) that batches ``groups`` need and compute, each batch padded to
    its most queries and keys."""
    queries, scores = Padding(0, 0), Padding(0, 0)
    for group in groups:
        width_q = max(len(r.queries) for r in group)
        width_k = max(len(r.keys) for r in group)
        queries = queries.plus(Padding(sum(len(r.queries) for r in group), len(group) * width_q))
        scores = scores.plus(Padding(sum(len(r.queries) * len(r.keys) for r in group),
                                     len(group) * width_q * width_k))
    return queries, scores
