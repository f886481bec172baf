"""Concurrent single-sample requests: what the local backend's batching turns them into.

The cookbook's token completer sends one ``sample(num_samples=1)`` per environment and awaits all
of them at once (``asyncio.gather``). Measured in one run, on one sampling client:

- **batched**: 32 such requests in flight together; the worker coalesces them into as few engine
  calls as it can (the count is recorded and must be at most 3: the first call starts on whatever
  arrived within the collection window, the rest wait and go together);
- **one by one**: the same 32 requests, each awaited before the next is sent (32 engine calls).

Each request: its own 32-token prompt, seed, ``max_tokens=16``, ``stop=[]`` (every row generates
exactly 16 tokens, checked), T = 1. Both modes must return identical tokens (rows are seeded per
request). Figures in ``extra_info``: ``requests_per_s_batched``, ``requests_per_s_one_by_one``,
``speedup`` and ``engine_calls_batched``, from the median of 3 rounds of each after a warm-up.
"""

from __future__ import annotations

import asyncio
import statistics
import time

import pytest
from bench_support import PROMPT_TOKENS, bench_device, bench_models, describe, token_windows
from tinker import types

from rlrunbook.backend import LocalServiceClient, LocalSettings

pytestmark = pytest.mark.benchmark(group="batching")

REQUESTS = 32
MAX_TOKENS = 16
ROUNDS = 3


def _params(i: int) -> types.SamplingParams:
    return types.SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=1000 + i, stop=[])


async def _batched(sampler, prompts):
    return await asyncio.gather(*(sampler.sample(p, 1, _params(i)) for i, p in enumerate(prompts)))


async def _one_by_one(sampler, prompts):
    return [await sampler.sample(p, 1, _params(i)) for i, p in enumerate(prompts)]


def _timed(fn, *args):
    start = time.perf_counter()
    result = asyncio.run(fn(*args))
    return time.perf_counter() - start, result


def _tokens(responses):
    return [r.sequences[0].tokens for r in responses]


@pytest.mark.parametrize("model_name", bench_models())
def test_bench_concurrent_single_sample_requests(benchmark, model_name, tmp_path):
    device = bench_device()
    settings = LocalSettings(device=device, storage_dir=tmp_path)
    with LocalServiceClient(settings) as service:
        sampler = service.create_sampling_client(base_model=model_name)
        windows = token_windows(sampler.get_tokenizer(), REQUESTS, PROMPT_TOKENS)
        prompts = [types.ModelInput.from_ints(w) for w in windows]
        worker = service._worker

        _timed(_batched, sampler, prompts)  # warm-up
        calls_before = worker.batches_run
        batched = [_timed(_batched, sampler, prompts) for _ in range(ROUNDS)]
        engine_calls = (worker.batches_run - calls_before) / ROUNDS
        serial = [_timed(_one_by_one, sampler, prompts) for _ in range(ROUNDS)]
        benchmark.pedantic(lambda: asyncio.run(_batched(sampler, prompts)), rounds=1, iterations=1)

    reference = _tokens(serial[0][1])
    assert all(len(t) == MAX_TOKENS for t in reference)
    assert all(_tokens(result) == reference for _, result in batched + serial), "batching changed a result"
    assert engine_calls <= 3, f"{REQUESTS} concurrent requests took {engine_calls} engine calls"
    batched_rps = REQUESTS / statistics.median(s for s, _ in batched)
    serial_rps = REQUESTS / statistics.median(s for s, _ in serial)
    benchmark.extra_info.update(describe(device, settings.resolved_dtype()))
    benchmark.extra_info.update(
        model=model_name, requests=REQUESTS, max_tokens=MAX_TOKENS, prompt_tokens=PROMPT_TOKENS,
        engine_calls_batched=engine_calls, requests_per_s_batched=batched_rps,
        requests_per_s_one_by_one=serial_rps, speedup=batched_rps / serial_rps,
    )
    print(f"\n[{model_name}] {REQUESTS} single-sample requests: batched {batched_rps:.1f} req/s "
          f"({engine_calls:g} engine calls), one by one {serial_rps:.1f} req/s, x{batched_rps / serial_rps:.2f}")
    assert batched_rps > serial_rps
