"""``--max-stored-bytes``: a save that would take one key's checkpoints past the limit answers 429 naming the
option (not retried by the SDK: waiting makes no room), writes nothing, and takes its ``seq_id`` so the client's
next call runs at once; deleting a checkpoint makes room; another key's saves are not affected. Plain HTTP
against the app in process, two keys."""

from __future__ import annotations

import json

import pytest
from tinker import types

from rlrunbook.backend import LocalServiceClient, LocalSettings

KEY_A, KEY_B = "tml-stored-a-key", "tml-stored-b-key"
API = "/api/v1"


@pytest.fixture
def app(tmp_path):
    import torch
    from starlette.testclient import TestClient

    from rlrunbook.service.server import ServeOptions, build_app

    storage = tmp_path / "storage"
    service = LocalServiceClient(LocalSettings(device="cpu", dtype=torch.float32, storage_dir=storage))
    built = build_app(service, ServeOptions(api_keys=(KEY_A, KEY_B), storage=storage))
    with TestClient(built, raise_server_exceptions=False) as client:
        yield client, built.app.state.serve, storage
    built.app.state.serve.close()


def _post(client, route: str, body: dict, key: str):
    return client.post(API + route, content=json.dumps(body).encode(),
                       headers={"X-API-Key": key, "content-type": "application/json"})


def _poll_once(client, answer, key: str) -> dict:
    """The outcome of a queued call within one long poll (25 s): a call stuck behind a missing seq_id is not."""
    assert answer.status_code == 200, answer.text
    got = _post(client, "/retrieve_future", {"request_id": answer.json()["request_id"]}, key)
    assert got.status_code == 200 and got.json().get("type") != "try_again", got.text
    return got.json()


def _model(client, key: str) -> str:
    session = _post(client, "/create_session", types.CreateSessionRequest(
        tags=[], user_metadata={}, sdk_version="test").model_dump(mode="json"), key).json()["session_id"]
    return _poll_once(client, _post(client, "/create_model", types.CreateModelRequest(
        session_id=session, model_seq_id=0, base_model="tiny", lora_config=types.LoraConfig(rank=4))
        .model_dump(mode="json"), key), key)["model_id"]


def _save(client, model: str, name: str, seq_id: int, key: str):
    return _post(client, "/save_weights", types.SaveWeightsRequest(model_id=model, path=name, seq_id=seq_id)
                 .model_dump(mode="json"), key)


def test_a_save_past_the_keys_stored_bytes_is_refused_until_a_delete_makes_room(app):
    from rlrunbook.service.holdings import TenantLimits
    from rlrunbook.service.store import tenant_of

    client, serve, storage = app
    model_a, model_b = _model(client, KEY_A), _model(client, KEY_B)
    first = _poll_once(client, _save(client, model_a, "one", 1, KEY_A), KEY_A)["path"]
    size = serve.stored_bytes(tenant_of(KEY_A))
    assert size > 0
    serve.holdings.limits = TenantLimits(stored_bytes=2 * size + size // 2)  # room for two checkpoints, not three

    _poll_once(client, _save(client, model_a, "two", 2, KEY_A), KEY_A)
    refused = _save(client, model_a, "three", 3, KEY_A)
    assert refused.status_code == 429, refused.text
    assert "--max-stored-bytes" in refused.json()["detail"] and refused.headers["x-should-retry"] == "false"
    run = first.split("/")[2]
    assert not (storage / run / "weights" / "three").exists()
    assert serve.stored_bytes(tenant_of(KEY_A)) == 2 * size

    # Another key's checkpoints are its own account.
    _poll_once(client, _save(client, model_b, "b-one", 1, KEY_B), KEY_B)

    # Deleting one makes room; the next call (seq_id 4) runs at once: the refused one took seq_id 3.
    deleted = client.delete(f"{API}/training_runs/{run}/checkpoints/weights/one", headers={"X-API-Key": KEY_A})
    assert deleted.status_code == 200, deleted.text
    saved = _poll_once(client, _save(client, model_a, "three", 4, KEY_A), KEY_A)
    assert saved["path"].endswith("/weights/three") and (storage / run / "weights" / "three").is_dir()
    assert serve.stored_bytes(tenant_of(KEY_A)) == 2 * size


def test_saves_still_queued_count_toward_the_limit_until_they_are_done(app):
    """Two saves queued behind a call not yet sent: the first is admitted and holds its expected bytes, so the
    second is refused though nothing new is on disk yet; once the first is done its bytes are on disk and no longer
    held twice."""
    from rlrunbook.service.holdings import TenantLimits
    from rlrunbook.service.store import tenant_of

    client, serve, _storage = app
    tenant = tenant_of(KEY_A)
    model = _model(client, KEY_A)
    _poll_once(client, _save(client, model, "one", 1, KEY_A), KEY_A)
    size = serve.stored_bytes(tenant)
    serve.holdings.limits = TenantLimits(stored_bytes=2 * size + size // 2)  # room for one more, not two

    queued = _save(client, model, "two", 3, KEY_A)  # waits for seq_id 2
    assert queued.status_code == 200, queued.text
    refused = _save(client, model, "three", 4, KEY_A)
    assert refused.status_code == 429, refused.text
    assert "still queued about" in refused.json()["detail"]
    assert serve.stored_bytes(tenant) == size  # nothing written by either

    step = types.OptimStepRequest(model_id=model, seq_id=2, adam_params=types.AdamParams(learning_rate=0.0))
    _poll_once(client, _post(client, "/optim_step", step.model_dump(mode="json"), KEY_A), KEY_A)
    assert _poll_once(client, queued, KEY_A)["path"].endswith("/weights/two")
    assert serve.stored_bytes(tenant) == 2 * size and serve._queued_save_bytes[tenant] == 0
