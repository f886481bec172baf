"""The fused decode attention on the CPU at the mini debate's shape: 16 rows of SmolLM2-135M's heads (9 query, 3
key/value, 64 wide) in float32, two articles of 268 prompt tokens read by 8 rows each, windows of 384 to 1,024
positions; each row reading its own cache against the shared prefix read once per group (the same bits).

The gate (rlrunbook.testing.bench_gates.decode_attention_failures): no window costs more than 3x its share of the
positions, and sharing is never slower. Run it as the benchmarks run (``scripts/test.sh``'s allocator settings:
without them each call's scratch buffers are returned to the system and faulted in again). Figures: ms per call (median of 30, the two ways interleaved).
"""

from __future__ import annotations

import statistics
import time

import pytest
import torch
from bench_support import bench_device

from rlrunbook.engines.prefix_sharing import common_prefixes, decode_parts
from rlrunbook.kernels import fused
from rlrunbook.testing.bench_gates import decode_attention_failures

pytestmark = pytest.mark.benchmark(group="decode-attention")

ROWS, HEADS, KV_HEADS, HEAD_DIM = 16, 9, 3, 64
WINDOWS = (384, 448, 512, 576, 768, 1024)


def test_decode_attention_ms_per_call(benchmark):
    if bench_device() != "cpu":
        pytest.skip("the fused decode attention is the CPU's kernel (a GPU decodes through captured graphs)")
    torch.manual_seed(0)
    capacity = max(WINDOWS)
    keys = torch.randn(ROWS, capacity, KV_HEADS, HEAD_DIM)
    values = torch.randn(ROWS, capacity, KV_HEADS, HEAD_DIM)
    prompts = [[row % 2] * 38 + [10 + row % 2] * 230 for row in range(ROWS)]  # 38 shared by all, 268 per article
    for row in range(2, ROWS):
        keys[row, :268], values[row, :268] = keys[row % 2, :268], values[row % 2, :268]
    plan = decode_parts(common_prefixes(prompts, ROWS), KV_HEADS, torch.get_num_threads())
    parts = (plan.order, plan.starts, plan.reload)
    qkv = torch.randn(ROWS, (HEADS + 2 * KV_HEADS) * HEAD_DIM)
    positions, valid = torch.arange(capacity), torch.ones(capacity, dtype=torch.uint8)

    def call(window: int, shared: bool) -> torch.Tensor:
        lengths = torch.full((ROWS,), window - 40)
        return fused.cached_attention(qkv, keys, values, lengths, positions, valid, window, HEADS, KV_HEADS,
                                      HEAD_DIM, HEAD_DIM ** -0.5, parts if shared else None)

    timings: dict[bool, dict[int, float]] = {False: {}, True: {}}
    for window in WINDOWS:
        assert torch.equal(call(window, False), call(window, True))
        samples: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(30):
            for shared in (False, True):
                started = time.perf_counter()
                call(window, shared)
                samples[shared].append(time.perf_counter() - started)
        for shared in (False, True):
            timings[shared][window] = statistics.median(samples[shared]) * 1e3
    benchmark.pedantic(call, args=(512, True), rounds=5, iterations=1)
    benchmark.extra_info.update({f"{'shared' if shared else 'own'}_ms_{window}": round(ms, 3)
                                 for shared, by_window in timings.items() for window, ms in by_window.items()})
    print("decode attention ms per call (own / shared):",
          ", ".join(f"{w}: {timings[False][w]:.2f} / {timings[True][w]:.2f}" for w in WINDOWS))
    failures = decode_attention_failures(timings[False], timings[True])
    assert not failures, "\n".join(failures)


LAYERS = 30  # SmolLM2-135M's: a decode step reads every layer's cache, more than the processor's caches hold


def test_decode_attention_ms_per_step_over_every_layer(benchmark):
    """The same rows and prefixes over 30 layers' caches at a 512-position window, as one decode step reads them:
    the caches (189 MB) come from memory, so what a shared prefix saves is its keys' and values' bytes. ms per step
    (the 30 calls), median of 15, the two ways interleaved; the same gate (sharing is never slower)."""
    if bench_device() != "cpu":
        pytest.skip("the fused decode attention is the CPU's kernel (a GPU decodes through captured graphs)")
    torch.manual_seed(0)
    window = capacity = 512
    prompts = [[row % 2] * 38 + [10 + row % 2] * 230 for row in range(ROWS)]
    layers = []
    for _ in range(LAYERS):
        keys, values = torch.randn(ROWS, capacity, KV_HEADS, HEAD_DIM), torch.randn(ROWS, capacity, KV_HEADS, HEAD_DIM)
        for row in range(2, ROWS):
            keys[row, :268], values[row, :268] = keys[row % 2, :268], values[row % 2, :268]
        layers.append((keys, values))
    plan = decode_parts(common_prefixes(prompts, ROWS), KV_HEADS, torch.get_num_threads())
    parts = (plan.order, plan.starts, plan.reload)
    qkv = torch.randn(ROWS, (HEADS + 2 * KV_HEADS) * HEAD_DIM)
    positions, valid, lengths = torch.arange(capacity), torch.ones(capacity, dtype=torch.uint8), torch.full((ROWS,), 470)

    def step(shared: bool) -> list[torch.Tensor]:
        return [fused.cached_attention(qkv, keys, values, lengths, positions, valid, window, HEADS, KV_HEADS,
                                       HEAD_DIM, HEAD_DIM ** -0.5, parts if shared else None)
                for keys, values in layers]

    assert all(torch.equal(a, b) for a, b in zip(step(False), step(True), strict=True))
    samples: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(15):
        for shared in (False, True):
            started = time.perf_counter()
            step(shared)
            samples[shared].append(time.perf_counter() - started)
    own, shared = (statistics.median(samples[s]) * 1e3 for s in (False, True))
    benchmark.pedantic(step, args=(True,), rounds=3, iterations=1)
    benchmark.extra_info.update({"layers": LAYERS, "window": window, "own_ms_per_step": round(own, 2),
                                 "shared_ms_per_step": round(shared, 2)})
    print(f"decode attention ms per step over {LAYERS} layers at {window} positions (own / shared): "
          f"{own:.2f} / {shared:.2f}")
    failures = decode_attention_failures({window: own}, {window: shared})
    assert not failures, "\n".join(failures)
