"""Key/value layouts for :class:`rlrunbook.engines.decoder.Decoder`: which keys each token reads.

- :class:`TreeLayout`: tokens of many sequences whose shared prefixes are computed once
  (:mod:`rlrunbook.prefix_tree`); each attention row reads its path's keys, either from the
  tokens of this pass (training) or from a :class:`SlotStore` that keeps them for later calls
  (prefill of the sampling engine, which reuses a debate's earlier rounds).
- :class:`RowCache`: one decode step, one new token per row, each row reading its own cache.

Both end in :func:`rlrunbook.engines.attention.attend`, so a token's attention output is the same
whichever layout computed it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.utils.checkpoint import checkpoint

from rlrunbook.engines.attention import attend, attend_gathered, recompute_pays, score_elements
from rlrunbook.engines.prefix_sharing import DecodeParts, Sharing, decode_parts, kept_rows
from rlrunbook.engines.row_batches import HEADS_PER_BATCH, group_rows
from rlrunbook.kernels import fused
from rlrunbook.kernels.ops import PassRows, pass_attention
from rlrunbook.prefix_tree import Row


def take_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x[index]`` for an integer ``index`` of any shape, with a deterministic backward.

    Indexing with a tensor accumulates the gradient of repeated indices (a shared prefix read by many
    rows) in an order that depends on thread scheduling on CPU, so two identical runs could differ
    in the last bit; ``index_select`` adds them in a fixed order.
    """
    return x.index_select(0, index.reshape(-1)).view(*index.shape, *x.shape[1:])


