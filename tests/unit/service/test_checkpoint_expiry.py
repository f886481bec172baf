"""The TTL the SDK sets (at save, or later with ``PUT .../ttl``) is enforced: once it passes, the server's sweep
removes the checkpoint's folder (adapter and optimizer state) from disk, listings no longer show it, loading it
answers that it is not there, and its model no longer names it as its last saved state; checkpoints without a
TTL, or whose TTL has not passed, stay. The clock is faked (``ServeState.remove_expired_checkpoints(now)``);
the SDK's calls are plain HTTP against the app in process."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone

import pytest
from tinker import types

from rlrunbook.backend import LocalServiceClient, LocalSettings

KEY = "tml-expiry-key-0001"
API = "/api/v1"
HOUR = 3600


@pytest.fixture
def app(tmp_path):
    import torch
    from starlette.testclient import TestClient

    from rlrunbook.service.server import ServeOptions, build_app

    storage = tmp_path / "storage"
    service = LocalServiceClient(LocalSettings(device="cpu", dtype=torch.float32, storage_dir=storage))
    built = build_app(service, ServeOptions(api_keys=(KEY,), storage=storage))
    with TestClient(built, raise_server_exceptions=False) as client:
        yield client, built.app.state.serve, storage
    built.app.state.serve.close()


def _post(client, route: str, body: dict):
    return client.post(API + route, content=json.dumps(body).encode(),
                       headers={"X-API-Key": KEY, "content-type": "application/json"})


def _result(client, answer) -> dict:
    assert answer.status_code == 200, answer.text
    rid = answer.json()["request_id"]
    for _ in range(200):
        got = _post(client, "/retrieve_future", {"request_id": rid})
        assert got.status_code == 200, got.text
        if got.json().get("type") != "try_again":
            return got.json()
    raise AssertionError("the call did not finish")


def _listed(client, run: str) -> set[str]:
    answer = client.get(f"{API}/training_runs/{run}/checkpoints", headers={"X-API-Key": KEY})
    assert answer.status_code == 200, answer.text
    return {c["checkpoint_id"] for c in answer.json()["checkpoints"]}


def _model(client) -> str:
    """A new session's first training model (tiny, LoRA rank 4): its id."""
    session = _post(client, "/create_session", types.CreateSessionRequest(
        tags=[], user_metadata={}, sdk_version="test").model_dump(mode="json")).json()["session_id"]
    return _result(client, _post(client, "/create_model", types.CreateModelRequest(
        session_id=session, model_seq_id=0, base_model="tiny", lora_config=types.LoraConfig(rank=4))
        .model_dump(mode="json")))["model_id"]


def test_checkpoints_whose_ttl_passed_are_removed_from_disk_and_listings(app):
    client, serve, storage = app
    model = _model(client)
    local = serve.holdings.models[model].client.result()  # one step first, so a save holds AdamW state too
    datum = types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3]),
                        loss_fn_inputs={"target_tokens": types.TensorData(data=[2, 3, 4], dtype="int64"),
                                        "weights": types.TensorData(data=[1.0] * 3, dtype="float32")})
    local.forward_backward([datum], "cross_entropy").result()
    local.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    seq = iter(range(1, 100))
    saves = [("/save_weights", types.SaveWeightsRequest(model_id=model, path="kept", seq_id=next(seq))),
             ("/save_weights_for_sampler", types.SaveWeightsForSamplerRequest(
                 model_id=model, path="samp", seq_id=next(seq), ttl_seconds=2 * HOUR)),
             ("/save_weights", types.SaveWeightsRequest(model_id=model, path="later-ttl", seq_id=next(seq))),
             ("/save_weights", types.SaveWeightsRequest(model_id=model, path="short", seq_id=next(seq),
                                                        ttl_seconds=HOUR))]
    paths = {}
    for route, request in saves:
        paths[request.path] = _result(client, _post(client, route, request.model_dump(mode="json")))["path"]
    run = paths["kept"].split("/")[2]
    put = client.put(f"{API}/training_runs/{run}/checkpoints/weights/later-ttl/ttl", content=b'{"ttl_seconds": 3600}',
                     headers={"X-API-Key": KEY, "content-type": "application/json"})
    assert put.status_code == 200, put.text
    folders = {name: storage / run / ("sampler_weights" if name == "samp" else "weights") / name for name in paths}
    assert {p.name for p in folders["short"].iterdir()} >= {"adapter_model.safetensors", "optimizer.pt"}
    assert serve.holdings.models[model].last_saved == paths["short"]
    now = datetime.now(timezone.utc)

    assert serve.remove_expired_checkpoints(now + timedelta(seconds=HOUR - 60)) == []
    assert all(folder.is_dir() for folder in folders.values())

    removed = serve.remove_expired_checkpoints(now + timedelta(seconds=HOUR + 60))
    assert sorted(removed) == sorted([paths["short"], paths["later-ttl"]])
    assert not folders["short"].exists() and not folders["later-ttl"].exists()
    assert not [p for p in (storage / run / "weights").iterdir() if p.name.startswith(".")]  # nothing left hidden
    assert _listed(client, run) == {"weights/kept", "sampler_weights/samp"}
    listed = client.get(f"{API}/checkpoints", headers={"X-API-Key": KEY}).json()["checkpoints"]
    assert {c["tinker_path"] for c in listed} == {paths["kept"], paths["samp"]}
    assert serve.holdings.models[model].last_saved is None  # its record no longer names the removed state
    assert [row["last_saved"] for row in serve.store.models() if row["model_id"] == model] == [None]
    load = _result(client, _post(client, "/load_weights", types.LoadWeightsRequest(
        model_id=model, path=paths["short"], seq_id=next(seq), optimizer=False).model_dump(mode="json")))
    assert "no checkpoint at" in load["error"] and load["category"] == "user"

    assert serve.remove_expired_checkpoints(now + timedelta(seconds=2 * HOUR + 60)) == [paths["samp"]]
    assert _listed(client, run) == {"weights/kept"} and folders["kept"].is_dir()
    assert serve.remove_expired_checkpoints(now + timedelta(days=3650)) == []  # no TTL: never removed


