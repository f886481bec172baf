"""The CPU attention kernels' forward and backward at the mini debate's training shape, beside the fixed-order product.

The shape: 8 rows of the trainer's shared-prefix layout (a debater's branch: 180 query tokens over 450 keys, causal)
of SmolLM2-135M's heads (9 query, 3 key/value, 64 wide), float32. FLOPs counted: 4 D per (query, head, allowed key)
forward (the scores and the weighted values), 10 D backward (the scores again, dP, dq, dk and dv). The product
beside it is the trainer's gate/up projection over the same tokens (1,440 x 576 by 1,536 x 576). The gate
(rlrunbook.testing.bench_gates.training_attention_failures): forward and backward each reach 0.35x the product's
FLOP rate. Figures: medians of 7, the three calls interleaved; run under ``scripts/test.sh``'s allocator settings.
"""

from __future__ import annotations

import statistics
import time

import pytest
import torch
from bench_support import bench_device

from rlrunbook.kernels import cpu
from rlrunbook.testing.bench_gates import training_attention_failures

pytestmark = pytest.mark.benchmark(group="training-attention")

ROWS, QUERIES, KEYS, HEADS, KV_HEADS, HEAD_DIM = 8, 180, 450, 9, 3, 64
HIDDEN, INTERMEDIATE = 576, 1536


def test_training_attention_gflops(benchmark):
    if bench_device() != "cpu":
        pytest.skip("the C attention kernels are the CPU's (CUDA runs their Triton twins)")
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(ROWS, QUERIES, HEADS, HEAD_DIM, generator=generator)
    k, v = (torch.randn(ROWS, KEYS, KV_HEADS, HEAD_DIM, generator=generator) for _ in range(2))
    grad_out = torch.randn(ROWS, QUERIES, HEADS, HEAD_DIM, generator=generator)
    key_positions = torch.arange(KEYS).expand(ROWS, KEYS).contiguous()
    query_positions = (torch.arange(QUERIES) + KEYS - QUERIES).expand(ROWS, QUERIES).contiguous()
    valid = torch.ones(ROWS, KEYS, dtype=torch.bool)
    x = torch.randn(ROWS * QUERIES, HIDDEN, generator=generator)
    weight = torch.randn(INTERMEDIATE, HIDDEN, generator=generator)
    allowed = ROWS * HEADS * sum(KEYS - QUERIES + t + 1 for t in range(QUERIES))  # (query, head, key) triples
    flops = {"forward": 4 * HEAD_DIM * allowed, "backward": 10 * HEAD_DIM * allowed,
             "product": 2 * ROWS * QUERIES * HIDDEN * INTERMEDIATE}

    def forward():
        return cpu.attention_forward(q, k, v, query_positions, key_positions, valid, HEAD_DIM ** -0.5)

    out, lse = forward()
    calls = {"product": lambda: cpu.gemm_nt(x, weight, None, torch.float32), "forward": forward,
             "backward": lambda: cpu.attention_backward(q, k, v, query_positions, key_positions, valid, out,
                                                        grad_out, lse, HEAD_DIM ** -0.5)}
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(7):
        for name, call in calls.items():
            started = time.perf_counter()
            call()
            samples[name].append(time.perf_counter() - started)
    seconds = {name: statistics.median(times) for name, times in samples.items()}
    gflops = {name: flops[name] / seconds[name] / 1e9 for name in calls}
    benchmark.pedantic(forward, rounds=3, iterations=1)
    benchmark.extra_info.update({f"{name}_ms": round(seconds[name] * 1e3, 2) for name in calls})
    benchmark.extra_info.update({f"{name}_gflops": round(rate, 1) for name, rate in gflops.items()})
    print("training attention:", ", ".join(f"{name} {seconds[name] * 1e3:.1f} ms ({gflops[name]:.0f} GFLOP/s)"
                                          for name in calls))
    failures = training_attention_failures(gflops["forward"], gflops["backward"], gflops["product"])
    assert not failures, "\n".join(failures)
