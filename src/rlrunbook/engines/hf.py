"""The in-process sampling engine: the transformers model's own weights, decoded by this project.

What it does that ``generate`` does not, and why:

- **The trainer's numerics.** Prefill and every decode step run :class:`~rlrunbook.engines.decoder.Decoder`,
  the same forward the trainer runs, so the logprob reported for a token is the one the trainer
  computes for it (bitwise on CPU in bf16 with the default ``invariant`` numerics; see the decoder).
- **No wasted work.** Identical prompts are prefilled once for all their samples, and prompts that
  share a prefix (a group's debaters, a debate's next round, which extends its earlier prompt and
  answer) compute the shared part once: keys and values of every prefix seen under the current
  weights stay in a pool (:class:`~rlrunbook.prefix_tree.TokenTrie` + :class:`~rlrunbook.engines.layouts.SlotStore`),
  dropped when the weights change. The output layer runs only for rows still sampling; finished
  rows leave the batch when the running ones fit a batch of half the size. A decode step on the CPU reads a
  prompt prefix that several rows hold once per group of rows, not once per row
  (:mod:`~rlrunbook.engines.prefix_sharing`: the same bits).
- **Static shapes.** The decode step reads a per-row KV cache of fixed capacity through a window
  rounded up to 64 columns, with the batch padded to a power of two: on CUDA each (rows, window)
  shape is captured once as a CUDA graph and replayed (:mod:`rlrunbook.engines.graphs`). The capacity
  only grows, in powers of two from 256 up to the model's context (:func:`capacity_bucket`): a call
  that fits the caches reuses them and their graphs, so a debate's growing rounds and a data set's
  varied prompt lengths rebuild them a few times per run, not at every new length. ``metrics()``
  counts the captures and the rebuilds (``engine/graph_captures``, ``engine/cache_rebuilds``).
- **Exact draws.** Each token is drawn as :func:`~rlrunbook.engines.token_draw.draw_tokens` defines it
  (``logits / T`` after the requested filters, Gumbel-max with per-row counter-based noise), so a seeded
  row gets the same tokens whatever rows share its batch; under the fixed-order numerics by one kernel
  per step (:func:`~rlrunbook.kernels.ops.seeded_draw`, the same bits). The leak check of the ``generate``
  engine holds by construction here (no processor runs but the requested filters) and is asserted on
  the first step of every block.
- **Few host syncs.** Tokens stay on the device for ``sync_every`` (8) steps: each step's draw writes the
  next step's input, and the block's tokens and logprobs are read back once, where stops are found. A row
  that stopped inside a block runs on to its end and what it drew after its stop is dropped, so the
  results are those of a step-by-step loop (a row's numbers do not depend on its batch).
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from rlrunbook.engines.base import Completion, GenerationRequest, SampleJob, shared_request, split_by_job
from rlrunbook.engines.decoder import Decoder, Numerics
from rlrunbook.engines.filters import apply_filters
from rlrunbook.engines.in_process import InProcessEngine
from rlrunbook.engines.kept_products import KeptProducts
from rlrunbook.engines.layouts import RowCache, SlotStore, TreeLayout
from rlrunbook.engines.pinned_adapter import PinnedAdapter, RowAdapters
from rlrunbook.engines.prefix_sharing import common_prefixes
from rlrunbook.engines.stops import DecodeBatch, StopTracker
from rlrunbook.engines.token_draw import StepDraws
from rlrunbook.errors import GenerationLeakError
from rlrunbook.prefix_tree import TokenTrie, plan_forward

_PREFILL_QUERY_BLOCK = 128  # queries per prefill attention row (rows cut at its multiples batch by shape)
_WINDOW_STEP = 64  # the decode step reads cache columns in multiples of this
SYNC_EVERY = 8  # decode steps between reads of the drawn tokens (stops are found there)
PREFILL_TOKENS = 16384  # most prompt tokens one prefill pass computes (its activations grow with them)
CAPACITY_FLOOR = 256  # the smallest decode cache capacity (positions); larger ones are 2^k or 1.5 x 2^k
MAX_ADAPTERS = 8  # most samplers' adapters one call decodes together (each keeps a pinned copy and a prefix pool)
_POOL_SPACING = 1 << 40  # pool slot ids of adapter s are offset by s times this: no two adapters' rows share


# A decode step a sampling call kept (engines/kept_products.py): its first kept row and its kept logits (None: not
# kept), the step (from 1), and per row it fed: (cache row, row of its logits, the call's row).
_KeptStep = tuple[int | None, int | None, int, list[tuple[int, int, int]]]


def _bucket(rows: int) -> int:
    """Batch rows padded to a power of two, at least 2 (a 1-row matrix product may round differently)."""
    return max(2, 1 << (rows - 1).bit_length())


def prefill_parts(prompts: list[tuple[int, ...]], budget: int | None = None) -> list[list[tuple[int, ...]]]:
    """Consecutive groups of ``prompts`` of at most ``budget`` tokens (``PREFILL_TOKENS``) each, a longer prompt
    alone: prefilled one group at a time, so a call of many long prompts holds one group's activations (a later
    group reads the earlier ones' shared prefixes from the pool)."""
    budget = PREFILL_TOKENS if budget is None else budget
    parts: list[list[tuple[int, ...]]] = [[]]
    used = 0
    for prompt in prompts:
        if parts[-1] and used + len(prompt) > budget:
            parts.append([])
            used = 0
        parts[-1].append(prompt)
        used += len(prompt)
    return parts


