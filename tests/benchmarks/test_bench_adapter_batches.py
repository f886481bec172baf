"""Serve clients sampling at once: several training clients of one base model, each sampling its own LoRA snapshot.

``clients`` LoRA training clients (rank 32) over one base model each make a sampler; each sampler's request is
``rows`` samples of its own prompt (``PROMPT_TOKENS`` tokens, ``tokens`` new tokens, ``stop=[]``: every row
generates exactly that many, checked). The shape is ``RLRUNBOOK_CLIENTS_SHAPE`` (``CLIENTSxROWSxTOKENS``, default
``4x4x32``; ``scripts/speed_check.py clients`` runs ``4x16x64`` on the GPU). Measured in one run, the modes interleaved, median of ``ROUNDS``:

- **one client**: one sampler's request alone;
- **together**: every sampler's request submitted at once: their rows decode as one batch, each row with its own
  adapter (the base weights read once per decode step for all clients);
- **one after another**: the same requests at once, with the samplers' batching across clients switched off (each
  client's request is its own engine call, as before adapters were batched).

All three give identical tokens per request (rows are seeded per request). Figures in ``extra_info``: tokens/s of
each mode and ``together_vs_one_client`` (the issue's GPU target: >= 3 with 4 clients).
"""

from __future__ import annotations

import os
import statistics
import time

import pytest
from bench_support import PROMPT_TOKENS, bench_device, bench_models, describe, token_windows
from tinker import types

from rlrunbook.backend import LocalServiceClient, LocalSettings
from rlrunbook.backend.sampling_client import LocalSamplingClient

pytestmark = pytest.mark.benchmark(group="adapter-batches")

SHAPE_ENV = "RLRUNBOOK_CLIENTS_SHAPE"
ROUNDS = 3


def clients_shape() -> tuple[int, int, int]:
    """(clients, rows per client, new tokens) from ``RLRUNBOOK_CLIENTS_SHAPE``; ``ValueError`` naming it."""
    raw = os.environ.get(SHAPE_ENV, "").strip() or "4x4x32"
    parts = raw.split("x")
    if len(parts) != 3 or not all(part.isdigit() and int(part) > 0 for part in parts) or int(parts[0]) < 2:
        raise ValueError(f"{SHAPE_ENV}={raw!r}: give CLIENTSxROWSxTOKENS, positive, at least 2 clients (4x16x64)")
    clients, rows, tokens = map(int, parts)
    return clients, rows, tokens


def _params(client: int, tokens: int) -> types.SamplingParams:
    return types.SamplingParams(max_tokens=tokens, temperature=1.0, seed=500 + client, stop=[])


def _submit(samplers, prompts, rows: int, tokens: int) -> tuple[float, list[list[list[int]]]]:
    started = time.perf_counter()
    with samplers[0].batch():
        futures = [s.sample(p, rows, _params(i, tokens))
                   for i, (s, p) in enumerate(zip(samplers, prompts, strict=True))]
    tokens = [[list(seq.tokens) for seq in future.result().sequences] for future in futures]
    return time.perf_counter() - started, tokens


@pytest.mark.parametrize("model_name", bench_models())
def test_bench_serve_clients_sampling_at_once(benchmark, model_name, tmp_path, monkeypatch):
    device = bench_device()
    clients, rows, tokens = clients_shape()
    settings = LocalSettings(device=device, storage_dir=tmp_path)
    with LocalServiceClient(settings) as service:
        samplers = [service.create_lora_training_client(model_name, rank=32, seed=i)
                    .save_weights_and_get_sampling_client() for i in range(clients)]
        prompts = [types.ModelInput.from_ints(w) for w in token_windows(samplers[0].get_tokenizer(), clients,
                                                                         PROMPT_TOKENS)]
        worker = service._worker
        merge_key = LocalSamplingClient._merge_key

        def apart(fn):
            with monkeypatch.context() as patch:
                patch.setattr(LocalSamplingClient, "_merge_key", lambda self, request: None)
                return fn()

        modes = {"one_client": lambda: _submit(samplers[:1], prompts[:1], rows, tokens),
                 "together": lambda: _submit(samplers, prompts, rows, tokens),
                 "one_after_another": lambda: apart(lambda: _submit(samplers, prompts, rows, tokens))}
        for run in modes.values():  # warm-up
            run()
        seconds: dict[str, list[float]] = {name: [] for name in modes}
        results: dict[str, list] = {name: [] for name in modes}
        calls_before = worker.batches_run
        for _ in range(ROUNDS):
            for name, run in modes.items():
                elapsed, drawn = run()
                seconds[name].append(elapsed)
                results[name].append(drawn)
        calls = worker.batches_run - calls_before
        benchmark.pedantic(modes["together"], rounds=1, iterations=1)
        assert LocalSamplingClient._merge_key is merge_key

    reference = results["one_after_another"][0]
    assert all(len(row) == tokens for request in reference for row in request)
    assert all(tokens == reference for tokens in results["together"] + results["one_after_another"])
    assert all(tokens == reference[:1] for tokens in results["one_client"])
    assert calls == ROUNDS * (1 + 1 + clients), f"engine calls {calls}: the together mode was not one batch"
    rate = {name: (clients if name != "one_client" else 1) * rows * tokens / statistics.median(values)
            for name, values in seconds.items()}
    benchmark.extra_info.update(describe(device, settings.resolved_dtype()))
    benchmark.extra_info.update(
        model=model_name, clients=clients, rows_per_client=rows, max_tokens=tokens, prompt_tokens=PROMPT_TOKENS,
        **{f"tokens_per_s_{name}": value for name, value in rate.items()},
        together_vs_one_client=rate["together"] / rate["one_client"],
        together_vs_one_after_another=rate["together"] / rate["one_after_another"])
    print(f"\n[{model_name}] {clients} clients x {rows} rows x {tokens} tokens: one client "
          f"{rate['one_client']:.0f} tok/s, together {rate['together']:.0f} tok/s "
          f"(x{rate['together'] / rate['one_client']:.2f} of one client), one after another "
          f"{rate['one_after_another']:.0f} tok/s (together x{rate['together'] / rate['one_after_another']:.2f})")
