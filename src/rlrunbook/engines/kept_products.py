"""The projections' outputs a sampling call computed, kept for the trainer's pass over the same tokens.

On-policy RL trains on the tokens it has just sampled, under the weights it sampled them with (until the next
``optim_step``). Under the default numerics a token's numbers depend only on its own tokens and the weights, so
the trainer's forward over those tokens computes, bit for bit, what the sampler's prefill and decode steps
computed. The bulk of that forward is the layers' projections: the products with the frozen base weights (2 x the
layers' weights in FLOPs per token, about 40% of a LoRA ``forward_backward``'s arithmetic) and the adapters'
updates added to them. A sampling call of the CPU engine can keep each projection group's outputs
(:class:`KeptProducts`, written by the fused kernels where they store them anyway); the trainer's pass then reads
them instead of computing them (:meth:`KeptProducts.read`, checked against the live adapter first), computing
only each adapter's first product, which its backward keeps (``Decoder.reads_known_outputs`` says where: a
projection whose adapter is added by another path than the one-kernel addition, such as a rank over
``SMALL_K``, computes its group again). Everything else of its forward (norms, rotation, attention, the output
layer's second product) and its whole backward is computed as before: the same values and gradients, bit for bit.
The output layer's logits the sampler computed to draw each token are kept too (by reference: the engine does not
change them), for the trainer's logprob of that token (:class:`KnownLogits`).

Memory: a token keeps each layer's output columns (q, k, v, o, gate, up and down: for SmolLM2-135M 30 x 5,184
values, 622 KB in float32) and, where a token was drawn after it, its float32 logits (197 KB). A call's share
grows linearly with the tokens it computes (prompt tokens once, then one token per row per decode step) and is
bounded by ``budget`` bytes: past it, the call keeps nothing more, and the trainer computes what was not kept.
The last training pass of a ``forward_backward`` frees the outputs as it reads them (:meth:`KeptProducts.read`
with ``release``): each group's tensors go as its layer gathers them, so the memory the pass keeps for its backward
takes the place of the outputs it read instead of adding to them. A later pass over the same tokens, before the
next sampling call, computes its products.
Time: the outputs are written a second time where the fused kernel stores them (no extra pass), and the
trainer's pass gathers its rows once per group, as the group's layer runs (:class:`KeptRows`); reading the outputs
rather than the base products, it allocates no ``[tokens, columns]`` tensor for the adapters' sums.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

import torch

from rlrunbook.kernels import cpu
from rlrunbook.prefix_tree import TokenTrie

GroupKey = tuple[int, ...]  # the ids of a projection group's modules (q/k/v, o, gate/up, down of one layer)


def group_key(modules: Sequence[torch.nn.Module]) -> GroupKey:
    """The key a projection group's products are kept under: the same modules in the sampler and the trainer."""
    return tuple(map(id, modules))


BLOCK_ROWS = 256  # rows of a block of kept products (a pass with more rows gets a block of its own size)


class _Block:
    """``capacity`` rows of every group's products, the first of them row ``first`` of the record."""

    def __init__(self, first: int, capacity: int):
        self.first = first
        self.capacity = capacity
        self.used = 0
        self.tensors: dict[GroupKey, torch.Tensor] = {}


