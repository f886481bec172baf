"""The Tinker API surface that tinker-cookbook's recipes use, on the local backend.

Each test names the recipe code path it stands for. The recipes themselves run in
tests/e2e/test_e2e_cookbook.py; these pin the semantics underneath with exact numbers.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch
from tinker import types

from rlrunbook.backend import LocalRestClient, LocalServiceClient, LocalSettings, SdkLocalServiceClient
from rlrunbook.backend.model_state import OPTIMIZER_FILE
from rlrunbook.errors import ConfigError, ModelNotFoundError, NoLearningSignalError
from rlrunbook.tokens import build_datum_arrays

PROMPT = [5, 17, 42, 9, 11]
ADAM = types.AdamParams(learning_rate=1e-2, beta1=0.9, beta2=0.95, eps=1e-8)


def rl_data(sampler, seed=0, n=4):
    params = types.SamplingParams(max_tokens=8, temperature=1.0, seed=seed, stop=[])
    seqs = sampler.sample(types.ModelInput.from_ints(PROMPT), n, params).result().sequences
    data = []
    for i, s in enumerate(seqs):
        a = build_datum_arrays(PROMPT, s.tokens, s.logprobs, [float(i) - 1.5] * len(s.tokens))
        data.append(types.Datum(model_input=types.ModelInput.from_ints(a.input_tokens),
                                loss_fn_inputs={"target_tokens": a.target_tokens, "logprobs": a.logprobs,
                                                "advantages": a.advantages}))
    return data


def step(client, data):
    fb = client.forward_backward(data, "importance_sampling")
    opt = client.optim_step(ADAM)
    return fb.result(), opt.result()


def learner_logprobs(client, data):
    out = client.forward(data, "importance_sampling").result()
    return torch.cat([o["logprobs"].to_torch() for o in out.loss_fn_outputs])


@pytest.fixture
def run(local_service):
    client = local_service.create_lora_training_client("tiny", rank=4, seed=0,
                                                       user_metadata={"renderer_name": "qwen3_instruct"})
    data = rl_data(client.save_weights_and_get_sampling_client())
    return client, data


def test_clients_are_awaitable_and_resolve_on_the_worker_thread(local_service):
    """rl/train.py: `await service.create_lora_training_client(...)`; `.result()` on a pending future inside a loop."""
    async def main():
        with local_service as service:
            client = await service.create_lora_training_client("tiny", rank=4)
            sampler = await client.save_weights_and_get_sampling_client()
            future = sampler.sample(types.ModelInput.from_ints(PROMPT), 2, types.SamplingParams(max_tokens=4, seed=1))
            resolved_on = []
            future.future().add_done_callback(lambda _: resolved_on.append(threading.current_thread().name))
            blocking = future.result()  # inside a running loop: the work is on the worker thread, no deadlock
            awaited = await sampler.sample(types.ModelInput.from_ints(PROMPT), 2,
                                           types.SamplingParams(max_tokens=4, seed=1))
            return client.result() is client, blocking, awaited, resolved_on

    same, blocking, awaited, resolved_on = asyncio.run(main())
    assert same
    assert [s.tokens for s in blocking.sequences] == [s.tokens for s in awaited.sequences]
    assert resolved_on and resolved_on[0] != threading.main_thread().name
    assert local_service._closed, "leaving the `with` block closes the client, as the SDK's does"


def test_optim_step_reports_the_loss_it_applied(run):
    """The cookbook's RL loops log only optim_step metrics: loss:sum there is the loss the step optimised."""
    client, data = run
    fb, opt = step(client, data)
    assert opt.metrics["loss:sum"] == pytest.approx(fb.metrics["loss:sum"], rel=1e-6)
    assert set(opt.metrics) == {"grad_norm:mean", "learning_rate:mean", "loss:sum"}


