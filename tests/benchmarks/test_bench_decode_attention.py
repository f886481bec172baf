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
