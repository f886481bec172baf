"""Decode speed of the in-process engine against transformers' generate, at fixed shapes, in one run.

ms per decode step = (time of a call with N new tokens - time of a call with 1) / (N - 1): prefill and
the first draw cancel, so the figure is the steady decode step (with its draw), on any device. Both
engines sample the same rows (stop disabled, so every row runs N steps); their ratio is the claim,
measured side by side. ``warmup_s`` is the first call of a shape (CUDA graph capture on a GPU).
The memory-bandwidth floor of a step is the bytes of the weights / the device's bandwidth (0.09 ms
for SmolLM2-135M in bf16 on an H100).

The gate (rlrunbook.testing.bench_gates.decode_failures): the engine's step is faster than ``generate``'s on every
device; on CUDA it also meets the target of its shape (2 ms per step at 16 x 64, 3 ms at 64 x 256).

Shapes: ``RLRUNBOOK_DECODE_SHAPES`` (rows x new tokens x prompt tokens, comma-separated); default
16x64x32 on CPU, and 16x64x32,64x256x300 on CUDA. Model: ``RLRUNBOOK_BENCH_MODELS``' first (smollm2-135m).
"""

from __future__ import annotations

import os
import statistics
import time

import pytest
import torch
from bench_support import bench_device, describe, synchronize, token_windows

from rlrunbook.engines.base import GenerationRequest
from rlrunbook.engines.filters import SamplingFilters
from rlrunbook.engines.generate import GenerateEngine
from rlrunbook.engines.hf import HFSamplingEngine
from rlrunbook.testing.bench_gates import decode_failures

pytestmark = pytest.mark.benchmark(group="decode")


def _shapes() -> list[tuple[int, int, int]]:
    default = "16x64x32" if bench_device() == "cpu" else "16x64x32,64x256x300"
    raw = os.environ.get("RLRUNBOOK_DECODE_SHAPES", "").strip() or default
    return [tuple(int(x) for x in shape.split("x")) for shape in raw.split(",")]


def _timed(engine, prompt, rows, tokens, device) -> float:
    request = GenerationRequest(max_tokens=tokens, filters=SamplingFilters(1.0), stop=(), seed=1)
    synchronize(device)
    started = time.perf_counter()
    engine.sample([prompt], rows, request)
    synchronize(device)
    return time.perf_counter() - started


@pytest.mark.parametrize("shape", _shapes(), ids=lambda s: "x".join(map(str, s)))
def test_decode_ms_per_step(benchmark, shape):
    from rlrunbook.models import load_causal_lm, load_tokenizer, resolve_model

    rows, tokens, prompt_tokens = shape
    device = bench_device()
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    model_name = (os.environ.get("RLRUNBOOK_BENCH_MODELS", "") or "smollm2-135m").split(",")[0]
    folder = resolve_model(model_name)
    tokenizer = load_tokenizer(folder)
    model = load_causal_lm(folder, dtype=dtype, device=device)
    (prompt,) = token_windows(tokenizer, 1, prompt_tokens) if prompt_tokens <= 64 else [
        (tokenizer.encode("word " * prompt_tokens, add_special_tokens=False))[:prompt_tokens]]
    common = dict(pad_token_id=tokenizer.pad_token_id, vocab_size=model.config.vocab_size)
    engines = {"hf": HFSamplingEngine(model, **common), "generate": GenerateEngine(model, **common)}
    results = {}
    for name, engine in engines.items():
        warmup = _timed(engine, prompt, rows, tokens, device)
        steps = []
        for _ in range(3):
            full = _timed(engine, prompt, rows, tokens, device)
            first = _timed(engine, prompt, rows, 1, device)
            steps.append((full - first) / (tokens - 1))
        results[name] = (statistics.median(steps), warmup)
    benchmark.pedantic(lambda: _timed(engines["hf"], prompt, rows, tokens, device), rounds=1, iterations=1)
    hf_ms, generate_ms = 1e3 * results["hf"][0], 1e3 * results["generate"][0]
    benchmark.extra_info.update({
        "model": model_name, "rows": rows, "new_tokens": tokens, "prompt_tokens": len(prompt),
        "hf_ms_per_step": round(hf_ms, 3), "generate_ms_per_step": round(generate_ms, 3),
        "ratio_hf_over_generate": round(hf_ms / generate_ms, 3),
        "hf_warmup_s": round(results["hf"][1], 2), "generate_warmup_s": round(results["generate"][1], 2),
        **describe(device, dtype)})
    print(benchmark.extra_info)
    failures = decode_failures(device, rows, tokens, hf_ms, generate_ms)
    assert not failures, "\n".join(failures)
