"""CUDA graphs of the decode step: one capture per (cache buffers, window, adapter state), then replays.

A decode step of a small model is bound by kernel launches, not by arithmetic or by reading its weights
(docs/performance.md). Replaying a captured graph launches the whole step at once. Everything a step
reads lives in buffers that outlive the capture: the engine's reused
:class:`~rlrunbook.engines.layouts.RowCache` (keys, values, lengths), the token buffer below, and the
model's parameters, which optimizer steps and sampler snapshots change in place (or the engine's pinned
copies of them, :mod:`rlrunbook.engines.pinned_adapter`, whose addresses never change either), so a graph
captured once serves every later step of the run. Whether the adapter is on is a Python-side switch
(peft's ``disable_adapter()``, or the pinned state's flag), so the base model and the adapted one get
separate graphs. A step of several samplers' rows (:class:`~rlrunbook.engines.pinned_adapter.RowAdapters`) is
captured per set of adapter slots; which row takes which slot is copied into the graph's own input, like the tokens.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from rlrunbook.engines.decoder import Decoder
from rlrunbook.engines.layouts import RowCache
from rlrunbook.errors import ConfigError


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    tokens: torch.Tensor  # [rows] static input
    logits: torch.Tensor  # [rows, V] static output
    row_slot: torch.Tensor | None  # [rows] static input: each row's adapter slot (several samplers' rows)


class DecodeGraphs:
    """Captured decode steps of one :class:`Decoder`; :meth:`step` replays (capturing on first use)."""

    def __init__(self, decoder: Decoder):
        self.decoder = decoder
        self._captured: dict[tuple, _Captured] = {}
        self._memory_pool = torch.cuda.graph_pool_handle()
        self.captures = 0

    def _run(self, cache: RowCache, tokens: torch.Tensor) -> torch.Tensor:
        return self.decoder.logits(self.decoder.hidden(tokens, cache.lengths, cache))

    def step(self, cache: RowCache, tokens: torch.Tensor) -> torch.Tensor:
        """Logits ``[rows, V]`` of one decode step over every row of ``cache`` fed ``tokens`` (``[rows]``)."""
        key = (id(cache.keys[0]), cache.window, self.decoder.adapter_state())
        captured = self._captured.get(key)
        if captured is None:
            captured = self._capture(cache, tokens)
            self._captured[key] = captured
        captured.tokens.copy_(tokens)
        rows = self.decoder.row_adapters
        if rows is not None:
            captured.row_slot.copy_(rows.row_slot)
        captured.graph.replay()
        return captured.logits

    def _capture(self, cache: RowCache, tokens: torch.Tensor) -> _Captured:
        static_tokens = tokens.clone()
        rows = self.decoder.row_adapters
        static_slots = None
        if rows is not None:  # the graph reads the rows' slots from its own buffer
            static_slots = rows.row_slot.clone()
            self.decoder.row_adapters = dataclasses.replace(rows, row_slot=static_slots)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        try:
            with torch.cuda.stream(side):  # warm-up: lazy initialisations happen outside the capture
                for _ in range(2):
                    self._run(cache, static_tokens)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._memory_pool):
                logits = self._run(cache, static_tokens)
        except RuntimeError as error:
            raise ConfigError(f"capturing the decode step as a CUDA graph failed ({error}); set "
                              "TINKER_LOCAL_CUDA_GRAPHS=0 to decode without graphs.") from error
        finally:
            self.decoder.row_adapters = rows
        self.captures += 1
        return _Captured(graph, static_tokens, logits, static_slots)