class SlotStore:
    """Keys and values of every layer, one slot per trie node, kept across calls (no gradient)."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device):
        self.shape = (kv_heads, head_dim)
        self.dtype, self.device = dtype, device
        self.keys = [torch.empty(0, kv_heads, head_dim, dtype=dtype, device=device) for _ in range(layers)]
        self.values = [torch.empty(0, kv_heads, head_dim, dtype=dtype, device=device) for _ in range(layers)]

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[0]

    def reserve(self, slots: int) -> None:
        """Make room for ``slots`` slots (grows by doubling; existing slots keep their values)."""
        if slots <= self.capacity:
            return
        size = max(slots, 2 * self.capacity, 256)
        for store in (self.keys, self.values):
            for layer, old in enumerate(store):
                grown = torch.empty(size, *self.shape, dtype=self.dtype, device=self.device)
                grown[: old.shape[0]] = old
                store[layer] = grown

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.keys[layer][slots] = k.detach()
        self.values[layer][slots] = v.detach()


class TreeLayout:
    """Attention rows over a pass's flat tokens (see :func:`rlrunbook.prefix_tree.plan_rows`).

    ``flat_of[node]`` is the flat index of each node computed in this pass. Keys are looked up in
    this pass's own keys (``store=None``: every key node is computed here, and gradients flow), or
    in ``store`` by slot (``node - 1``), after this pass's keys are written there.
    """

    def __init__(self, rows: Sequence[Row], flat_of: dict[int, int], positions_of: Sequence[int],
                 device: torch.device, store: SlotStore | None = None):
        self.store = store
        self.size = len(flat_of)
        slots = [0] * self.size
        for node, flat in flat_of.items():
            slots[flat] = node - 1
        self.new_slots = torch.tensor(slots, dtype=torch.long, device=device)

        def key_ref(node: int) -> int:
            return node - 1 if store is not None else flat_of[node]

        bound = score_elements(torch.device(device)) // HEADS_PER_BATCH
        self.batches = [self._batch(group, flat_of, key_ref, positions_of, device)
                        for group in group_rows(rows, bound)]  # padding-capped (engines/row_batches.py)
        self.longest_row = max((len(row.keys) for row in rows), default=0)
        # Batches give their queries' outputs in batch order; ``order`` puts them back in flat order
        # (every flat token is a query of exactly one row).
        computed = torch.cat([batch.query_flat for batch in self.batches]) if self.batches else self.new_slots
        self.order = torch.empty_like(computed)
        self.order[computed] = torch.arange(computed.numel(), device=computed.device)

    @staticmethod
    def _batch(rows: list[Row], flat_of, key_ref, positions_of, device) -> PassRows:
        width_q = max(len(r.queries) for r in rows)
        width_k = max(len(r.keys) for r in rows)
        query_index = torch.full((len(rows), width_q), -1, dtype=torch.long)
        key_index = torch.full((len(rows), width_k), -1, dtype=torch.long)
        query_pos = torch.full((len(rows), width_q), -1, dtype=torch.long)
        key_pos = torch.zeros((len(rows), width_k), dtype=torch.long)
        for i, row in enumerate(rows):
            query_index[i, : len(row.queries)] = torch.tensor([flat_of[n] for n in row.queries])
            query_pos[i, : len(row.queries)] = torch.tensor([positions_of[n] for n in row.queries])
            key_index[i, : len(row.keys)] = torch.tensor([key_ref(n) for n in row.keys])
            key_pos[i, : len(row.keys)] = torch.tensor([positions_of[n] for n in row.keys])
        query_valid = query_index >= 0
        key_unique, key_local = torch.unique(key_index.clamp(min=0), return_inverse=True)
        return PassRows(query_index.clamp(min=0).to(device), key_index.clamp(min=0).to(device), query_pos.to(device),
                      key_pos.to(device), (key_index >= 0).to(device), query_index[query_valid].to(device),
                      query_valid.flatten().nonzero().flatten().to(device), key_unique.to(device),
                      key_local.to(device))

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               core: str) -> torch.Tensor:
        if self.store is not None:
            self.store.write(layer, self.new_slots, k, v)
            keys, values = self.store.keys[layer], self.store.values[layer]
        else:
            keys, values = k, v
        if core == "fixed":  # every batch in one autograd node (the chain below's values and gradients)
            return pass_attention(q, keys, values, self.batches, scale)
        # Recomputing a batch in backward (gathers included) keeps only the flat q, k, v for it: O(tokens).
        recompute = recompute_pays(self.longest_row, core, q, keys, values)
        parts = [checkpoint(_attend_batch, batch, q, keys, values, scale, core, use_reentrant=False) if recompute
                 else _attend_batch(batch, q, keys, values, scale, core) for batch in self.batches]
        return take_rows(torch.cat(parts), self.order)  # each flat token's output, in flat order


def _attend_batch(batch: PassRows, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
                  core: str) -> torch.Tensor:
    """The outputs ``[n, H*D]`` of one batch's real queries, row-major."""
    out = attend_gathered(take_rows(q, batch.query_index), keys, values, batch.key_index, batch.query_positions,
                          batch.key_positions, batch.key_valid, scale, core, recompute=False)
    return take_rows(out.flatten(0, 1), batch.query_rows)