def test_a_deleted_checkpoint_leaves_disk_and_its_models_record(app):
    client, serve, storage = app
    model = _model(client)
    path = _result(client, _post(client, "/save_weights", types.SaveWeightsRequest(
        model_id=model, path="gone", seq_id=1).model_dump(mode="json")))["path"]
    run = path.split("/")[2]
    answer = client.delete(f"{API}/training_runs/{model}/checkpoints/weights/gone", headers={"X-API-Key": KEY})
    assert answer.status_code == 200, answer.text
    assert not (storage / run / "weights" / "gone").exists() and _listed(client, run) == set()
    assert serve.holdings.models[model].last_saved is None
    assert [row["last_saved"] for row in serve.store.models() if row["model_id"] == model] == [None]


def test_the_servers_sweep_looks_for_expired_checkpoints_on_its_own_period():
    """``rlrunbook serve``'s sweep loop removes expired checkpoints and drops delivered results from the store
    every ``checkpoint_period_s`` (sessions every ``period_s``), and goes on after a failure."""
    import asyncio

    from rlrunbook.service.server import expire_sessions
    from rlrunbook.service.sessions import Swept

    class Counting:
        session_timeout_s = 1.0

        def __init__(self):
            self.sweeps = self.checkpoint_sweeps = self.result_sweeps = 0

        def drop_old_results(self):
            self.result_sweeps += 1
            if self.result_sweeps == 2:
                raise OSError("the store is busy: logged, and the next sweep comes")
            return 0

        def sweep(self):
            self.sweeps += 1
            return Swept([], 0, 0)

        def remove_expired_checkpoints(self):
            self.checkpoint_sweeps += 1
            if self.checkpoint_sweeps == 1:
                raise OSError("a disk error: logged, and the next sweep comes")
            return []

    state = Counting()

    async def run():
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(expire_sessions(state, 0.01, checkpoint_period_s=0.1), 0.55)

    asyncio.run(run())
    assert state.sweeps >= 20 and 4 <= state.checkpoint_sweeps <= 7
    assert state.result_sweeps == state.checkpoint_sweeps


def test_delivered_results_leave_the_store_while_the_server_runs(app):
    """A result delivered more than 10 minutes ago leaves ``serve.sqlite3`` at the next sweep, not only at the next
    start; one delivered just now stays (the SDK may poll again if a reply was lost)."""
    import time

    from rlrunbook.service.store import KEEP_DELIVERED_S

    client, serve, _storage = app
    session = _post(client, "/create_session", types.CreateSessionRequest(
        tags=[], user_metadata={}, sdk_version="test").model_dump(mode="json")).json()["session_id"]
    rids = []
    for seq in range(2):
        create = types.CreateModelRequest(session_id=session, model_seq_id=seq, base_model="tiny",
                                          lora_config=types.LoraConfig(rank=4))
        rid = _post(client, "/create_model", create.model_dump(mode="json")).json()["request_id"]
        assert _post(client, "/retrieve_future", {"request_id": rid}).status_code == 200
        rids.append(rid)
    serve.store._write("UPDATE futures SET delivered=? WHERE request_id=?",
                       (time.time() - KEEP_DELIVERED_S - 1, rids[0]))
    assert serve.drop_old_results() == 1
    assert serve.store.future(rids[0]) is None and serve.store.future(rids[1]) is not None
