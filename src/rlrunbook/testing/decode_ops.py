"""Kernels and host syncs per decode step of the in-process engine, counted with ``torch.profiler``.

One sampling call is profiled and its ops are split three ways: the **model step** (``HFSamplingEngine._step``, what
a CUDA graph captures and replays), the call's **setup** (``_prefill`` and ``_new_cache``: the prompts' forward
pass and the decode cache's fill, once per call) and **the rest** (the draw, the filters, the leak check and the
bookkeeping of every step), each given per decode step.

What is counted (on any device; the same ops run on CPU and on CUDA): top-level aten ops and the fixed-order
kernels (``rlrunbook::*``); an op called by another op is part of it. View-only ops (view, slice, select, ...)
are counted although they launch no kernel.

A **host sync** is a read of device values by the host: the ops that return a value to Python
(``aten::item``, ``aten::_local_scalar_dense``, ``aten::equal``, ``aten::is_nonzero``, ``aten::nonzero``),
seen by the profiler, plus the engine's own device-to-host reads of drawn tokens (``HFSamplingEngine.host_reads``:
``tolist`` is not an aten op, so the engine counts its reads itself). Host-to-device copies are not syncs.
"""

from __future__ import annotations

import bisect
import collections
from collections.abc import Sequence
from dataclasses import dataclass
from unittest import mock

from torch.profiler import ProfilerActivity, profile, record_function

from rlrunbook.engines.base import SampleJob
from rlrunbook.engines.hf import HFSamplingEngine

MODEL_STEP = "decode/model_step"
SETUP = "decode/setup"
COUNTED = ("aten::", "rlrunbook::")
SYNC_OPS = frozenset({"aten::item", "aten::_local_scalar_dense", "aten::equal", "aten::is_nonzero", "aten::nonzero"})


@dataclass(frozen=True)
class DecodeOpCounts:
    """Op counts of one profiled sampling call (totals over the call; divide by ``steps`` for per-step figures)."""

    steps: int  # decode steps run (model steps)
    model_step: collections.Counter  # op name -> count inside the model steps
    setup: collections.Counter  # inside prefill and the decode cache's fill
    rest: collections.Counter  # everything else: the draw, filters, leak check, bookkeeping
    host_reads: int  # the engine's device-to-host reads of drawn tokens during the call
    model_step_syncs: int  # sync ops inside the model steps (on CPU: lookups that are not syncs on CUDA)

    @property
    def rest_per_step(self) -> float:
        return sum(self.rest.values()) / max(self.steps, 1)

    @property
    def setup_per_step(self) -> float:
        return sum(self.setup.values()) / max(self.steps, 1)

    @property
    def model_step_per_step(self) -> float:
        return sum(self.model_step.values()) / max(self.steps, 1)

    @property
    def host_syncs(self) -> int:
        """Host syncs outside the model step and the setup: sync ops seen by the profiler plus the engine's reads."""
        return sum(count for name, count in self.rest.items() if name in SYNC_OPS) + self.host_reads


def _top_level(events) -> list:
    """The aten ops and fixed-order kernels of ``events`` that no other counted op called."""
    found = []
    for event in events:
        if not event.name.startswith(COUNTED):
            continue
        parent = event.cpu_parent
        while parent is not None and not parent.name.startswith(COUNTED):
            parent = parent.cpu_parent
        if parent is None:
            found.append(event)
    return found


def _marked(method, label: str):
    def marked(self, *args, **kwargs):
        with record_function(label):
            return method(self, *args, **kwargs)

    return marked


def count_decode_ops(engine: HFSamplingEngine, jobs: Sequence[SampleJob]) -> DecodeOpCounts:
    """Profile ``engine.sample_jobs(jobs)`` once (warm it up first: a first call builds caches) and count its ops
    per region (see the module docstring). ``engine`` must be an :class:`HFSamplingEngine`; it is used as is."""
    patches = [mock.patch.object(HFSamplingEngine, "_step", _marked(HFSamplingEngine._step, MODEL_STEP)),
               mock.patch.object(HFSamplingEngine, "_prefill", _marked(HFSamplingEngine._prefill, SETUP)),
               mock.patch.object(HFSamplingEngine, "_new_cache", _marked(HFSamplingEngine._new_cache, SETUP))]
    reads_before = engine.host_reads
    with patches[0], patches[1], patches[2], profile(activities=[ProfilerActivity.CPU]) as prof:
        engine.sample_jobs(jobs)
    events = prof.events()

    def spans_of(label: str) -> list[tuple[int, int]]:
        return sorted((e.time_range.start, e.time_range.end) for e in events if e.name == label)

    def inside(spans: list[tuple[int, int]], starts: list[int], t: int) -> bool:
        i = bisect.bisect_right(starts, t) - 1
        return i >= 0 and spans[i][0] <= t <= spans[i][1]

    step_spans, setup_spans = spans_of(MODEL_STEP), spans_of(SETUP)
    step_starts, setup_starts = [s for s, _ in step_spans], [s for s, _ in setup_spans]
    model_step, setup, rest = collections.Counter(), collections.Counter(), collections.Counter()
    for event in _top_level(events):
        t = event.time_range.start
        region = (model_step if inside(step_spans, step_starts, t)
                  else setup if inside(setup_spans, setup_starts, t) else rest)
        region[event.name] += 1
    return DecodeOpCounts(steps=len(step_spans), model_step=model_step, setup=setup, rest=rest,
                          host_reads=engine.host_reads - reads_before,
                          model_step_syncs=sum(c for n, c in model_step.items() if n in SYNC_OPS))
