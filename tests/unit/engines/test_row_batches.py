"""Attention rows into batches: every row once, the element bound kept, and each batch's padding within the
tolerance (rlrunbook.engines.row_batches). Without the tolerance check, rows of different shapes share batches
and the padding property fails."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from rlrunbook.engines.row_batches import Padding, batch_padding, group_rows
from rlrunbook.prefix_tree import Row, TokenTrie, plan_forward


def shaped(queries: int, keys: int) -> Row:
    """A row of ``queries`` queries reading ``keys`` keys (node numbers stand for nothing here)."""
    return Row(queries=list(range(keys - queries, keys)), keys=list(range(keys)))


def test_padding_is_counted_per_batch_from_its_widest_row():
    # one batch of a 3 x 10 row and a 2 x 6 row, padded to 2 rows x 3 queries x 10 keys
    queries, scores = batch_padding([[shaped(3, 10), shaped(2, 6)], [shaped(1, 4)]])
    assert queries == Padding(real=3 + 2 + 1, computed=2 * 3 + 1)  # one padded query position
    assert scores == Padding(real=30 + 12 + 4, computed=2 * 3 * 10 + 4)  # 60 - 42 = 18 padded elements
    assert scores.fraction == (64 - 46) / 46
    assert Padding(0, 0).fraction == 0.0


def test_rows_of_one_shape_share_a_batch_up_to_the_bound_and_others_do_not_pad_it():
    rows = [shaped(128, 1024)] * 5 + [shaped(40, 1000)]
    groups = group_rows(rows, bound=3 * 128 * 1024)
    assert [len(g) for g in groups] == [1, 3, 2]  # the short row alone: with a full row it would pad 53% of the real elements
    assert batch_padding(groups)[1].fraction == 0.0
    assert [len(g) for g in group_rows(rows, bound=3 * 128 * 1024, tolerance=math.inf)] == [3, 3]


rows_strategy = st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=40), min_size=1, max_size=12)


@settings(max_examples=200, deadline=None)
@given(sequences=rows_strategy, block=st.integers(1, 8), bound=st.integers(1, 4000),
       tolerance=st.sampled_from([0.0, 0.01, 0.25]))
def test_every_row_is_batched_once_within_the_bound_and_the_tolerance(sequences, block, bound, tolerance):
    rows = plan_forward(TokenTrie(), sequences, max_queries=block).rows
    groups = group_rows(rows, bound, tolerance)
    assert sorted(id(r) for g in groups for r in g) == sorted(id(r) for r in rows)
    for group in groups:
        _, scores = batch_padding([group])
        assert len(group) == 1 or scores.computed <= bound
        assert scores.computed - scores.real <= tolerance * scores.real
    queries, scores = batch_padding(groups)
    assert queries.fraction <= tolerance and scores.fraction <= tolerance