class KeptProducts:
    """Base products of the passes of sampling calls under one adapter snapshot (``weights``, named ``key``).

    A pass (one prefill or one decode step; :meth:`begin`, :meth:`buffer`, :meth:`end`) keeps one row per token it
    computes in each projection group's tensor of a block (:data:`BLOCK_ROWS` rows, or the pass's own if more); the
    engine then says which token each row computed (:meth:`place`): a token is the prefix of tokens that ends with
    it, a node of :attr:`trie`. Every pass keeps the same groups (those of the first), or is not kept.

    ``spares``: the record these products replace (a call under another snapshot before any optimizer step), whose
    blocks are written again rather than allocated anew.
    """

    def __init__(self, weights: Mapping[str, torch.Tensor], key: Hashable | None, budget: int,
                 spares: KeptProducts | None = None):
        self.weights = weights  # the adapter factors the passes computed with, by parameter name
        self.key = key
        self.budget = budget
        self.full = False  # a pass would have passed the budget: nothing more is kept
        self.trie = TokenTrie()
        self._where: dict[int, int] = {}  # trie node -> its row
        self._blocks: list[_Block] = []
        self._spares = [] if spares is None else spares._release()
        self._groups: dict[GroupKey, tuple[int, torch.dtype]] = {}  # every pass's groups: columns, dtype
        self._open: set[GroupKey] | None = None  # the groups the open pass wrote (None: no pass kept)
        self._open_rows = 0
        self.last: int | None = None  # the first row of the pass :meth:`end` closed last (None: not kept)
        self._logits: list[torch.Tensor] = []  # output-layer logits [rows, V] of the passes, as the engine drew from
        self._logit_rows: dict[int, tuple[int, int]] = {}  # trie node -> (logits tensor, row) after it
        self.logit_bytes = 0
        self.released = False  # a pass read the products with ``release``: none is read again, none kept more

    @property
    def row_bytes(self) -> int:
        """Bytes one token keeps (every group's columns)."""
        return sum(columns * dtype.itemsize for columns, dtype in self._groups.values())

    @property
    def nbytes(self) -> int:
        """Bytes held: the blocks' rows (used or not) and the logits."""
        return sum(block.capacity for block in self._blocks) * self.row_bytes + self.logit_bytes

    def _release(self) -> list[_Block]:
        blocks, self._blocks = self._blocks, []
        self._where.clear()
        return [] if self.released else blocks  # a released record's blocks lack the groups a pass freed

    def begin(self) -> None:
        """A pass starts: its products go to :meth:`buffer` until :meth:`end` (a pass never ended is dropped)."""
        self._open, self._open_rows, self.last = (None if self.full else set()), 0, None

    def _block_for(self, rows: int) -> _Block | None:
        """The block the open pass writes: the last one if it has room, else a new one (a spare where one fits)."""
        last = self._blocks[-1] if self._blocks else None
        if last is not None and last.capacity - last.used >= rows:
            return last
        capacity = max(BLOCK_ROWS, rows)
        if self._groups and self.nbytes + capacity * self.row_bytes > self.budget:
            return None
        first = 0 if last is None else last.first + last.capacity
        spare = next((b for b in self._spares if b.capacity >= rows and self._fits(b)), None)
        if spare is not None:
            self._spares.remove(spare)
            spare.first, spare.used = first, 0
            self._blocks.append(spare)
            return spare
        self._blocks.append(_Block(first, capacity))
        return self._blocks[-1]

    def _fits(self, block: _Block) -> bool:
        return all(key in block.tensors and block.tensors[key].shape[1] == columns and block.tensors[key].dtype == dtype
                   for key, (columns, dtype) in self._groups.items())

    def buffer(self, key: GroupKey, rows: int, columns: int, dtype: torch.dtype) -> torch.Tensor | None:
        """Where the open pass keeps the outputs of group ``key`` (``None``: the pass is not kept)."""
        if self._open is None:
            return None
        first_group = not self._open
        if first_group:
            self._open_rows = rows
        known = self._groups.get(key)
        if rows != self._open_rows or key in self._open or (known is None and self.last_rows > 0) or (
                known is not None and known != (columns, dtype)):
            self._open = None  # not the same groups as every other pass: not kept
            return None
        block = self._block_for(rows) if first_group else self._blocks[-1]
        if block is None:
            self.full, self._open = True, None
            return None
        self._groups[key] = (columns, dtype)
        tensor = block.tensors.get(key)
        if tensor is None or tensor.shape[1] != columns or tensor.dtype != dtype:
            tensor = block.tensors[key] = torch.empty(block.capacity, columns, dtype=dtype)
        self._open.add(key)
        return tensor[block.used:block.used + rows]

    @property
    def last_rows(self) -> int:
        """Rows kept by the passes ended."""
        return sum(block.used for block in self._blocks)

    def end(self) -> int | None:
        """The pass ends; returns the record's row of its first token (``None``: it was not kept)."""
        self.last = None
        if self._open is not None and self._open == self._groups.keys():
            block = self._blocks[-1]
            if self.nbytes > self.budget:  # the first pass, whose size was not known ahead
                self.full = True
                if block.used == 0:
                    self._spares.append(self._blocks.pop())
            else:
                self.last = block.first + block.used
                block.used += self._open_rows
        self._open = None
        return self.last

    def keep_logits(self, logits: torch.Tensor) -> int | None:
        """Keep a pass's output-layer logits (``[rows, V]`` float32, the tensor itself, which nothing changes after);
        returns their index (``None``: past the budget, not kept)."""
        size = logits.numel() * logits.element_size()
        if self.full or self.nbytes + size > self.budget:
            self.full = True
            return None
        self._logits.append(logits)
        self.logit_bytes += size
        return len(self._logits) - 1

    def place(self, tokens: Sequence[int], rows: Mapping[int, int],
              logits: Mapping[int, tuple[int, int]] | None = None) -> None:
        """Token ``t`` of ``tokens`` (for each ``t`` in ``rows``) was computed as kept row ``rows[t]``; the logits after
        token ``t`` (for each ``t`` in ``logits``) are row ``logits[t][1]`` of kept logits ``logits[t][0]``."""
        path, _ = self.trie.insert(tokens)
        for t, row in rows.items():
            self._where[path[t]] = row
        for t, where in (logits or {}).items():
            self._logit_rows[path[t]] = where

    def matches(self, live: Mapping[str, torch.Tensor]) -> bool:
        """Whether ``live`` (the trainer's adapter factors by name) holds exactly the weights these passes used."""
        return (live.keys() == self.weights.keys()
                and all(torch.equal(live[name], tensor) for name, tensor in self.weights.items()))

    def _nodes(self, sequences: Sequence[Sequence[int]], flat: Sequence[Sequence[int]], rows: int) -> list[int]:
        """The trie node of each of a pass's ``rows`` flat tokens (``flat[i][t]`` the row of token ``t`` of
        ``sequences[i]``); ``-1`` where the token was never kept."""
        nodes = [-1] * rows
        for tokens, where in zip(sequences, flat, strict=True):
            for node, row in zip(self.trie.find(tokens), where):
                nodes[row] = node
        return nodes

    def read(self, sequences: Sequence[Sequence[int]], flat: Sequence[Sequence[int]], rows: int,
             release: bool = False) -> tuple[KeptRows | None, KnownLogits | None]:
        """What was kept of a pass over ``rows`` flat tokens, ``flat[i][t]`` the row of token ``t`` of
        ``sequences[i]`` (its tokens looked up once): the kept outputs, per group ``[rows, columns]`` in the pass's
        row order, gathered as each group is read (``None`` where a token of it was not kept, or a pass released
        them: the pass then computes its products), and the logits after each row that has them (``None`` where
        none has).

        ``release`` (the last pass that reads them): each group's tensors are freed, in every block, once the pass
        has gathered them; from then on the record gives no products (:attr:`released`) and keeps none (the engine
        starts a new one). The logits stay until the record is dropped: a pass's backward may read them again."""
        nodes = self._nodes(sequences, flat, rows)
        products = self._products_at(nodes, release)
        self.released = self.released or release
        return products, self._logits_at(nodes)

    def _products_at(self, nodes: list[int], release: bool) -> KeptRows | None:
        source = [self._where.get(node, -1) for node in nodes]
        if self.released or not self._blocks or min(source, default=-1) < 0:
            return None
        starts = [block.first for block in self._blocks]
        picks = []
        for row in source:
            index = bisect_right(starts, row) - 1
            picks.append((index, row - starts[index]))
        return KeptRows(list(self._blocks), _grouped(picks), tuple(self._groups), release)

    def _logits_at(self, nodes: list[int]) -> KnownLogits | None:
        source = [self._logit_rows.get(node) for node in nodes]
        return KnownLogits(self._logits, source) if any(s is not None for s in source) else None


