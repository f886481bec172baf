"""Shared prefixes of token sequences, found from the tokens alone (pure functions, no tensors).

A group's samples share their prompt; a debater's round-2 prompt extends its round-1 prompt and
answer; the two debaters of one question share the question. A forward pass needs a token's
hidden state and keys/values only once per distinct prefix, because a causal model's output at
position ``t`` depends on tokens ``0..t`` only. :class:`TokenTrie` numbers each distinct prefix
(a trie node: the token it ends with, at depth = its position); :func:`plan_rows` turns the paths
of the sequences to compute into attention rows in which every new node is computed exactly once.

Node 0 is the root (no token). A node's number minus one is its slot in a key/value store.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


class TokenTrie:
    """Distinct prefixes of the sequences inserted so far; node ``n >= 1`` is slot ``n - 1``."""

    def __init__(self) -> None:
        self._children: list[dict[int, int]] = [{}]
        self.tokens: list[int] = [-1]
        self.positions: list[int] = [-1]
        self.parents: list[int] = [-1]

    def __len__(self) -> int:
        """Number of nodes besides the root (= slots in use)."""
        return len(self.tokens) - 1

    def insert(self, tokens: Sequence[int]) -> tuple[list[int], int]:
        """Add ``tokens`` as a path; return its nodes (one per token) and how many already existed."""
        node, path, existing = 0, [], 0
        for token in tokens:
            child = self._children[node].get(token)
            if child is None:
                child = len(self.tokens)
                self._children[node][token] = child
                self._children.append({})
                self.tokens.append(int(token))
                self.positions.append(self.positions[node] + 1)
                self.parents.append(node)
            elif len(path) == existing:
                existing += 1
            path.append(child)
            node = child
        return path, existing

    def find(self, tokens: Sequence[int]) -> list[int]:
        """The nodes of the longest prefix of ``tokens`` already in the trie (one per token), inserting nothing."""
        node, path = 0, []
        for token in tokens:
            node = self._children[node].get(token)
            if node is None:
                break
            path.append(node)
        return path

    def path(self, node: int) -> list[int]:
        """The nodes from the first token down to ``node`` (inclusive)."""
        out = []
        while node > 0:
            out.append(node)
            node = self.parents[node]
        return out[::-1]


@dataclass(frozen=True)
class Row:
    """One attention row: ``queries`` (nodes computed here, consecutive on one path) read ``keys``
    (that path from its first token through the last query)."""

    queries: list[int]
    keys: list[int]


def plan_rows(paths: Sequence[Sequence[int]], first_to_compute: Sequence[int], max_queries: int = 0) -> list[Row]:
    """Rows computing each path's nodes from ``first_to_compute[i]`` on, every node once.

    ``paths[i]`` is the node path of sequence ``i`` (from :meth:`TokenTrie.insert`). A node already
    computed by an earlier row (a prefix two sequences share) is not computed again: a later path
    only computes what is left of it. ``max_queries > 0`` splits a row into rows of at most that
    many queries (each reading its path up to its own last query), cut where a position is a multiple
    of ``max_queries``: the full rows of every path then cover the same position blocks, so rows of
    different sequences at one block have the same shape and batch without padding
    (:mod:`rlrunbook.engines.row_batches`).
    """
    claimed: set[int] = set()
    rows: list[Row] = []
    for path, first in zip(paths, first_to_compute, strict=True):
        todo = [i for i in range(first, len(path)) if path[i] not in claimed]
        if not todo:
            continue
        start = todo[0]
        if todo != list(range(start, len(path))):
            raise ValueError("the nodes left to compute on a path must be one contiguous suffix")
        claimed.update(path[start:])
        lo = start
        while lo < len(path):
            hi = min(lo // max_queries * max_queries + max_queries, len(path)) if max_queries > 0 else len(path)
            rows.append(Row(queries=list(path[lo:hi]), keys=list(path[:hi])))
            lo = hi
    return rows


@dataclass(frozen=True)
class ForwardPlan:
    """What one forward pass computes: ``nodes`` in flat order, the ``rows`` that compute them, and
    the node path of every input sequence (``paths[i][t]`` is the node of token ``t`` of sequence ``i``)."""

    nodes: list[int]
    rows: list[Row]
    paths: list[list[int]]

    def flat_of(self) -> dict[int, int]:
        """Node → its index among the tokens of this pass (insertion order = flat order)."""
        return {node: i for i, node in enumerate(self.nodes)}


def plan_forward(trie: TokenTrie, sequences: Sequence[Sequence[int]], *, last_token_computed: bool = False,
                 max_queries: int = 0) -> ForwardPlan:
    """Insert ``sequences`` into ``trie`` and plan the pass that computes every node not yet in it.

    Nodes that already existed before a sequence was inserted are not computed again (their keys
    and values are in the store that goes with ``trie``), except, with ``last_token_computed``, each
    sequence's last token, whose output is needed even when its prefix was seen before (a prompt's
    next-token distribution). A fresh ``trie`` computes every distinct prefix once.
    """
    paths, firsts = [], []
    for tokens in sequences:
        if len(tokens) == 0:
            raise ValueError("an empty token sequence has nothing to compute")
        path, existing = trie.insert(tokens)
        paths.append(path)
        firsts.append(min(existing, len(tokens) - 1) if last_token_computed else existing)
    rows = plan_rows(paths, firsts, max_queries)
    return ForwardPlan([node for row in rows for node in row.queries], rows, paths)
