"""Idle sessions end in one sweep with one garbage collection, and ended sessions are forgotten (memory and the
SQLite rows) after the grace period, while the runs their models made stay their tenant's. The sweep is driven
with a fake clock (``ServeState.sweep(now)``, ``now`` on ``time.monotonic()``'s clock); the SDK's calls are plain
HTTP against the app in process, so each answer is the server's own."""

from __future__ import annotations

import gc
import json
import sqlite3
import time

import pytest
from tinker import types

from rlrunbook.backend import LocalServiceClient, LocalSettings

KEY_A, KEY_B = "tml-forget-a-key", "tml-forget-b-key"
API = "/api/v1"
TIMEOUT_S, FORGET_S = 300.0, 3600.0
SESSIONS, WITH_MODELS = 30, 3


@pytest.fixture
def app(tmp_path):
    import torch
    from starlette.testclient import TestClient

    from rlrunbook.service.server import ServeOptions, build_app

    storage = tmp_path / "storage"
    service = LocalServiceClient(LocalSettings(device="cpu", dtype=torch.float32, storage_dir=storage))
    built = build_app(service, ServeOptions(api_keys=(KEY_A, KEY_B), storage=storage, session_timeout_s=TIMEOUT_S,
                                            forget_after_s=FORGET_S, max_sessions=100))
    with TestClient(built, raise_server_exceptions=False) as client:
        yield client, built.app.state.serve, storage
    built.app.state.serve.close()


def _post(client, route: str, body: dict, key: str = KEY_A):
    return client.post(API + route, content=json.dumps(body).encode(),
                       headers={"X-API-Key": key, "content-type": "application/json"})


def _result(client, answer, key: str = KEY_A) -> dict:
    assert answer.status_code == 200, answer.text
    rid = answer.json()["request_id"]
    for _ in range(200):
        got = _post(client, "/retrieve_future", {"request_id": rid}, key)
        assert got.status_code == 200, got.text
        if got.json().get("type") != "try_again":
            return got.json()
    raise AssertionError("the call did not finish")


def _session(client, key: str = KEY_A) -> str:
    body = types.CreateSessionRequest(tags=[], user_metadata={}, sdk_version="test").model_dump(mode="json")
    answer = _post(client, "/create_session", body, key)
    assert answer.status_code == 200, answer.text
    return answer.json()["session_id"]


def _rows(storage, table: str) -> int:
    with sqlite3.connect(storage / "serve.sqlite3") as db:
        return db.execute(f"SELECT count(*) FROM {table}").fetchone()[0]


class CountedCollect:
    """``gc.collect`` counting its calls: the sweep's collections."""

    def __init__(self):
        self.calls = 0

    def __call__(self):
        self.calls += 1
        return gc.collect()


