"""The local backend's concurrent sampling: a sampler samples its own snapshot on a worker of its own.

With ``concurrent_sampling`` a SamplingClient's calls do not wait behind ``forward_backward``/``optim_step``,
return exactly what their snapshot gives however the trainer moves the live adapter meanwhile, and the two
workers split the CPU's intra-op threads instead of doubling them.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from tinker import types

from rlrunbook.backend import LocalServiceClient, LocalSettings
from rlrunbook.tokens import build_datum_arrays

PROMPT = [5, 17, 42, 9, 11]
PARAMS = types.SamplingParams(max_tokens=8, temperature=1.0, seed=3, stop=[])


def _service(tmp_path, concurrent: bool) -> LocalServiceClient:
    return LocalServiceClient(LocalSettings(device="cpu", dtype=torch.float32, storage_dir=tmp_path / "tinker",
                                            concurrent_sampling=concurrent))


def _datums(sequences, advantages):
    out = []
    for s, a in zip(sequences, advantages, strict=True):
        arrays = build_datum_arrays(PROMPT, s.tokens, s.logprobs, [a] * len(s.tokens))
        out.append(types.Datum(model_input=types.ModelInput.from_ints(arrays.input_tokens),
                               loss_fn_inputs={"target_tokens": arrays.target_tokens, "logprobs": arrays.logprobs,
                                               "advantages": arrays.advantages}))
    return out


def _sample(sampler):
    response = sampler.sample(types.ModelInput.from_ints(PROMPT), 4, PARAMS).result(timeout=60)
    return [(list(s.tokens), list(s.logprobs)) for s in response.sequences]


@pytest.fixture
def concurrent(tmp_path):
    service = _service(tmp_path, True)
    yield service
    service.close()


def test_sampling_does_not_wait_behind_forward_backward(concurrent, monkeypatch):
    training = concurrent.create_lora_training_client("tiny", rank=4, seed=0)
    sampler = training.save_weights_and_get_sampling_client()
    sequences = sampler.sample(types.ModelInput.from_ints(PROMPT), 4, PARAMS).result().sequences
    release, entered = threading.Event(), threading.Event()
    original = training._trainer.forward_backward

    def blocked(*args, **kwargs):
        entered.set()
        assert release.wait(60), "the test never released forward_backward"
        return original(*args, **kwargs)

    monkeypatch.setattr(training._trainer, "forward_backward", blocked)
    fb = training.forward_backward(_datums(sequences, [1.0, -1.0, 0.5, -0.5]), "importance_sampling")
    assert entered.wait(30)
    try:  # one worker in submission order would wait here until forward_backward returned: it never would
        assert len(_sample(sampler)) == 4
    finally:
        release.set()
    assert fb.result(timeout=60).metrics["num_trained_tokens:sum"] == 32


def test_a_snapshot_samples_the_same_while_the_trainer_steps(concurrent):
    """The same calls on two snapshots of the same weights give the same bits, one of them while the trainer
    steps. (Calls are compared in the same sequence: a later call under the same weights reuses the cached
    prompt keys and values, which may move an fp32 logprob by an ulp; see engines/hf.py.)"""
    training = concurrent.create_lora_training_client("tiny", rank=4, seed=0)
    quiet, busy = training.save_weights_and_get_sampling_client(), training.save_weights_and_get_sampling_client()
    expected = [_sample(quiet) for _ in range(4)]
    sequences = busy.sample(types.ModelInput.from_ints(PROMPT), 4, PARAMS).result().sequences
    got = [[(list(s.tokens), list(s.logprobs)) for s in sequences]]
    for _ in range(3):  # submitted without waiting: the sample call runs while the trainer computes
        fb = training.forward_backward(_datums(sequences, [1.0, -1.0, 0.5, -0.5]), "importance_sampling")
        optim = training.optim_step(types.AdamParams(learning_rate=5e-2))
        got.append(_sample(busy))
        fb.result(), optim.result()
    assert got == expected, "a sampler's results changed while the trainer stepped"
    assert _sample(training.save_weights_and_get_sampling_client()) != expected[0], \
        "the trainer did not move: the test shows nothing"


def test_the_two_workers_split_the_cpu_threads(concurrent):
    training = concurrent.create_lora_training_client("tiny", rank=4, seed=0)
    sampler = training.save_weights_and_get_sampling_client()
    _sample(sampler)
    train_threads = concurrent._worker.run(torch.get_num_threads)
    sample_threads = sampler._worker.run(torch.get_num_threads)
    assert sampler._worker.worker is not concurrent._worker
    total = torch.get_num_threads()  # this thread's count: the process's, untouched by the workers' own
    assert (train_threads, sample_threads) == concurrent.settings.worker_threads()
    assert sample_threads >= 1 and train_threads >= 1
    assert train_threads + sample_threads == max(2, total), "the threads are split, not doubled"


def test_without_concurrent_sampling_one_worker_runs_everything(tmp_path):
    service = _service(tmp_path, False)
    try:
        training = service.create_lora_training_client("tiny", rank=4, seed=0)
        sampler = training.save_weights_and_get_sampling_client()
        assert sampler._worker.worker is service._worker and service._worker.threads is None
        assert service._sampling_worker is None
    finally:
        service.close()


def test_a_pinned_sampler_ignores_the_trainers_adapter_switch(concurrent):
    """peft's disable_adapter() flips a switch on the shared modules (the KL reference does it on the training
    worker); a sampler computes with its pinned snapshot and never reads that switch."""
    training = concurrent.create_lora_training_client("tiny", rank=4, seed=0)
    sequences = training.save_weights_and_get_sampling_client().sample(
        types.ModelInput.from_ints(PROMPT), 4, PARAMS).result().sequences
    training.forward_backward(_datums(sequences, [1.0, -1.0, 0.5, -0.5]), "importance_sampling").result()
    training.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    first, second = training.save_weights_and_get_sampling_client(), training.save_weights_and_get_sampling_client()
    expected = _sample(first)
    with training._host.model.disable_adapter():
        assert _sample(second) == expected
    assert _sample(concurrent.create_sampling_client(base_model="tiny")) != expected, "the adapter changes nothing"


def test_a_vllm_adapter_is_written_from_the_snapshot_not_the_live_weights(concurrent, tmp_path):
    """What a vLLM server loads for a sampler is its snapshot, written while the trainer moves the live
    adapter (so a vLLM sampler may run on the sampling worker)."""
    from safetensors.torch import load_file

    from rlrunbook.backend.vllm_sampling import snapshot_adapter

    training = concurrent.create_lora_training_client("tiny", rank=4, seed=0)
    sampler = training.save_weights_and_get_sampling_client()
    snapshot = sampler.weights_state()
    host = training._host
    with torch.no_grad():  # the trainer moves on: every live LoRA factor changes
        for name, parameter in host.model.named_parameters():
            if name in snapshot:
                parameter.add_(1.0)
    adapter = snapshot_adapter(host, sampler._weights)
    adapter.write(tmp_path / "written")
    written = load_file(str(tmp_path / "written" / "adapter_model.safetensors"))
    assert len(written) == len(snapshot) > 0
    for name, tensor in snapshot.items():
        saved = name.replace(".default.", ".")  # peft drops the adapter's name in the file
        assert torch.equal(written[saved], tensor), name


def test_the_timeline_shows_sampling_while_forward_backward_runs(tmp_path, monkeypatch):
    """``TINKER_LOCAL_TIMELINE``: one line per worker call; a sample held inside a blocked forward_backward
    appears inside it."""
    import dataclasses

    from rlrunbook.backend.timeline import overlap_seconds, read_timeline

    path = tmp_path / "timeline.jsonl"
    service = LocalServiceClient(dataclasses.replace(LocalSettings.from_env({"TINKER_LOCAL_TIMELINE": str(path)}),
                                                     device="cpu", dtype=torch.float32,
                                                     storage_dir=tmp_path / "tinker", concurrent_sampling=True))
    try:
        training = service.create_lora_training_client("tiny", rank=4, seed=0)
        sampler = training.save_weights_and_get_sampling_client()
        sequences = sampler.sample(types.ModelInput.from_ints(PROMPT), 4, PARAMS).result().sequences
        release = threading.Event()
        original = training._trainer.forward_backward

        def blocked(*args, **kwargs):
            assert release.wait(60)
            return original(*args, **kwargs)

        monkeypatch.setattr(training._trainer, "forward_backward", blocked)
        fb = training.forward_backward(_datums(sequences, [1.0, -1.0, 0.5, -0.5]), "importance_sampling")
        time.sleep(0.2)
        try:
            _sample(sampler)
        finally:
            release.set()
        fb.result(timeout=60)
    finally:
        service.close()
    records = read_timeline(path)
    calls = {(r["worker"], r["call"]) for r in records}
    assert ("rlrunbook-sampler", "LocalSamplingClient._sample_batch") in calls, calls
    assert any(worker == "rlrunbook-local" and "forward_backward" in call for worker, call in calls), calls
    assert all(r["end"] >= r["start"] for r in records)
    assert overlap_seconds(records, "rlrunbook-local", "rlrunbook-sampler") > 0


def test_a_timeline_that_cannot_be_written_is_refused_up_front(tmp_path):
    from rlrunbook.backend.timeline import Timeline
    from rlrunbook.errors import ConfigError

    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="TINKER_LOCAL_TIMELINE"):
        Timeline(tmp_path / "file" / "timeline.jsonl")  # its folder is a file
    with pytest.raises(ConfigError, match="TINKER_LOCAL_TIMELINE"):
        Timeline(tmp_path)  # a folder


def test_a_timeline_write_that_fails_later_warns_once_and_the_worker_goes_on(tmp_path, capsys):
    from rlrunbook.backend.futures import OrderedWorker
    from rlrunbook.backend.timeline import Timeline

    timeline = Timeline(tmp_path / "t" / "timeline.jsonl")
    (tmp_path / "t" / "timeline.jsonl").unlink()
    (tmp_path / "t").rmdir()  # the folder is gone: every write fails
    worker = OrderedWorker(timeline=timeline)
    try:
        assert [worker.run(lambda i=i: i * 2) for i in range(3)] == [0, 2, 4]
    finally:
        worker.shutdown()
    assert capsys.readouterr().err.count("warning: TINKER_LOCAL_TIMELINE") == 1
