"""Asynchronous RL with the vLLM sampler: the server samples a snapshot written from the sampler's own weights
while the trainer trains, on the schedule the config fixes.

Not asserted: bit-for-bit equality of two runs. Two runs through one CPU vLLM server differ in the sampler's
logprobs from the second step on (measured 2026-11-25: K = 0 and K = 1 alike; the server's prefix cache and
batch composition change its arithmetic) and sometimes in tokens; runs reproducible at any K need the
in-process engine (tests/unit/rl/training/test_off_policy.py)."""

from __future__ import annotations

import dataclasses
import json
import threading
from pathlib import Path

import pytest
from tinker import types

from rlrunbook.backend import LocalServiceClient
from rlrunbook.rl.setup.config import TrainConfig
from rlrunbook.rl.training.loop import run_training
from rlrunbook.tokens import build_datum_arrays

pytestmark = pytest.mark.vllm

PROMPT = [5, 17, 42, 9, 11]
PARAMS = types.SamplingParams(max_tokens=8, temperature=1.0, seed=3, stop=[])
VOLATILE = ("time/", "throughput/", "memory/", "async/sample_s", "async/wait_s")


def test_vllm_sampling_does_not_wait_behind_forward_backward(vllm_settings, monkeypatch):
    service = LocalServiceClient(dataclasses.replace(vllm_settings, concurrent_sampling=True))
    try:
        training = service.create_lora_training_client("tiny-vllm", rank=4, seed=0)
        sampler = training.save_weights_and_get_sampling_client()
        first = sampler.sample(types.ModelInput.from_ints(PROMPT), 2, PARAMS).result(timeout=300).sequences
        datums = []
        for s, advantage in zip(first, [1.0, -1.0], strict=True):
            arrays = build_datum_arrays(PROMPT, s.tokens, s.logprobs, [advantage] * len(s.tokens))
            datums.append(types.Datum(model_input=types.ModelInput.from_ints(arrays.input_tokens),
                                      loss_fn_inputs={"target_tokens": arrays.target_tokens,
                                                      "logprobs": arrays.logprobs, "advantages": arrays.advantages}))
        release, entered = threading.Event(), threading.Event()
        original = training._trainer.forward_backward

        def blocked(*args, **kwargs):
            entered.set()
            assert release.wait(300), "the test never released forward_backward"
            return original(*args, **kwargs)

        monkeypatch.setattr(training._trainer, "forward_backward", blocked)
        fb = training.forward_backward(datums, "importance_sampling")
        assert entered.wait(60)
        try:  # on the training worker this would wait for forward_backward, which waits for the release
            again = sampler.sample(types.ModelInput.from_ints(PROMPT), 2, PARAMS).result(timeout=300).sequences
        finally:
            release.set()
        assert [list(s.tokens) for s in again] == [list(s.tokens) for s in first]  # the same snapshot, same seed
        fb.result(timeout=300)
    finally:
        service.close()


def _run(root: Path, monkeypatch, vllm_url: str, off_policy: int, timeline: Path | None = None) -> Path:
    monkeypatch.setenv("TINKER_LOCAL_SAMPLER", "vllm")
    monkeypatch.setenv("TINKER_LOCAL_VLLM_URL", vllm_url)
    if timeline is not None:
        monkeypatch.setenv("TINKER_LOCAL_TIMELINE", str(timeline))
    config = TrainConfig(model="tiny-vllm", env="summary", num_rollouts=4, num_groups=1, steps=3, max_tokens=16,
                         seed=0, learning_rate=0.05, off_policy=off_policy, log_root=str(root), name="async-vllm",
                         checkpoint={"every": 3})
    return run_training(config, log=lambda *_: None)


def _rows(run: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if not k.startswith(VOLATILE)}
            for line in (run / "train_log.jsonl").read_text().splitlines()]


def test_an_asynchronous_run_with_the_vllm_sampler_samples_while_it_trains(tmp_path, monkeypatch, vllm_url):
    """K = 1 with the vLLM sampler: the lag is the scheduled one, the correction is on, and the server's
    sampling calls ran while training calls ran (the backend's timeline)."""
    from rlrunbook.backend.timeline import overlap_seconds, read_timeline

    timeline = tmp_path / "timeline.jsonl"
    rows = _rows(_run(tmp_path / "run", monkeypatch, vllm_url, 1, timeline))
    assert [row["async/staleness"] for row in rows] == [0, 1, 1]
    assert all("mismatch/corrected_fraction" in row for row in rows)
    records = read_timeline(timeline)
    sampling = [r for r in records if r["worker"] == "rlrunbook-sampler"]
    assert sampling and all(r["call"] == "LocalSamplingClient._sample_batch" for r in sampling)
    assert overlap_seconds(records, "rlrunbook-local", "rlrunbook-sampler") > 0
