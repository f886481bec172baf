"""Sampling throughput of HFSamplingEngine: generated tokens per second at a fixed shape.

8 prompts x 1 sample, each prompt exactly 32 tokens, max_tokens 32 with stops disabled (every
row generates exactly 32 tokens, checked), T = 1, seed 0; the engine's per-step score check is
on, as in production. Figure: ``extra_info["tokens_per_s"]`` = 256 generated tokens / median
seconds per call. Device from ``RLRUNBOOK_BENCH_DEVICE`` (default cuda if available, else cpu),
dtype the backend's default for it (bf16 on CUDA, fp32 on CPU). Allocator advice: bench_support.
"""

from __future__ import annotations

import pytest
from bench_support import (
    COMPLETION_TOKENS,
    PROMPT_TOKENS,
    ROWS,
    bench_device,
    bench_models,
    describe,
    median_seconds,
    synchronize,
    token_windows,
)

from rlrunbook.backend.model_host import load_host
from rlrunbook.backend.settings import LocalSettings
from rlrunbook.engines.base import GenerationRequest
from rlrunbook.engines.filters import SamplingFilters

pytestmark = pytest.mark.benchmark(group="sampling")


@pytest.mark.parametrize("model_name", bench_models())
def test_bench_sampling_tokens_per_second(benchmark, model_name):
    """Median time of one 8 x 32-token generate call; every row must generate exactly max_tokens."""
    device = bench_device()
    settings = LocalSettings(device=device)
    host = load_host(model_name, settings)
    prompts = token_windows(host.tokenizer, ROWS, PROMPT_TOKENS)
    request = GenerationRequest(max_tokens=COMPLETION_TOKENS, filters=SamplingFilters(temperature=1.0),
                                stop=(), seed=0)

    def sample():
        result = host.engine.sample(prompts, 1, request)
        synchronize(device)
        return result

    result = benchmark.pedantic(sample, rounds=3, iterations=1, warmup_rounds=1)

    lengths = [len(c.tokens) for samples in result for c in samples]
    assert lengths == [COMPLETION_TOKENS] * ROWS, f"rows generated {lengths} tokens, not {COMPLETION_TOKENS}"
    tokens_per_call = ROWS * COMPLETION_TOKENS
    benchmark.extra_info.update(describe(device, settings.resolved_dtype()))
    benchmark.extra_info.update(model=model_name, rows=ROWS, prompt_tokens=PROMPT_TOKENS,
                                max_tokens=COMPLETION_TOKENS, tokens_per_call=tokens_per_call)
    median = median_seconds(benchmark)
    if median is not None:
        benchmark.extra_info["tokens_per_s"] = tokens_per_call / median
