"""Asynchronous RL with the vLLM sampler: the server samples while the trainer trains, and an asynchronous run
is still reproducible bit for bit (the server samples a snapshot written from the sampler's own weights)."""

from __future__ import annotations

import dataclasses
import json
import threading
import time
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


def _run(root: Path, monkeypatch, vllm_url: str, slow_sampler: float) -> Path:
    from rlrunbook.backend.sampling_client import LocalSamplingClient

    monkeypatch.setenv("TINKER_LOCAL_SAMPLER", "vllm")
    monkeypatch.setenv("TINKER_LOCAL_VLLM_URL", vllm_url)
    original = LocalSamplingClient._sample_batch

    def slowed(self, *args, **kwargs):
        time.sleep(slow_sampler)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(LocalSamplingClient, "_sample_batch", slowed)
    config = TrainConfig(model="tiny-vllm", env="summary", num_rollouts=4, num_groups=1, steps=3, max_tokens=16,
                         seed=0, learning_rate=0.05, off_policy=1, log_root=str(root), name="async-vllm",
                         checkpoint={"every": 3})
    return run_training(config, log=lambda *_: None)


def test_an_asynchronous_run_with_the_vllm_sampler_is_reproducible(tmp_path, monkeypatch, vllm_url):
    runs = [_run(tmp_path / name, monkeypatch, vllm_url, slow) for name, slow in (("a", 0.0), ("b", 0.5))]
    rows = [[{k: v for k, v in json.loads(line).items() if not k.startswith(VOLATILE)}
             for line in (run / "train_log.jsonl").read_text().splitlines()] for run in runs]
    assert [row["async/staleness"] for row in rows[0]] == [0, 1, 1]
    assert rows[0] == rows[1]
    adapters = [(run / "checkpoints" / "step_000003" / "adapter_model.safetensors").read_bytes() for run in runs]
    assert adapters[0] == adapters[1]