def test_idle_sessions_end_in_one_sweep_with_one_collection_and_are_forgotten_after_the_grace(app):
    client, serve, storage = app
    sessions = [_session(client) for _ in range(SESSIONS)]
    models = []
    for session in sessions[:WITH_MODELS]:
        create = types.CreateModelRequest(session_id=session, model_seq_id=0, base_model="tiny",
                                          lora_config=types.LoraConfig(rank=4))
        models.append(_result(client, _post(client, "/create_model", create.model_dump(mode="json")))["model_id"])
    save = types.SaveWeightsRequest(model_id=models[0], path="kept", seq_id=1)
    saved = _result(client, _post(client, "/save_weights", save.model_dump(mode="json")))["path"]
    sampler = _post(client, "/create_sampling_session", types.CreateSamplingSessionRequest(
        session_id=sessions[1], sampling_session_seq_id=0, base_model="tiny").model_dump(mode="json"))
    assert sampler.status_code == 200, sampler.text
    sampler_id = sampler.json()["sampling_session_id"]
    request_id = _post(client, "/optim_step", types.OptimStepRequest(
        model_id=models[2], seq_id=1, optim_params=types.AdamParams(learning_rate=1e-4)).model_dump(mode="json"))
    _result(client, request_id)
    request_id = request_id.json()["request_id"]
    live = _session(client)  # stays active: its heartbeat is renewed at the fake clock's time
    collect = CountedCollect()
    serve.sessions.collect = collect

    now = time.monotonic() + TIMEOUT_S + 1
    serve.holdings.sessions[live].last_heartbeat = now
    started = time.perf_counter()
    swept = serve.sweep(now)
    took = time.perf_counter() - started
    assert sorted(swept.expired) == sorted(sessions)
    assert (swept.collections, collect.calls, swept.forgotten) == (1, 1, 0)
    assert took < 10, f"{SESSIONS} sessions took {took:.1f} s to expire"
    print(f"{SESSIONS} sessions ({WITH_MODELS} with a model) expired in {took:.2f} s, one collection")
    assert all(serve.holdings.models[m].client is None for m in models)  # released

    # Within the grace period an ended session's ids answer why it ended.
    assert _post(client, "/session_heartbeat", {"session_id": sessions[0]}).status_code == 410
    info = _post(client, "/get_info", {"model_id": models[0]})
    assert info.status_code == 404 and "expired" in info.json()["detail"]
    assert serve.sweep(now + FORGET_S - 1).forgotten == 0

    # A sweep that ends only sessions without models runs no collection.
    idle = _session(client)
    quiet = serve.sweep(serve.holdings.sessions[idle].last_heartbeat + TIMEOUT_S + 1)
    assert (quiet.expired, quiet.collections) == ([idle], 0)

    # a millisecond past the 30 sessions' grace period ((now + FORGET_S) - now may round below it), and before the
    # idle session's, which ended at least a sweep and a few requests later
    forgotten = serve.sweep(now + FORGET_S + 1e-3)
    assert forgotten.forgotten == SESSIONS
    held = serve.holdings
    assert set(held.sessions) == {live, idle} and not held.models and not held.samplers
    assert (_rows(storage, "sessions"), _rows(storage, "models"), _rows(storage, "samplers")) == (2, 0, 0)
    assert _rows(storage, "futures") == 0  # the request ids of the forgotten models went with them
    assert collect.calls == 1  # forgetting collects nothing: the memory went at expiry

    # The SDK's calls of what was forgotten answer 4xx in the SDK's shape ({"detail": ...}), never 5xx.
    calls = [
        ("POST", "/session_heartbeat", {"session_id": sessions[0]}),
        ("POST", f"/sessions/{sessions[0]}/finish", {}),
        ("POST", "/create_model", types.CreateModelRequest(session_id=sessions[5], model_seq_id=0, base_model="tiny")
         .model_dump(mode="json")),
        ("POST", "/create_sampling_session", types.CreateSamplingSessionRequest(
            session_id=sessions[5], sampling_session_seq_id=0, base_model="tiny").model_dump(mode="json")),
        ("POST", "/get_info", {"model_id": models[0]}),
        ("POST", "/optim_step", types.OptimStepRequest(model_id=models[0], seq_id=2, optim_params=types.AdamParams(
            learning_rate=1e-4)).model_dump(mode="json")),
        ("POST", "/save_weights", types.SaveWeightsRequest(model_id=models[0], path="x", seq_id=2)
         .model_dump(mode="json")),
        ("POST", "/asample", types.SampleRequest(
            sampling_session_id=sampler_id, seq_id=1, num_samples=1, prompt=types.ModelInput.from_ints([1, 2]),
            sampling_params=types.SamplingParams(max_tokens=2)).model_dump(mode="json")),
        ("GET", f"/samplers/{sampler_id}", None),
        ("POST", "/retrieve_future", {"request_id": request_id}),
    ]
    for method, route, body in calls:
        answer = (_post(client, route, body) if method == "POST"
                  else client.get(API + route, headers={"X-API-Key": KEY_A}))
        assert 400 <= answer.status_code < 500, (route, answer.status_code, answer.text)
        assert answer.json()["detail"], route
    # A heartbeat of a forgotten session is 410, which stops the SDK's heartbeat loop (it retries a 404).
    assert _post(client, "/session_heartbeat", {"session_id": sessions[0]}).status_code == 410
    # Another key's live session answers the same, and is not kept alive by it.
    seen = serve.holdings.sessions[live].last_heartbeat
    assert _post(client, "/session_heartbeat", {"session_id": live}, KEY_B).status_code == 410
    assert serve.holdings.sessions[live].last_heartbeat == seen

    # The run a forgotten model made is still its tenant's: listed and read by A, unknown to B.
    run = saved.split("/")[2]
    assert _post(client, "/weights_info", {"tinker_path": saved}).status_code == 200
    assert _post(client, "/weights_info", {"tinker_path": saved}, KEY_B).status_code == 404
    listed_b = client.get(API + "/training_runs", headers={"X-API-Key": KEY_B}).json()
    assert run not in json.dumps(listed_b)
    listed_a = client.get(API + "/checkpoints", headers={"X-API-Key": KEY_A}).json()
    assert saved in json.dumps(listed_a)


def test_a_client_waiting_on_its_call_is_alive_however_long_the_call(app):
    """A long poll of ``retrieve_future`` keeps its session from an idle sweep (the SDK's heartbeats come every
    10 s; a call may run longer than a short --session-timeout), and renews its heartbeat when it ends."""
    client, serve, _ = app
    session = _session(client)
    create = types.CreateModelRequest(session_id=session, model_seq_id=0, base_model="tiny",
                                      lora_config=types.LoraConfig(rank=4))
    model_id = _result(client, _post(client, "/create_model", create.model_dump(mode="json")))["model_id"]
    record = serve.holdings.sessions[session]
    late = time.monotonic() + 10 * TIMEOUT_S
    with serve.holdings.polling(model_id):
        assert serve.sweep(late).expired == []
        assert record.status == "active"
    assert record.last_heartbeat >= time.monotonic() - 60  # renewed as the poll ended
    assert serve.sweep(record.last_heartbeat + 2 * TIMEOUT_S).expired == [session]
