"""The whole RL step (sample, score, train) at a fixed shape: seconds per step and tokens per second.

Single-turn GRPO: qa ``test`` set, 16 rollouts in 2 groups of 8, 32 tokens each.
One debate step: qa ``test``, 8 rollouts in 2 groups (2 debates each), 3 rounds of 24 tokens,
mock judge, rejection training; each round is one batched sampling call (asserted).
``extra_info`` holds seconds per step (median), sampled tokens/s and trained tokens/s from the
step's own log row, and the machine. The gate (rlrunbook.testing.bench_gates.regression_failures): seconds per
step within 2.5x of the figure stored for the device, model and shape in ``baselines.json`` (a device without one
fails, saying how to store it; ``RLRUNBOOK_UPDATE_BENCH_BASELINE=1`` stores this run's). Models from ``RLRUNBOOK_BENCH_MODELS`` (default here:
smollm2-135m only, the shape the README quotes).
"""

from __future__ import annotations

import dataclasses
import os

import pytest
from bench_support import (
    baselines,
    bench_device,
    describe,
    median_seconds,
    store_baseline,
    updating_baselines,
)

from rlrunbook.backend import LocalServiceClient, LocalSettings
from rlrunbook.rl.setup.config import TrainConfig
from rlrunbook.rl.setup.data_order import DataCursor
from rlrunbook.rl.training.plan import plan_run
from rlrunbook.rl.training.step import one_step
from rlrunbook.run import RunWriter, new_run_dir
from rlrunbook.testing.bench_gates import RL_STEP_REGRESSION, baseline_device, regression_failures

pytestmark = pytest.mark.benchmark(group="rl_step")

MODELS = [m for m in os.environ.get("RLRUNBOOK_BENCH_MODELS", "smollm2-135m").split(",") if m]
SHAPES = {
    "single_turn_grpo": dict(mode="single_turn", env="qa", num_rollouts=16, num_groups=2, max_tokens=32),
    "debate_rejection": dict(mode="debate", env="qa", num_rollouts=8, num_groups=2, max_tokens=24,
                             mock_judge=True, debate_train="rejection"),
}


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("model", MODELS)
def test_rl_step(benchmark, tmp_path, model, shape):
    import torch

    plan = plan_run(TrainConfig(model=model, steps=1, seed=0, log_root=str(tmp_path), **SHAPES[shape]))
    plan = dataclasses.replace(plan, training_problems=plan.problems, order=list(range(len(plan.problems))))
    config = plan.config
    device = bench_device()
    service = LocalServiceClient(LocalSettings(device=device, storage_dir=tmp_path / "tinker"))
    training = service.create_lora_training_client(model, rank=config.lora_rank, seed=0)
    tokenizer = training.get_tokenizer()
    writer = RunWriter(new_run_dir(tmp_path, config.run_mode, config.env, "bench"))
    writer.write_metadata(config.to_dict(), {}, [], {})
    judge = plan.judge.build(service, tokenizer)
    cursor = DataCursor()
    lines: list[str] = []
    steps = iter(range(100))

    def timed_step():
        one_step(plan, next(steps), training, tokenizer, judge, writer, lines.append, cursor)

    batches_before = service._worker.batches_run
    benchmark.pedantic(timed_step, rounds=3, iterations=1, warmup_rounds=1)
    if config.mode == "debate":  # 3 rounds per step, one batched call each
        assert service._worker.batches_run - batches_before == 3 * 4
    rows = writer.read_train_log()
    last = rows[-1]
    benchmark.extra_info.update(describe(device, torch.float32 if device == "cpu" else torch.bfloat16))
    median = median_seconds(benchmark)
    if median is not None:  # pytest-benchmark disabled: no statistics, no gate (the step's assertions still run)
        benchmark.extra_info["seconds_per_step"] = round(median, 3)
    benchmark.extra_info["sampled_tokens_per_s"] = round(sorted(r["throughput/sampled_tokens_per_s"] for r in rows)[len(rows) // 2], 1)
    benchmark.extra_info["trained_tokens_per_s"] = round(sorted(r["throughput/trained_tokens_per_s"] for r in rows)[len(rows) // 2], 1)
    benchmark.extra_info["trained_tokens"] = last["num_trained_tokens"]
    service.close()
    if median is None:
        return
    key = f"rl_step/{baseline_device(device)}/{model}/{shape}"
    if updating_baselines():
        store_baseline(key, {"seconds_per_step": round(median, 3)}, device)
        return
    failures = regression_failures("RL step", key, median, baselines().get(key), "seconds_per_step",
                                   RL_STEP_REGRESSION, " s")
    assert not failures, "\n".join(failures)