def capacity_bucket(needed: int, max_context: int | None) -> int:
    """The decode cache capacity for ``needed`` positions: the smallest of 256, 384, 512, 768, 1024, 1536, ...
    (powers of two and 1.5 times them: few sizes, so captured graphs are reused, and at most a third of a cache
    unused) that holds them, at most ``max_context`` (the model's context, when known)."""
    power = 1 << max(0, (needed - 1).bit_length() - 1)  # the largest power of two below ``needed``
    capacity = max(CAPACITY_FLOOR, power if power >= needed else power * 3 // 2 if power * 3 // 2 >= needed
                   else 2 * power)
    return max(needed, min(capacity, max_context)) if max_context else capacity


class _PrefixPool:
    """Keys and values of every prefix computed under one set of weights, for reuse by later calls."""

    def __init__(self, decoder: Decoder, device: torch.device):
        self.key: Hashable | None = None
        self.trie = TokenTrie()
        layers = len(decoder.lm.model.layers)
        self.store = SlotStore(layers, decoder.num_kv_heads, decoder.head_dim, decoder.dtype, device)

    def reset(self, key: Hashable | None) -> None:
        self.key, self.trie = key, TokenTrie()

    def absorb(self, cache: RowCache, rows: list[int], sequences: list[list[int]], limit: int) -> None:
        """Keep the cached keys/values of ``sequences`` (cache row ``rows[i]`` holds sequence ``i``)."""
        if len(self.trie) + sum(len(tokens) for tokens in sequences) > limit:
            return  # full: keep what is there (a trie node must never lack its keys and values)
        picks: list[tuple[int, int, int]] = []  # (cache row, position, slot)
        for row, tokens in zip(rows, sequences, strict=True):
            path, existing = self.trie.insert(tokens)
            picks += [(row, t, path[t] - 1) for t in range(existing, len(tokens))]
        if not picks:
            return
        self.store.reserve(len(self.trie))
        device = cache.lengths.device
        row_index, position, slot = (torch.tensor(column, device=device) for column in zip(*picks, strict=True))
        for layer in range(len(cache.keys)):
            self.store.keys[layer][slot] = cache.keys[layer][row_index, position]
            self.store.values[layer][slot] = cache.values[layer][row_index, position]


@dataclass(frozen=True)
class AdapterJobs:
    """One sampler's share of a call that decodes several samplers' rows together (:meth:`HFSamplingEngine.
    sample_adapters`): its snapshot's LoRA tensors by parameter name (``None``: the base model), the key naming
    that snapshot (as :meth:`HFSamplingEngine.pinned_weights` takes them) and its jobs."""

    adapter: Mapping[str, torch.Tensor] | None
    key: Hashable
    jobs: Sequence[SampleJob]


@dataclass(frozen=True)
class _Source:
    """Where one adapter slot's rows of a call get their LoRA factors and cached prefixes."""

    pinned: PinnedAdapter | None  # None: the decoder's current state (the live model, or what the caller pinned)
    key: Hashable | None  # the weights' key for the prefix pool (None: no reuse)


