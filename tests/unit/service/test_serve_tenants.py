"""``rlrunbook serve`` with several clients: each its own adapter over one resident base model, served in turn,
tenants kept apart by their keys, sessions that stop their heartbeats released. The unmodified Tinker SDK
drives every case (its low-level client where a case needs an id of another tenant).
"""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest
import tinker
from tinker import types
from tinker._client import AsyncTinker

from rlrunbook.testing.serve import start_server

pytestmark = pytest.mark.slow

KEY_A = "tml-tenant-a-key-0001"
KEY_B = "tml-tenant-b-key-0002"


def _datum(tokens: list[int]) -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": types.TensorData(data=tokens[1:], dtype="int64"),
                                       "weights": types.TensorData(data=[1.0] * (len(tokens) - 1), dtype="float32")})


DATA = [_datum([1, 2, 3, 4, 5, 6]), _datum([9, 8, 7, 6])]
LONG = [_datum([(5 * i + j) % 200 + 3 for j in range(1000)]) for i in range(8)]  # ~1 s: the SDK sends the 8
# calls ~0.06 s apart, so each must take far longer than that for them all to be queued at once
PROMPT = types.ModelInput.from_ints([3, 1, 4, 1, 5])
PARAMS = types.SamplingParams(max_tokens=6, seed=5, temperature=1.0)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    running = start_server(tmp_path_factory.mktemp("serve-tenants"), "--api-key", KEY_A, "--api-key", KEY_B)
    yield running
    running.stop()
    assert KEY_A not in running.output and KEY_B not in running.output


@pytest.fixture(autouse=True)
def _no_telemetry(monkeypatch):
    monkeypatch.setenv("TINKER_TELEMETRY", "0")


def _status(server, key: str) -> dict:
    return httpx.get(f"{server.url}/api/v1/rlrunbook/status", headers={"X-API-Key": key}, timeout=60).json()


def _train(service, seed: int, steps: int = 3) -> dict:
    """A few steps of one client, and a snapshot's samples: what must not depend on who else is served."""
    training = service.create_lora_training_client(base_model="tiny", rank=4, seed=seed).result()
    losses = []
    for _ in range(steps):
        losses.append(training.forward_backward(DATA, "cross_entropy").result().metrics["loss:sum"])
        training.optim_step(types.AdamParams(learning_rate=2e-2)).result()
    sampler = training.save_weights_and_get_sampling_client().result()
    samples = sampler.sample(PROMPT, 2, PARAMS).result()
    return {"losses": losses, "tokens": [s.tokens for s in samples.sequences],
            "logprobs": [s.logprobs for s in samples.sequences]}


def test_two_clients_at_once_each_train_as_alone_over_one_base_model(server):
    alone = [_train(tinker.ServiceClient(base_url=server.url, api_key=KEY_A), seed) for seed in (1, 2)]
    together: list[dict | None] = [None, None]

    def run(index: int, seed: int) -> None:
        together[index] = _train(tinker.ServiceClient(base_url=server.url, api_key=KEY_A), seed)

    threads = [threading.Thread(target=run, args=(i, seed)) for i, seed in enumerate((1, 2))]
    [thread.start() for thread in threads]
    [thread.join(timeout=600) for thread in threads]
    assert together == alone  # the same bits: own adapters, own optimizers, seeds of their own
    assert alone[0]["losses"] != alone[1]["losses"]  # and the two runs are not the same run
    status = _status(server, KEY_A)
    assert [r["base_model"] for r in status["resident"]] == ["tiny"]  # one copy of the base, four clients over it
    live = [m for m in status["models"] if m["status"] == "live" and "memory_bytes" in m]
    assert len(live) >= 4
    adapter = live[0]["memory_bytes"]["adapter"]
    assert all(m["memory_bytes"]["adapter"] == adapter for m in live)
    # AdamW: two moments per weight, and a step count per tensor.
    assert all(2 * adapter < m["memory_bytes"]["optimizer"] < 2.1 * adapter for m in live)


def test_one_clients_queue_does_not_hold_back_anothers_call(server):
    busy = tinker.ServiceClient(base_url=server.url, api_key=KEY_A).create_lora_training_client(
        base_model="tiny", rank=4, seed=3).result()
    other = tinker.ServiceClient(base_url=server.url, api_key=KEY_A).create_lora_training_client(
        base_model="tiny", rank=4, seed=4).result()
    queued = [busy.forward_backward(LONG, "cross_entropy") for _ in range(8)]
    deadline = time.monotonic() + 120
    while sum(m["pending_calls"] for m in _status(server, KEY_A)["models"] if m["model_id"] == busy.model_id) < 6:
        assert time.monotonic() < deadline, "the long calls never queued"
        time.sleep(0.02)
    other.forward_backward(DATA, "cross_entropy").result(timeout=300)
    waiting = sum(not future.future().done() for future in queued)
    # Served in turn: the other client's call waited for at most the busy client's running call and its next,
    # not for its whole queue (first come, first served would leave none of the eight waiting).
    assert waiting >= 5, f"{waiting} of the busy client's 8 calls were still queued"
    [future.result(timeout=600) for future in queued]


