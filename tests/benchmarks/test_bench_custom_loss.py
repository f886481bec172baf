"""``forward_backward_custom`` against the built-in ``cross_entropy`` on the same batch.

8 datums of 32 prompt + 32 completion tokens (weights 0 on the prompt, 1 on the completion), LoRA rank 32. The
custom loss is the weighted negative log-likelihood, i.e. ``cross_entropy`` written as a callable: on the local
backend it is one forward and one backward pass, like the built-in, so the two should take the same time. The
two calls alternate, ``PAIRS`` times after a warm-up of each, and ``extra_info`` carries both medians and
``custom_over_cross_entropy`` (median of the per-pair ratios); the benchmark's own timing is the custom call. The
gate (rlrunbook.testing.bench_gates.custom_loss_failures): that ratio is at most 1.15, on every device.
"""

from __future__ import annotations

import statistics
import time

import pytest
from bench_support import (
    COMPLETION_TOKENS,
    PROMPT_TOKENS,
    ROWS,
    bench_device,
    bench_models,
    describe,
    synchronize,
    token_windows,
)
from tinker import types

from rlrunbook.backend import LocalServiceClient, LocalSettings
from rlrunbook.testing.bench_gates import custom_loss_failures
from rlrunbook.tokens import build_datum_arrays

pytestmark = pytest.mark.benchmark(group="custom_loss")

RANK = 32
PAIRS = 7


def weighted_nll(data, logprobs):
    """``cross_entropy`` as a custom loss: ``-sum_t w_t lp_t`` over every datum."""
    loss = sum(-(lp * d.loss_fn_inputs["weights"].to_torch()).sum() for d, lp in zip(data, logprobs, strict=True))
    return loss, {}


@pytest.fixture(scope="module", params=bench_models())
def setup(request, tmp_path_factory):
    settings = LocalSettings(device=bench_device(), storage_dir=tmp_path_factory.mktemp("tinker"))
    service = LocalServiceClient(settings)
    client = service.create_lora_training_client(request.param, rank=RANK, seed=0)
    data = []
    for window in token_windows(client.get_tokenizer(), ROWS, PROMPT_TOKENS + COMPLETION_TOKENS):
        arrays = build_datum_arrays(window[:PROMPT_TOKENS], window[PROMPT_TOKENS:])
        data.append(types.Datum(model_input=types.ModelInput.from_ints(arrays.input_tokens),
                                loss_fn_inputs={"target_tokens": arrays.target_tokens, "weights": arrays.weights}))
    yield request.param, settings, client, data
    service.close()


def _seconds(call, device: str) -> float:
    start = time.perf_counter()
    call().result()
    synchronize(device)
    return time.perf_counter() - start


def test_bench_custom_loss_against_cross_entropy(benchmark, setup):
    model_name, settings, client, data = setup
    builtin = lambda: client.forward_backward(data, "cross_entropy")  # noqa: E731
    custom = lambda: client.forward_backward_custom(data, weighted_nll)  # noqa: E731
    assert custom().result().metrics["loss:sum"] == pytest.approx(builtin().result().metrics["loss:sum"], rel=1e-5)
    pairs = [(_seconds(builtin, settings.device), _seconds(custom, settings.device)) for _ in range(PAIRS)]
    benchmark.extra_info.update(describe(settings.device, settings.resolved_dtype()))
    benchmark.extra_info.update(
        model=model_name, datums=ROWS, prompt_tokens=PROMPT_TOKENS, completion_tokens=COMPLETION_TOKENS, pairs=PAIRS,
        cross_entropy_median_s=statistics.median(b for b, _ in pairs),
        custom_median_s=statistics.median(c for _, c in pairs),
        custom_over_cross_entropy=statistics.median(c / b for b, c in pairs))
    benchmark.pedantic(lambda: custom().result(), rounds=3, iterations=1, warmup_rounds=0)
    failures = custom_loss_failures(benchmark.extra_info["custom_over_cross_entropy"])
    assert not failures, "\n".join(failures)
