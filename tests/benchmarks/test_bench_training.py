"""Training throughput of the local TrainingClient: forward_backward tokens/s and optim_step time.

8 datums of 32 prompt + 32 completion tokens (63 input positions each, 32 trained), advantages
+1/-1, sampling logprobs taken from the learner itself (ratio 1), ``importance_sampling``, LoRA
rank 32 (the SDK default) on every linear layer. Figures in ``extra_info``:
``trained_tokens_per_s`` (256 / median seconds) and ``input_tokens_per_s`` (504 / median) for
forward_backward; the median seconds of an AdamW optim_step (its forward_backward is untimed
setup). Device from ``RLRUNBOOK_BENCH_DEVICE``; allocator advice: bench_support.
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
from tinker import types

from rlrunbook.backend import LocalServiceClient, LocalSettings
from rlrunbook.tokens import build_datum_arrays

pytestmark = pytest.mark.benchmark(group="training")

LOSS = "importance_sampling"
RANK = 32


def _datum(prompt: list[int], completion: list[int], logprobs: list[float] | None,
           advantage: float) -> types.Datum:
    arrays = build_datum_arrays(prompt, completion, logprobs, [advantage] * len(completion))
    return types.Datum(
        model_input=types.ModelInput.from_ints(arrays.input_tokens),
        loss_fn_inputs={"target_tokens": arrays.target_tokens, "logprobs": arrays.logprobs,
                        "advantages": arrays.advantages},
    )


@pytest.fixture(scope="module", params=bench_models())
def training_setup(request, tmp_path_factory):
    """(model name, settings, training client, the 8 datums) of one model, shared by both benchmarks."""
    settings = LocalSettings(device=bench_device(), storage_dir=tmp_path_factory.mktemp("tinker"))
    service = LocalServiceClient(settings)
    client = service.create_lora_training_client(request.param, rank=RANK, seed=0)
    windows = token_windows(client.get_tokenizer(), ROWS, PROMPT_TOKENS + COMPLETION_TOKENS)
    pairs = [(w[:PROMPT_TOKENS], w[PROMPT_TOKENS:]) for w in windows]
    advantages = [1.0 if i % 2 == 0 else -1.0 for i in range(ROWS)]
    draft = [_datum(p, c, None, a) for (p, c), a in zip(pairs, advantages, strict=True)]
    learner = client.forward(draft, LOSS).result().loss_fn_outputs
    # The completion's logprobs are the last COMPLETION_TOKENS target positions (rlrunbook.tokens).
    data = [_datum(p, c, out["logprobs"].tolist()[-COMPLETION_TOKENS:], a)
            for (p, c), a, out in zip(pairs, advantages, learner, strict=True)]
    yield request.param, settings, client, data
    service.close()


def _info(benchmark, model_name: str, settings: LocalSettings) -> None:
    benchmark.extra_info.update(describe(settings.device, settings.resolved_dtype()))
    benchmark.extra_info.update(model=model_name, datums=ROWS, prompt_tokens=PROMPT_TOKENS,
                                completion_tokens=COMPLETION_TOKENS, loss=LOSS, lora_rank=RANK)


def test_bench_forward_backward(benchmark, training_setup):
    """Median forward_backward time; every completion token is trained, and the learner agrees (ratio 1)."""
    model_name, settings, client, data = training_setup

    def step():
        out = client.forward_backward(data, LOSS).result()
        synchronize(settings.device)
        return out

    out = benchmark.pedantic(step, rounds=3, iterations=1, warmup_rounds=1)

    trained, inputs = out.metrics["num_trained_tokens:sum"], out.metrics["num_tokens:sum"]
    assert trained == ROWS * COMPLETION_TOKENS
    assert inputs == ROWS * (PROMPT_TOKENS + COMPLETION_TOKENS - 1)
    assert abs(out.metrics["ratio:mean"] - 1) < 1e-3  # logprobs came from this learner
    _info(benchmark, model_name, settings)
    median = median_seconds(benchmark)
    if median is not None:
        benchmark.extra_info.update(trained_tokens_per_s=trained / median, input_tokens_per_s=inputs / median)


def test_bench_optim_step(benchmark, training_setup):
    """Median AdamW optim_step time over all LoRA parameters (the forward_backward before it is not timed)."""
    model_name, settings, client, data = training_setup

    def accumulate() -> None:
        client.forward_backward(data, LOSS).result()
        synchronize(settings.device)

    def step():
        response = client.optim_step(types.AdamParams(learning_rate=1e-5)).result()
        synchronize(settings.device)
        return response

    response = benchmark.pedantic(step, setup=accumulate, rounds=3, iterations=1, warmup_rounds=1)

    assert response.metrics["grad_norm:mean"] > 0
    _info(benchmark, model_name, settings)
    median = median_seconds(benchmark)
    if median is not None:
        benchmark.extra_info["optim_step_s"] = median


REGULARISERS = {
    "kl": {"kl_coef": 0.01, "kl_estimator": "low_var_kl"},       # + one no-grad forward with the adapter off
    "kl+entropy": {"kl_coef": 0.01, "kl_estimator": "low_var_kl", "entropy_coef": 0.001},
}


@pytest.mark.parametrize("terms", sorted(REGULARISERS))
def test_bench_forward_backward_regularised(benchmark, training_setup, terms):
    """forward_backward with the reference KL (and the entropy bonus): compare with test_bench_forward_backward."""
    model_name, settings, client, data = training_setup
    config = REGULARISERS[terms]

    def step():
        out = client.forward_backward(data, LOSS, config).result()
        synchronize(settings.device)
        return out

    out = benchmark.pedantic(step, rounds=3, iterations=1, warmup_rounds=1)

    assert out.metrics["loss:sum"] == pytest.approx(
        out.metrics["loss_pg:sum"] + out.metrics["loss_kl:sum"] + out.metrics["loss_entropy:sum"], rel=1e-5, abs=1e-6)
    assert ("entropy:mean" in out.metrics) == ("entropy_coef" in config)
    _info(benchmark, model_name, settings)
    benchmark.extra_info["loss_fn_config"] = config
    median = median_seconds(benchmark)
    if median is not None:
        benchmark.extra_info["trained_tokens_per_s"] = out.metrics["num_trained_tokens:sum"] / median


def test_bench_checkpoint_save_and_load(benchmark, training_setup, tmp_path):
    """Median time to export the training state and save a verified checkpoint, then load it back."""
    from rlrunbook.run.checkpoint_format import Checkpoint, capture_rng, load_checkpoint, save_checkpoint

    model_name, settings, client, data = training_setup
    client.forward_backward(data, LOSS).result()
    client.optim_step(types.AdamParams(learning_rate=1e-5)).result()  # the optimizer has state to save
    steps = iter(range(1, 1_000))

    def save_and_load():
        state = client.export_training_state()
        folder = save_checkpoint(tmp_path, Checkpoint(step=next(steps), config={}, adapter=state.adapter,
                                                      optimizer=state.optimizer, rng=capture_rng()))
        return folder, load_checkpoint(folder)

    folder, loaded = benchmark.pedantic(save_and_load, rounds=3, iterations=1, warmup_rounds=1)

    assert loaded.adapter.keys() == client.export_training_state().adapter.keys()
    _info(benchmark, model_name, settings)
    size = sum(p.stat().st_size for p in folder.iterdir())
    benchmark.extra_info.update(checkpoint_bytes=size, adapter_tensors=len(loaded.adapter))