def test_a_tenant_cannot_reach_another_tenants_ids(server):
    service_a = tinker.ServiceClient(base_url=server.url, api_key=KEY_A)
    training = service_a.create_lora_training_client(base_model="tiny", rank=4, seed=5).result()
    before = training.forward(DATA, "cross_entropy").result()
    handle = training.save_weights_and_get_sampling_client().result().get_sampler_handle()
    session_id = training.model_id.split(":train:")[0]
    # A sampler handed over (the handle carries no key) samples for its own tenant only.
    assert tinker.SamplingClient.from_sampler_handle(handle, api_key=KEY_A).sample(PROMPT, 1, PARAMS).result()
    with pytest.raises(tinker.NotFoundError, match="no sampling session"):
        tinker.SamplingClient.from_sampler_handle(handle, api_key=KEY_B).sample(PROMPT, 1, PARAMS).result()

    async def a_request_id() -> str:
        """A request id of tenant A (the high-level clients keep theirs to themselves): a model it creates."""
        client = AsyncTinker(api_key=KEY_A, base_url=server.url, max_retries=0)
        created = await client.models.create(request=types.CreateModelRequest(
            session_id=session_id, model_seq_id=1000, base_model="tiny", lora_config=types.LoraConfig(rank=4)))
        await client.close()
        return created.request_id

    request_id = asyncio.run(a_request_id())

    async def as_b() -> list[str]:
        client = AsyncTinker(api_key=KEY_B, base_url=server.url, max_retries=0)
        refused = []
        # A heartbeat of another key's session answers as one of an id never made: 410, which stops the SDK's loop.
        gone = []
        for sid in (session_id, "session-never-made-here"):
            with pytest.raises(tinker.APIStatusError) as caught:
                await client.service.session_heartbeat(session_id=sid)
            assert caught.value.status_code == 410
            gone.append(str(caught.value).replace(sid, "<id>"))
        assert gone[0] == gone[1], gone
        calls = [
            client.futures.retrieve(request=types.FutureRetrieveRequest(request_id=request_id)),
            client.training.forward_backward(request=types.ForwardBackwardRequest(
                forward_backward_input=types.ForwardBackwardInput(data=DATA, loss_fn="cross_entropy"),
                model_id=training.model_id, seq_id=99)),
            client.training.optim_step(request=types.OptimStepRequest(
                adam_params=types.AdamParams(learning_rate=1.0), model_id=training.model_id, seq_id=100)),
        ]
        for call in calls:
            with pytest.raises(tinker.NotFoundError) as caught:
                await call
            refused.append(str(caught.value))
        await client.close()
        return refused

    refused = asyncio.run(as_b())
    assert all("no " in message for message in refused), refused
    # Tenant A's model is untouched by B's attempts; B's status lists nothing of A's.
    assert training.forward(DATA, "cross_entropy").result().metrics == before.metrics
    assert training.model_id not in {m["model_id"] for m in _status(server, KEY_B)["models"]}


def test_a_session_whose_heartbeats_stop_is_released_and_its_checkpoints_stay(tmp_path):
    server = start_server(tmp_path / "storage", "--api-key", KEY_A, "--session-timeout", "3")
    try:
        service = tinker.ServiceClient(base_url=server.url, api_key=KEY_A)
        training = service.create_lora_training_client(base_model="tiny", rank=4, seed=6).result()
        training.forward_backward(DATA, "cross_entropy").result()
        training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        saved = training.save_state("kept").result().path
        loss = training.forward(DATA, "cross_entropy").result().metrics["loss:sum"]
        assert _status(server, KEY_A)["models"][0]["memory_bytes"]["optimizer"] > 0
        # Every request of the session shows its client alive; the SDK's heartbeats come every 10 s. After 3 s
        # of silence (as when the client's process dies) the server ends the session.
        deadline = time.monotonic() + 60
        while _status(server, KEY_A)["sessions"][0]["status"] == "active":
            assert time.monotonic() < deadline, "the session never expired"
            time.sleep(0.2)
        model = _status(server, KEY_A)["models"][0]
        assert model["status"] == "released" and "memory_bytes" not in model
        assert "expired (no heartbeat for 3 s); its models were released" in server.output
        with pytest.raises(tinker.NotFoundError, match="released: session .* expired: no heartbeat for 3 s"):
            training.forward(DATA, "cross_entropy").result()
        fresh = tinker.ServiceClient(base_url=server.url, api_key=KEY_A)
        again = fresh.create_training_client_from_state(saved).result()
        assert again.forward(DATA, "cross_entropy").result().metrics["loss:sum"] == loss
    finally:
        server.stop()