class KeptRows(Mapping):
    """A pass's kept outputs by group: ``[rows, columns]`` in the pass's row order, gathered from the blocks
    when a group is read. The pass reads each group once, as its layer runs, so it holds one group's copy at a time
    (for SmolLM2-135M at most 3,072 columns a token) instead of every group's (30 x 5,184). Read before the blocks
    are written again (the next sampling call), as the trainer's pass does right after :meth:`KeptProducts.read`.

    ``release``: a group's tensors are taken out of every block as it is gathered (freed with the last reference),
    so a group is read at most once (a second read is a ``KeyError``)."""

    def __init__(self, blocks: Sequence[_Block], picks: _Picks, keys: Sequence[GroupKey], release: bool = False):
        self._blocks = blocks
        self._picks = picks
        self._keys = keys
        self._release = release

    def __getitem__(self, key: GroupKey) -> torch.Tensor:
        if key not in self._keys:
            raise KeyError(key)
        tensors = [block.tensors.get(key) for block in self._blocks]
        if self._release and any(tensor is None for tensor in tensors):
            raise KeyError(key)  # read and freed before
        taken = _taken(tensors, self._picks)
        if self._release:
            for block in self._blocks:
                del block.tensors[key]
        return taken

    def __contains__(self, key: object) -> bool:
        return key in self._keys  # without gathering (Mapping's own reads the group)

    def __iter__(self):
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