class HFSamplingEngine(InProcessEngine):
    """Batched sampling from a (possibly LoRA-wrapped) transformers causal LM of a supported family.

    ``model`` is read at call time, so a caller that changes adapter weights between calls samples
    from the new weights; ``weights_key`` (see :meth:`sample_jobs`) says when cached prefixes are
    still valid. Unseeded requests get seeds from the engine's own counter (``seed``).

    ``sync_every``: decode steps drawn on the device between reads of their tokens (see :meth:`_sample_rows`);
    ``fused_draw``: draw each step in one kernel (:func:`~rlrunbook.kernels.ops.seeded_draw`), else by the eager
    reference :func:`~rlrunbook.engines.token_draw.draw_tokens` (the same bits, many more operations).
    ``share_prefixes``: a fused decode step reads a prompt prefix that several rows hold once per group of rows
    (:mod:`~rlrunbook.engines.prefix_sharing`; the same bits), else once per row (for comparisons).

    :meth:`sample_adapters` decodes the rows of several samplers of one base model (different LoRA snapshots of
    one layout) as one batch, each row with its own adapter (as S-LoRA and Punica batch adapters): the base
    weights are read once per decode step for all of them, and each row's results are the ones its sampler
    gets alone. Each adapter slot keeps a pinned copy of its factors and a prefix pool of its own (memory: at
    most :data:`MAX_ADAPTERS` of each). On CUDA such a batch's decode steps are captured as graphs too (one per
    set of slots; which row takes which slot is the graph's input).
    """

    name = "hf"

    def __init__(self, model: torch.nn.Module, *, pad_token_id: int, vocab_size: int,
                 max_context: int | None = None, max_batch_rows: int = 256, seed: int = 0,
                 decode_batch: DecodeBatch | None = None, numerics: Numerics | str = "invariant",
                 prefix_cache_tokens: int = 65536, cuda_graphs: bool | None = None, sync_every: int = SYNC_EVERY,
                 fused_draw: bool = True, share_prefixes: bool = True, kept_products_bytes: int = 0,
                 coded_weights: bool = True):
        super().__init__(pad_token_id=pad_token_id, vocab_size=vocab_size, max_context=max_context,
                         max_batch_rows=max_batch_rows, seed=seed, decode_batch=decode_batch)
        self.decoder = Decoder(model, numerics)
        # frozen float32 weights read from their short exact form where they have one (kernels/coded_weights.py)
        self.decoder.coded_weights = coded_weights
        self.prefix_cache_tokens = prefix_cache_tokens
        # Base products of the last calls under one snapshot, kept for the trainer's pass over their tokens (CPU,
        # one sampler per call; at most this many bytes; 0: none). See engines/kept_products.py.
        self.kept_products_bytes = kept_products_bytes
        self.kept: KeptProducts | None = None
        self._pinned_weights: Mapping[str, torch.Tensor] | None = None  # the snapshot pinned_weights computes with
        self._pools: list[_PrefixPool] = []  # one per adapter of a call, matched to the adapters by key
        self._pinned: PinnedAdapter | None = None
        self._slot_pins: list[PinnedAdapter] = []  # slots of sample_adapters (the first is _pinned)
        self._caches: dict[int, RowCache] = {}  # by rows, all of capacity self._capacity
        self._capacity = 0
        self._graphs = None
        self._use_graphs = cuda_graphs
        if sync_every < 1:
            raise ValueError(f"sync_every={sync_every}: the drawn tokens must be read back every >= 1 steps")
        self.sync_every = sync_every  # under the fixed-order numerics; other numerics read every step
        self.fused_draw = fused_draw  # the draw in one kernel (False: the eager reference, for comparisons)
        self.share_prefixes = share_prefixes  # decode attention reads a shared prompt prefix once per group
        self.host_reads = 0  # device-to-host reads of the decode loop (one per block of sync_every steps)
        self.cache_rebuilds = 0  # times the decode caches were dropped for a larger capacity
        self._dropped_captures = 0  # graphs captured, then dropped with their caches
        # Counters for tests and benchmarks: tokens prefilled, decode steps run and the seconds they took.
        self.prefill_tokens = 0
        self.prefill_seconds = 0.0
        self.decode_steps = 0
        self.decode_seconds = 0.0

    @property
    def model(self) -> torch.nn.Module:
        return self.decoder.model

    @model.setter
    def model(self, model: torch.nn.Module) -> None:
        self.decoder = Decoder(model, self.decoder.numerics)
        self._pools = []
        self._pinned = None
        self._slot_pins = []
        self._drop_caches()
        self._capacity = 0

    @property
    def graph_captures(self) -> int:
        """CUDA graphs of the decode step captured so far by this engine (0 off CUDA)."""
        return self._dropped_captures + (self._graphs.captures if self._graphs is not None else 0)

    def metrics(self) -> dict[str, float]:
        """Counters a training loop logs per step: graph captures and decode cache rebuilds since the engine began."""
        return {"engine/graph_captures": float(self.graph_captures),
                "engine/cache_rebuilds": float(self.cache_rebuilds)}

    @contextmanager
    def pinned_weights(self, adapter: Mapping[str, torch.Tensor] | None, key: Hashable) -> Iterator[None]:
        """Inside the block this engine computes with ``adapter`` (a sampler snapshot's tensors by parameter
        name; ``None``: the base model), copied into its own buffers (:mod:`rlrunbook.engines.pinned_adapter`),
        whatever the trainer does meanwhile to the model's adapter. Not reentrant across threads: one
        sampling worker uses an engine."""
        if self._pinned is None:
            self._pinned = PinnedAdapter(self.decoder.model)
        self._pinned.load(adapter, key)
        self.decoder.pinned = self._pinned
        self._pinned_weights = adapter
        try:
            yield
        finally:
            self.decoder.pinned = None
            self._pinned_weights = None

    def _drop_caches(self) -> None:
        self._dropped_captures = self.graph_captures
        self._caches = {}
        self._graphs = None

    def sample_jobs(self, jobs: Sequence[SampleJob], weights_key: Hashable | None = None) -> list[list[Completion]]:
        """Sample several callers' jobs in as few batched calls as possible.

        Jobs must share ``max_tokens``, filters and stops (their seeds may differ). Row ``j`` of a
        job is seeded by ``(job seed, j)``, so each job's samples are what it would get alone.
        ``weights_key`` names the weights the model computes with: prefixes cached by earlier calls
        with the same key are reused; ``None`` (or another key) starts from an empty pool.
        """
        if not jobs:
            return []
        rows, request = self.seeded_rows(jobs)
        completions = self._sample_all(rows, [0] * len(rows), request, [_Source(None, weights_key)])
        return split_by_job(jobs, completions)

    def sample_adapters(self, groups: Sequence[AdapterJobs]) -> list[list[list[Completion]]]:
        """Sample several samplers' jobs, each with its own adapter snapshot, decoding their rows as one batch.

        Every group's jobs must share ``max_tokens``, filters and stops with every other group's; each adapter
        must fit the model's LoRA layout (the samplers of training clients made alike over this engine's base
        weights). Returns, per group, per job, the completions: bitwise what :meth:`sample_jobs` gives the group
        alone under :meth:`pinned_weights` of its adapter (a row's numbers depend on its tokens and its adapter
        only). At most :data:`MAX_ADAPTERS` groups."""
        if not 0 < len(groups) <= MAX_ADAPTERS:
            raise ValueError(f"sample_adapters: {len(groups)} adapters in one call; 1 to {MAX_ADAPTERS}")
        while len(self._slot_pins) < len(groups):
            if not self._slot_pins:
                self._pinned = self._pinned or PinnedAdapter(self.decoder.model)
                self._slot_pins.append(self._pinned)
            else:
                self._slot_pins.append(PinnedAdapter(self.decoder.model))
        jobs = [job for group in groups for job in group.jobs]
        if not jobs:
            return [[] for _ in groups]
        request = shared_request(jobs)  # every sampler's jobs share max_tokens, filters and stops
        rows: list[tuple[list[int], int]] = []
        row_slots: list[int] = []
        for slot, group in enumerate(groups):
            if group.jobs:
                group_rows, _ = self.seeded_rows(group.jobs)
                rows += group_rows
                row_slots += [slot] * len(group_rows)
        for pin, group in zip(self._slot_pins, groups):
            pin.load(group.adapter, group.key)
        sources = [_Source(pin, group.key) for pin, group in zip(self._slot_pins, groups)]
        completions = self._sample_all(rows, row_slots, request, sources)
        results, cursor = [], 0
        for group in groups:
            count = sum(job.num_samples for job in group.jobs)
            results.append(split_by_job(group.jobs, completions[cursor:cursor + count]))
            cursor += count
        return results

    def _sample_all(self, rows: list[tuple[list[int], int]], row_slots: list[int], request: GenerationRequest,
                    sources: Sequence[_Source]) -> list[Completion]:
        """Every row's completion, in batches of at most ``max_batch_rows`` (``row_slots``: each row's source)."""
        completions: list[Completion] = []
        self.decoder.keeping = self._keeping(sources)
        try:
            with self.decoder.weights_fixed():  # the weights cannot change during one sampling call
                for start in range(0, len(rows), self.max_batch_rows):
                    end = start + self.max_batch_rows
                    completions += self._sample_rows(rows[start:end], row_slots[start:end], request, sources)
        finally:
            self.decoder.keeping = None
        return completions

    def drop_kept(self) -> None:
        """Free :attr:`kept` (the trainer's weights moved away from the snapshot it was computed with)."""
        self.kept = None

    def _keeping(self, sources: Sequence[_Source]) -> KeptProducts | None:
        """Where this call keeps its projection outputs (``None``: it keeps none): :attr:`kept`, continued where the
        last call computed with the same snapshot (its key and tensors) and no training pass released it, else made
        anew (dropping the last). Only a call of one pinned snapshot on CPU, under the fixed numerics, with a budget
        (``kept_products_bytes``)."""
        weights = self._pinned_weights
        if (self.kept_products_bytes <= 0 or len(sources) != 1 or sources[0].pinned is not None or weights is None
                or not self.decoder.fixed or self.device.type != "cpu"):
            return None
        key = sources[0].key
        if (self.kept is None or self.kept.released or key is None or self.kept.key != key
                or self.kept.weights is not weights):
            self.kept = KeptProducts(weights, key, self.kept_products_bytes, spares=self.kept)  # its memory reused
        return self.kept

    # -- one batched call -------------------------------------------------------------------------
    def _pool_for(self, key: Hashable | None, needed: int, taken: Sequence[_PrefixPool],
                  wanted: set[Hashable]) -> _PrefixPool:
        """The prefix pool for weights ``key`` in this call: the one that holds that key's prefixes, else one no
        other source of the call wants (emptied for ``key``), else a new one; not one already ``taken``. A pool
        that would pass ``prefix_cache_tokens`` with ``needed`` more is emptied first. The engine keeps at most
        as many pools as the most adapters one call held."""
        free = [pool for pool in self._pools if all(pool is not other for other in taken)]
        pool = next((pool for pool in free if key is not None and pool.key == key), None)
        if pool is None:
            pool = next((pool for pool in free if pool.key not in wanted), None)
            if pool is None:
                pool = _PrefixPool(self.decoder, self.device)
                self._pools.append(pool)
            pool.reset(key)
        elif len(pool.trie) + needed > self.prefix_cache_tokens:
            pool.reset(key)
        return pool

    @contextmanager
    def _factors_of(self, source: _Source) -> Iterator[None]:
        """Inside the block the decoder computes with ``source``'s adapter (``pinned`` None: as it is)."""
        if source.pinned is None:
            yield
            return
        previous, self.decoder.pinned = self.decoder.pinned, source.pinned
        try:
            yield
        finally:
            self.decoder.pinned = previous

    def _prefill(self, pool: _PrefixPool, prompts: list[tuple[int, ...]]) -> torch.Tensor:
        """Compute what the pool lacks of ``prompts``; return each prompt's next-token logits ``[P, V]``."""
        device = self.device
        started = time.perf_counter()
        plan = plan_forward(pool.trie, prompts, last_token_computed=True, max_queries=_PREFILL_QUERY_BLOCK)
        pool.store.reserve(len(pool.trie))
        flat = plan.flat_of()
        trie = pool.trie
        ids = torch.tensor([trie.tokens[n] for n in plan.nodes], device=device)
        positions = torch.tensor([trie.positions[n] for n in plan.nodes], device=device)
        layout = TreeLayout(plan.rows, flat, trie.positions, device, pool.store)
        hidden = self.decoder.hidden(ids, positions, layout)  # [N, E]
        self.prefill_tokens += len(plan.nodes)
        last = torch.tensor([flat[path[-1]] for path in plan.paths], device=device)
        logits = self.decoder.logits(hidden[last])
        keeping = self.decoder.keeping
        if keeping is not None:  # the products of every token computed here, the logits after each prompt
            first, kept_logits = keeping.last, keeping.keep_logits(logits)
            for i, (prompt, path) in enumerate(zip(prompts, plan.paths, strict=True)):
                keeping.place(prompt, {} if first is None else
                              {t: first + flat[node] for t, node in enumerate(path) if node in flat},
                              None if kept_logits is None else {len(prompt) - 1: (kept_logits, i)})
        self.prefill_seconds += time.perf_counter() - started
        return logits

    def _cache(self, rows: int, needed: int) -> RowCache:
        """The engine's decode cache of ``rows`` rows (a power of two) holding at least ``needed`` positions, emptied.

        Caches are kept and reused (captured CUDA graphs read their buffers), all of one capacity, which only
        grows, by :func:`capacity_bucket`: a call needing more drops every cache and graph (a rebuild). The
        caches of fewer rows (a batch shrinks as rows finish) are the first rows of the largest one, so the
        engine holds one ``rows x capacity`` cache, not one per row count; needing more rows is a rebuild too.
        """
        largest = max(self._caches, default=0)
        if needed > self._capacity or rows > largest:
            if self._capacity:
                self.cache_rebuilds += 1
            self._drop_caches()
            self._capacity = max(self._capacity, capacity_bucket(needed, self.max_context))
            decoder = self.decoder
            self._caches[rows] = RowCache(len(decoder.lm.model.layers), rows, self._capacity, decoder.num_kv_heads,
                                          decoder.head_dim, decoder.dtype, self.device)
            largest = rows
        cache = self._caches.get(rows)
        if cache is None:
            decoder = self.decoder
            cache = RowCache(len(decoder.lm.model.layers), rows, self._capacity, decoder.num_kv_heads,
                             decoder.head_dim, decoder.dtype, self.device, within=self._caches[largest])
            self._caches[rows] = cache
        cache.reset()
        return cache

    def _new_cache(self, pools: Sequence[_PrefixPool], row_slots: list[int], prompts: list[list[int]],
                   capacity: int) -> RowCache:
        """A decode cache holding each row's prompt keys/values, copied from its adapter slot's pool (the rows of a
        slot are consecutive)."""
        device = self.device
        cache = self._cache(_bucket(len(prompts)), capacity)
        width = max(len(p) for p in prompts)
        paths = []
        for slot, pool in enumerate(pools):
            first = next((i for i, s in enumerate(row_slots) if s == slot), None)
            if first is None:
                continue
            last = first + row_slots.count(slot)
            slots = torch.zeros(last - first, width, dtype=torch.long)
            for row in range(first, last):
                path, existing = pool.trie.insert(prompts[row])
                assert existing == len(prompts[row]), "prefill must have put every prompt in the pool"
                slots[row - first, : len(path)] = torch.tensor(path) - 1
                paths.append([slot * _POOL_SPACING + node for node in path])
            slots = slots.to(device)
            for layer in range(len(cache.keys)):
                cache.keys[layer][first:last, :width] = pool.store.keys[layer][slots]
                cache.values[layer][first:last, :width] = pool.store.values[layer][slots]
        cache.lengths[: len(prompts)] = torch.tensor([len(p) for p in prompts], device=device)
        # Rows copied from the same slots hold the same bits: the fused CPU step reads such a prefix once per group.
        if self.share_prefixes and device.type == "cpu":
            cache.share_prefixes(common_prefixes(paths, cache.rows))
        return cache

    def _step(self, cache: RowCache, tokens: torch.Tensor, running: torch.Tensor, needed: int,
              adapters: tuple[RowAdapters, RowAdapters | None] | None = None) -> torch.Tensor:
        """One decode step of every cache row; logits ``[len(running), V]`` of the running rows. ``needed`` is the
        longest row's length plus one, which the caller knows (no read of ``cache.lengths``). ``adapters``: each
        cache row's adapter and each running row's (``None`` with graphs: the graph's output layer runs on every cache
        row), where the rows are several samplers' (else the decoder's own state)."""
        started = time.perf_counter()
        cache.window = min(cache.capacity, -(-needed // _WINDOW_STEP) * _WINDOW_STEP)
        if adapters is not None and self._graphs_enabled():  # the rows' slots are an input of the captured graph
            self.decoder.row_adapters = adapters[0]
            try:
                logits = self._graph_runner().step(cache, tokens)[running]
            finally:
                self.decoder.row_adapters = None
        elif adapters is not None:
            try:
                self.decoder.row_adapters = adapters[0]
                hidden = self.decoder.hidden(tokens, cache.lengths, cache)[running]
                self.decoder.row_adapters = adapters[1]  # the output layer may carry an adapter too
                logits = self.decoder.logits(hidden)
            finally:
                self.decoder.row_adapters = None
        elif self._graphs_enabled():
            logits = self._graph_runner().step(cache, tokens)[running]
        else:
            logits = self.decoder.logits(self.decoder.hidden(tokens, cache.lengths, cache)[running])  # [running, V]
        self.decode_steps += 1
        self.decode_seconds += time.perf_counter() - started  # on CUDA: launch time (the draw syncs later)
        return logits

    def _read_back(self, draws: StepDraws, rows: int, columns: int, flag: torch.Tensor | None):
        """The only device-to-host read of the decode loop (counted in ``host_reads``)."""
        self.host_reads += 1
        return draws.read(rows, columns, flag)

    @torch.no_grad()
    def _sample_rows(self, rows: list[tuple[list[int], int]], row_slots: list[int], request: GenerationRequest,
                     sources: Sequence[_Source]) -> list[Completion]:
        """Decode in blocks of ``sync_every`` steps: within a block every row that was running at its start is
        drawn and fed on the device (a row that stops inside the block runs on to its end; what it drew past its
        stop is dropped), and the block's draws are read back once, at its end, where stops are found and the batch
        shrinks. Rows' results do not depend on the rows beside them (the fixed-order numerics), so they are those
        of a step-by-step loop.

        ``row_slots[i]`` (not decreasing) is row ``i``'s index in ``sources``: each slot's prompts are prefilled
        with its adapter into its pool, and with more than one slot each decode step computes each row with its
        own adapter (:class:`~rlrunbook.engines.pinned_adapter.RowAdapters`)."""
        device = self.device
        prompts = [prompt for prompt, _ in rows]
        pools: list[_PrefixPool] = []
        index: dict[tuple[int, tuple[int, ...]], int] = {}  # (slot, prompt) -> its row of the prefill logits
        parts = []
        wanted = {source.key for source in sources if source.key is not None}  # pools of these keys are kept
        for slot, source in enumerate(sources):
            mine = [p for p, s in zip(prompts, row_slots) if s == slot]
            distinct = list(dict.fromkeys(tuple(p) for p in mine))
            needed = sum(len(p) for p in distinct) + len(mine) * request.max_tokens
            pool = self._pool_for(source.key, needed, pools, wanted)
            pools.append(pool)
            with self._factors_of(source):
                parts += [self._prefill(pool, part) for part in prefill_parts(distinct) if part]
            index.update({(slot, p): len(index) + i for i, p in enumerate(distinct)})
        first_logits = torch.cat(parts)
        logits = first_logits[torch.tensor([index[s, tuple(p)] for p, s in zip(prompts, row_slots)], device=device)]
        cache = self._new_cache(pools, row_slots, prompts, max(len(p) for p in prompts) + request.max_tokens)
        # A call of several samplers (sample_adapters) decodes each row with its slot's adapter, even where this
        # batch holds one slot's rows only; one sampler's call computes with the decoder's own state.
        per_row = any(source.pinned is not None for source in sources)
        slot_pins = [source.pinned for source in sources]
        lengths = [len(p) for p in prompts] + [0] * (cache.rows - len(prompts))  # cache.lengths, known on the host
        seeds = torch.tensor([seed for _, seed in rows], dtype=torch.int64, device=device)
        tracker = StopTracker(len(rows), request.stop, request.stop_strings, self.decode_batch)
        sampled: list[list[float]] = [[] for _ in rows]
        policy: list[list[float]] = [[] for _ in rows]
        in_cache: list[int | None] = list(range(len(rows)))  # original row of each cache row (None: finished)
        filters = request.filters
        every = self.sync_every if self.decoder.fixed else 1  # other numerics follow the batch: shrink it on time
        draws = StepDraws(len(rows), every, device, self.fused_draw and self.decoder.fixed and
                          device.type in ("cpu", "cuda"), self.decoder.log_softmax_at)
        live = list(range(len(rows)))  # cache rows drawn (and fed) in this block
        keeping = self.decoder.keeping
        kept_steps: list[_KeptStep] = []
        slots_of = None  # the in_cache list the cache rows' adapters were made for
        step = 0
        while True:
            width = min(every, request.max_tokens - step)
            adapters = None
            if per_row:
                if slots_of is not in_cache:  # the cache's rows changed (the batch shrank): their slots again
                    last = row_slots[-1]  # a padding row takes the last slot's adapter: the slots stay in row order
                    cache_slots = [last if i >= len(in_cache) or in_cache[i] is None else row_slots[in_cache[i]]
                                   for i in range(cache.rows)]
                    cache_adapters, slots_of = RowAdapters.of_rows(slot_pins, cache_slots, device), in_cache
                running_adapters = (None if self._graphs_enabled()  # a graph computes the output layer for every row
                                    else RowAdapters.of_rows(slot_pins, [cache_slots[i] for i in live], device))
                adapters = (cache_adapters, running_adapters)
            running = [in_cache[i] for i in live]
            # One host-to-device copy per block: the cache rows drawn, their seeds' rows, the rows fed, the first feed.
            fed = [0] * cache.rows
            for i in live:
                fed[i] = 1
            feed_in = [tracker.generated[row][-1] if step else 0 for row in running]
            packed = torch.tensor(live + running + fed + feed_in, dtype=torch.int64).to(device, non_blocking=True)
            n = len(live)
            live_index, row_seeds = packed[:n], seeds[packed[n:2 * n]]
            fed_mask, feed = packed[2 * n:2 * n + cache.rows], torch.zeros(cache.rows, dtype=torch.int64,
                                                                           device=device)
            if step:
                feed[live_index] = packed[2 * n + cache.rows:]
            for column in range(width):
                if step + column:
                    needed = max(lengths) + 1
                    logits = self._step(cache, feed, live_index, needed, adapters)
                    if keeping is not None:
                        kept_steps.append((keeping.last, keeping.keep_logits(logits), step + column,
                                           [(i, k, in_cache[i]) for k, i in enumerate(live)]))
                    cache.lengths.add_(fed_mask)
                    for i in live:
                        lengths[i] += 1
                if column == 0:
                    leak = self._leak_flag(logits, filters)
                draws.draw(logits, filters, row_seeds, step + column, column, feed, live_index)
            tokens, lps, plps, leaked = self._read_back(draws, n, width, leak)
            if leaked:
                raise GenerationLeakError(f"decode step {step}: the sampled scores differ from logits / T although "
                                          "no filter was requested; engines/filters.py changed what it computes.")
            for column in range(width):  # a row that stopped earlier in the block ran on: what it drew is dropped
                now = [(k, row) for k, row in enumerate(running) if tracker.ends[row] is None]
                for k, row in now:
                    sampled[row].append(lps[k][column])
                    policy[row].append(plps[k][column])
                tracker.append([row for _, row in now], [tokens[k][column] for k, _ in now])
            step += width
            if step == request.max_tokens:
                break
            cache, in_cache, lengths = self._retire(pools, row_slots, cache, in_cache, prompts, tracker, lengths)
            live = [i for i, row in enumerate(in_cache) if row is not None and tracker.ends[row] is None]
            if not live:
                break
        self._retire(pools, row_slots, cache, in_cache, prompts, tracker, lengths, final=True)
        if kept_steps:
            self._place_decoded(keeping, kept_steps, prompts, tracker)
        return [Completion(tokens=tracker.generated[r][:tracker.kept(r)], logprobs=sampled[r][:tracker.kept(r)],
                           policy_logprobs=policy[r][:tracker.kept(r)],
                           stop_reason="length" if tracker.ends[r] is None else "stop")
                for r in range(len(rows))]

    @staticmethod
    def _place_decoded(keeping: KeptProducts, kept_steps: list[_KeptStep], prompts: list[list[int]],
                       tracker: StopTracker) -> None:
        """Name the token each kept decode step's rows computed: step ``s`` (from 1) fed row ``r``'s sampled token
        ``s - 1``, at position ``len(prompt) + s - 1``, and drew from the logits after it; tokens drawn past a row's
        stop are not part of it."""
        products: dict[int, dict[int, int]] = {}
        logits: dict[int, dict[int, tuple[int, int]]] = {}
        for first, kept_logits, step, fed in kept_steps:
            for cache_row, logits_row, row in fed:
                if step - 1 < tracker.kept(row):
                    position = len(prompts[row]) + step - 1
                    if first is not None:
                        products.setdefault(row, {})[position] = first + cache_row
                    if kept_logits is not None:
                        logits.setdefault(row, {})[position] = (kept_logits, logits_row)
        for row in products.keys() | logits.keys():
            keeping.place(prompts[row] + tracker.generated[row][:tracker.kept(row)], products.get(row, {}),
                          logits.get(row))

    def _retire(self, pools: Sequence[_PrefixPool], row_slots: list[int], cache: RowCache, in_cache: list[int | None],
                prompts: list[list[int]], tracker: StopTracker, lengths: list[int], final: bool = False
                ) -> tuple[RowCache, list[int | None], list[int]]:
        """Shrink the batch once the running rows fit half of it (or at the end, ``final``); ``lengths`` are the
        cache rows' lengths (``cache.lengths`` as the host knows them), returned for the cache returned.

        Finished rows stay in place, no longer fed, until then; when they leave, their keys and values
        (the prompt and every generated token but the last, which was never fed back) go to the pool
        for later calls under the same weights.
        """
        occupied = [i for i, row in enumerate(in_cache) if row is not None]
        running = [] if final else [i for i in occupied if tracker.ends[in_cache[i]] is None]
        if running and _bucket(len(running)) >= cache.rows:
            return cache, in_cache, lengths
        leaving = [i for i in occupied if i not in running]
        for slot, pool in enumerate(pools):  # each row's keys and values go to its own adapter's pool
            mine = [i for i in leaving if row_slots[in_cache[i]] == slot]
            if mine and pool.key is not None and self.prefix_cache_tokens > 0:
                pool.absorb(cache, mine, [prompts[in_cache[i]] + tracker.generated[in_cache[i]][:-1] for i in mine],
                            self.prefix_cache_tokens)
        if not running:
            return cache, [None] * cache.rows, lengths
        smaller = self._cache(_bucket(len(running)), cache.capacity)
        cache.copy_rows_to(smaller, torch.tensor(running, device=cache.lengths.device))
        padding = smaller.rows - len(running)
        return (smaller, [in_cache[i] for i in running] + [None] * padding,
                [lengths[i] for i in running] + [0] * padding)

    @staticmethod
    def _leak_flag(logits: torch.Tensor, filters) -> torch.Tensor | None:
        """Where no filter applies, the sampled scores must be exactly logits / T (nothing else ran): a device bool,
        true if they differ, read back with the block's draws (``None`` where filters apply)."""
        if filters.greedy or filters.filters_tokens:
            return None
        logits = logits if logits.dtype == torch.float32 else logits.float()
        processed = apply_filters(logits, filters)
        expected = logits / filters.temperature if filters.temperature != 1.0 else logits
        return (processed != expected).any()

    # -- CUDA graphs ------------------------------------------------------------------------------
    def _graphs_enabled(self) -> bool:
        return self.device.type == "cuda" and self._use_graphs is not False

    def _graph_runner(self):
        if self._graphs is None:
            from rlrunbook.engines.graphs import DecodeGraphs

            self._graphs = DecodeGraphs(self.decoder)
        return self._graphs