def test_save_state_and_exact_resume_with_optimizer(run, local_service):
    """checkpoint_utils.save_checkpoint(kind='state') then create_training_client_from_state_with_optimizer."""
    client, data = run
    step(client, data)
    saved = client.save_state("000001").result()
    assert saved.path == f"tinker://{client.model_id}/weights/000001"
    folder = local_service._store.root / client.model_id / "weights" / "000001"
    state = torch.load(folder / OPTIMIZER_FILE, weights_only=True)  # tensors and numbers only
    assert set(state) == {"state", "param_groups"} and len(state["state"]) > 0

    _, continued = step(client, data)
    after_original = learner_logprobs(client, data)

    restored = local_service.create_training_client_from_state_with_optimizer(saved.path)
    assert restored.model_id != client.model_id
    _, resumed = step(restored, data)
    assert resumed.metrics["grad_norm:mean"] == pytest.approx(continued.metrics["grad_norm:mean"], rel=1e-5)
    assert torch.allclose(learner_logprobs(restored, data), after_original, atol=1e-5)

    fresh = local_service.create_training_client_from_state(saved.path)  # weights only: AdamW restarts
    step(fresh, data)
    assert (learner_logprobs(fresh, data) - after_original).abs().max() > 1e-4


def test_load_state_on_a_live_client(run):
    client, data = run
    before = learner_logprobs(client, data)
    path = client.save_state("start").result().path
    step(client, data)
    assert (learner_logprobs(client, data) - before).abs().max() > 1e-4
    client.load_state(path).result()
    assert torch.allclose(learner_logprobs(client, data), before, atol=1e-6)
    with pytest.raises(ConfigError, match="exists"):
        client.save_state("start").result()
    client.save_state("start", overwrite=True).result()


def test_paths_are_checked(run, local_service):
    client, _ = run
    sampler_path = client.save_weights_for_sampler("s").result().path
    with pytest.raises(ConfigError, match="weights path"):
        local_service.create_training_client_from_state(sampler_path)
    with pytest.raises(ModelNotFoundError, match="save_state"):
        local_service.create_training_client_from_state(f"tinker://{client.model_id}/weights/nope")
    with pytest.raises(ConfigError, match="form"):
        local_service.create_sampling_client(model_path="tinker://just-an-id")


def test_several_live_sampler_snapshots(run, local_service):
    """Off-policy async training samples from older snapshots while the trainer moves on."""
    client, data = run
    prompt = types.ModelInput.from_ints(PROMPT)
    params = types.SamplingParams(max_tokens=8, temperature=1.0, seed=3, stop=[])
    s0 = client.save_weights_and_get_sampling_client()
    alone0 = s0.sample(prompt, 2, params).result()
    step(client, data)
    s1 = client.save_weights_and_get_sampling_client()
    path = client.save_weights_for_sampler("after-1").result().path
    s1_from_disk = client.create_sampling_client(path)
    step(client, data)
    futures = [s.sample(prompt, 2, params) for s in (s0, s1, s1_from_disk)]  # interleaved on one worker
    r0, r1, r1_disk = (f.result() for f in futures)
    assert [s.tokens for s in r0.sequences] == [s.tokens for s in alone0.sequences]
    flat = lambda r: [lp for s in r.sequences for lp in s.logprobs]
    assert [s.tokens for s in r1.sequences] == [s.tokens for s in r1_disk.sequences]
    assert flat(r1) == pytest.approx(flat(r1_disk), abs=1e-5)
    assert flat(r0) != pytest.approx(flat(r1), abs=1e-4)


def test_rest_client_answers_what_the_cookbook_asks(run, local_service):
    """checkpoint_utils reads renderer_name from the run's user metadata; CheckpointManager deletes old states."""
    client, _ = run
    state = client.save_state("a").result().path
    sampler = client.save_weights_for_sampler("b").result().path
    rest = local_service.create_rest_client()
    run_info = rest.get_training_run_by_tinker_path(sampler).result()
    assert run_info.user_metadata == {"renderer_name": "qwen3_instruct"}
    assert (run_info.base_model, run_info.lora_rank, run_info.training_run_id) == ("tiny", 4, client.model_id)
    assert run_info.last_checkpoint.tinker_path == state
    assert run_info.last_sampler_checkpoint.tinker_path == sampler
    listed = {c.tinker_path: c.checkpoint_type for c in rest.list_checkpoints(client.model_id).result().checkpoints}
    assert listed == {state: "training", sampler: "sampler"}
    assert rest.get_weights_info_by_tinker_path(state).result().lora_rank == 4
    asyncio.run(_await(rest.delete_checkpoint_from_tinker_path(state)))
    assert [c.tinker_path for c in rest.list_checkpoints(client.model_id).result().checkpoints] == [sampler]
    other_process_view = LocalRestClient(base_url="ignored", api_key="ignored")
    assert isinstance(other_process_view, LocalRestClient)
    with pytest.raises(AttributeError, match="publish_checkpoint_from_tinker_path is part of the Tinker SDK"):
        rest.publish_checkpoint_from_tinker_path(sampler)