class RowCache:
    """A static per-row KV cache for decoding: ``[rows, capacity]`` slots per layer.

    Row ``r`` holds its tokens at cache index = position (left-aligned, no padding inside a row).
    Each :meth:`attend` call is one decode step: the new token of row ``r`` sits at position
    ``lengths[r]`` and reads cache indices ``0..lengths[r]`` of its own row. ``window`` (a Python int,
    fixed per captured graph) bounds how many cache columns a step reads.
    """

    def __init__(self, layers: int, rows: int, capacity: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, within: RowCache | None = None):
        if within is not None:  # the first ``rows`` rows of a larger cache: no memory of its own
            if rows > within.rows or capacity != within.capacity:
                raise ValueError(f"a {rows}-row cache of capacity {capacity} does not fit in {within.rows} rows of "
                                 f"capacity {within.capacity}")
            self.keys = [keys[:rows] for keys in within.keys]
            self.values = [values[:rows] for values in within.values]
        else:
            shape = (rows, capacity, kv_heads, head_dim)
            self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
            self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.lengths = torch.zeros(rows, dtype=torch.long, device=device)
        self.row_index = torch.arange(rows, device=device)
        self.window = capacity
        self._columns = torch.arange(capacity, device=device)[None]  # [1, capacity]: a key's position
        self._all_valid = torch.ones(1, capacity, dtype=torch.bool, device=device)
        self._positions = torch.arange(capacity, device=device)  # the fused kernel's key positions and validity
        self._valid_bytes = torch.ones(capacity, dtype=torch.uint8, device=device)
        self.sharing = Sharing.none(rows)
        self._parts: DecodeParts | None = None

    @property
    def rows(self) -> int:
        return self.keys[0].shape[0]

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[1]

    @property
    def position_bound(self) -> int:
        """Every position a step over this cache computes is below this (a row's tokens sit at index = position)."""
        return self.capacity

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               core: str) -> torch.Tensor:
        keys, values = self.keys[layer], self.values[layer]
        keys[self.row_index, self.lengths] = k
        values[self.row_index, self.lengths] = v
        window = self.window
        out = attend(q[:, None], keys[:, :window], values[:, :window], self.lengths[:, None],
                     self._columns[:, :window], self._all_valid[:, :window], scale, core)
        return out[:, 0]

    def attend_packed(self, layer: int, qkv: torch.Tensor, heads: int, kv_heads: int, head_dim: int,
                      scale: float) -> torch.Tensor:
        """:meth:`attend` in one fused call (no gradient, CPU): ``qkv`` ``[rows, (H + 2 Hkv) D]`` holds each row's
        queries, key and value side by side; the same bits as :meth:`attend` with the ``fixed`` core."""
        return fused.cached_attention(qkv, self.keys[layer], self.values[layer], self.lengths, self._positions,
                                      self._valid_bytes, self.window, heads, kv_heads, head_dim, scale,
                                      self._parts_plan())

    def decode_layers(self, h: torch.Tensor, x: torch.Tensor, layers: fused.DecodeLayers, cos: torch.Tensor,
                      sin: torch.Tensor, bounds: Sequence[int] | None,
                      kept: Sequence[torch.Tensor | None] | None) -> torch.Tensor:
        """A decode step's every layer over this cache in one fused call (:func:`rlrunbook.kernels.fused.decode_layers`,
        no gradient, CPU): the bits of :meth:`attend_packed` and the other fused calls layer by layer."""
        return fused.decode_layers(h, x, layers, self.keys, self.values, self.lengths, self._positions,
                                   self._valid_bytes, self.window, cos, sin, self._parts_plan(), bounds, kept)

    def _parts_plan(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The shared-prefix plan as the fused kernels take it (``order``, ``starts``, ``reload``), or ``None``."""
        parts = self._parts
        return None if parts is None else (parts.order, parts.starts, parts.reload)

    def share_prefixes(self, sharing: Sharing) -> None:
        """Declare which rows hold copies of another row's leading entries (:mod:`rlrunbook.engines.prefix_sharing`):
        the fused decode step then reads each shared prefix once per part. The caller guarantees the copies (rows
        filled from the same slots of the prefix pool); the chain's :meth:`attend` reads every row as before."""
        if len(sharing.order) != self.rows:
            raise ValueError(f"sharing of {len(sharing.order)} rows for a cache of {self.rows}")
        self.sharing = sharing
        kv_heads = self.keys[0].shape[2]
        self._parts = decode_parts(sharing, kv_heads, torch.get_num_threads()) if sharing.any else None

    def reset(self) -> None:
        """Forget every row (the buffers are reused; stale entries are never read past ``lengths``)."""
        self.lengths.zero_()
        self.window = self.capacity
        self.share_prefixes(Sharing.none(self.rows))

    def copy_rows_to(self, other: RowCache, rows: torch.Tensor) -> None:
        """Put rows ``rows`` of this cache into the first ``len(rows)`` rows of ``other`` (same capacity; it may
        share this cache's memory: the rows are gathered before they are written)."""
        count = rows.numel()
        for mine, theirs in ((self.keys, other.keys), (self.values, other.values)):
            for layer, tensor in enumerate(mine):
                theirs[layer][:count] = tensor[rows]
        other.lengths.zero_()
        other.lengths[:count] = self.lengths[rows]
        other.window = self.window
        other.share_prefixes(kept_rows(self.sharing, rows.tolist(), other.rows))