@dataclass(frozen=True)
class _Picks:
    """Rows to take, in order: row ``row_of[i]`` of tensor ``source_of[i]``, and the same picks grouped by tensor
    (``moves``: the tensor, the positions ``i`` and their rows)."""

    source_of: torch.Tensor
    row_of: torch.Tensor
    moves: list[tuple[int, torch.Tensor, torch.Tensor]]


def _grouped(picks: Sequence[tuple[int, int]]) -> _Picks:
    """``picks[i] = (tensor, row)`` as :class:`_Picks`."""
    groups: dict[int, tuple[list[int], list[int]]] = {}
    for at, (index, row) in enumerate(picks):
        targets, rows = groups.setdefault(index, ([], []))
        targets.append(at)
        rows.append(row)
    moves = [(index, torch.tensor(targets), torch.tensor(rows)) for index, (targets, rows) in groups.items()]
    return _Picks(torch.tensor([index for index, _ in picks], dtype=torch.long),
                  torch.tensor([row for _, row in picks], dtype=torch.long), moves)


def _taken(tensors: Sequence[torch.Tensor | None], picks: _Picks) -> torch.Tensor:
    """The rows ``picks`` names, ``[count, columns]`` in the order of the picks (a new tensor): one selection where
    every pick is from one tensor, else one pass gathering rows from each (:func:`rlrunbook.kernels.cpu.gather_rows`;
    off the CPU a selection per tensor)."""
    moves = picks.moves
    if len(moves) == 1:
        return tensors[moves[0][0]].index_select(0, moves[0][2])
    first = tensors[moves[0][0]]
    if first.device.type == "cpu" and first.stride(-1) == 1:
        return cpu.gather_rows(tensors, picks.source_of, picks.row_of)
    out = first.new_empty(picks.source_of.numel(), first.shape[1])
    for index, targets, rows in moves:
        out[targets] = tensors[index].index_select(0, rows)
    return out


class KnownLogits:
    """The kept output-layer logits after some of a pass's rows (``source[row]``: (logits tensor, its row), or
    ``None``)."""

    def __init__(self, logits: Sequence[torch.Tensor], source: Sequence[tuple[int, int] | None]):
        self._logits = logits
        self._source = source

    def select(self, rows: torch.Tensor) -> torch.Tensor | None:
        """The logits after hidden rows ``rows`` (``[M]``), ``[M, V]`` (a new tensor); ``None`` unless all are kept."""
        picks = [self._source[row] for row in rows.tolist()]
        if not picks or any(pick is None for pick in picks):
            return None
        return _taken(self._logits, _grouped(picks))