async def _await(future):
    return await future


def test_losses_the_backend_cannot_reproduce_are_refused(run):
    """The cookbook's default stable_reinforce is refused, naming the nearest supported loss."""
    client, data = run
    with pytest.raises(ConfigError, match=r"stable_reinforce.*'cispo'.*'importance_sampling'"):
        client.save_weights_and_get_sampling_client(record_stability_info=True)
    with pytest.raises(ConfigError, match=r"stable_reinforce.*'cispo'.*'importance_sampling'"):
        client.create_sampling_client("tinker://x/sampler_weights/y", record_stability_info=True)
    with pytest.raises(ConfigError, match="'cispo'"):
        client.forward_backward(data, "stable_reinforce").result()


def test_zero_advantage_batches_error_by_default_and_accept_as_the_service(tmp_path):
    def zero_batch(service):
        client = service.create_lora_training_client("tiny", rank=4)
        data = rl_data(client.save_weights_and_get_sampling_client())
        for d in data:
            d.loss_fn_inputs["advantages"] = types.TensorData.from_torch(
                torch.zeros_like(d.loss_fn_inputs["advantages"].to_torch()))
        return client, data

    settings = LocalSettings.from_env({"TINKER_LOCAL_DEVICE": "cpu", "TINKER_LOCAL_STORAGE": str(tmp_path)})
    with LocalServiceClient(settings) as strict:
        client, data = zero_batch(strict)
        with pytest.raises(NoLearningSignalError, match="TINKER_LOCAL_ZERO_ADVANTAGE_BATCHES=accept"):
            client.forward_backward(data, "importance_sampling").result()
    accepting = LocalSettings.from_env({"TINKER_LOCAL_DEVICE": "cpu", "TINKER_LOCAL_STORAGE": str(tmp_path),
                                        "TINKER_LOCAL_ZERO_ADVANTAGE_BATCHES": "accept"})
    with LocalServiceClient(accepting) as lenient:
        client, data = zero_batch(lenient)
        fb, opt = step(client, data)
        assert fb.metrics["loss:sum"] == 0.0 and fb.metrics["num_trained_tokens:sum"] == 0.0
        assert opt.metrics["grad_norm:mean"] == 0.0
    with pytest.raises(ConfigError, match="TINKER_LOCAL_ZERO_ADVANTAGE_BATCHES"):
        LocalSettings.from_env({"TINKER_LOCAL_ZERO_ADVANTAGE_BATCHES": "maybe"})


def test_sdk_shaped_constructor_and_unsupported_calls(tmp_path, monkeypatch):
    """recipes call tinker.ServiceClient(user_metadata, project_id, base_url=..., display_name=...)."""
    monkeypatch.setenv("TINKER_LOCAL_DEVICE", "cpu")
    monkeypatch.setenv("TINKER_LOCAL_STORAGE", str(tmp_path))
    service = SdkLocalServiceClient({"recipe": "x"}, None, base_url=None, display_name="run")
    try:
        assert service.settings.storage_dir == tmp_path
        names = [m.model_name for m in service.get_server_capabilities().supported_models]
        assert names == ["tiny", "tiny-vllm", "tiny-thinking", "smollm2-135m"]
        with pytest.raises(AttributeError, match="get_console_url is part of the Tinker SDK"):
            service.get_console_url  # noqa: B018
        with pytest.raises(AttributeError, match="no attribute 'not_a_method'"):
            service.not_a_method  # noqa: B018
    finally:
        assert service.close().result() is None
