"""The service's edges: paths stay inside the storage, a bad learning rate is refused before it is applied, the
long poll answers the SDK's "try again", hostile bodies are the caller's error, and a tenant's checkpoints are
its own (listing, reading, loading, deleting). Plain HTTP against the app in process (no port, no SDK retries),
so each answer is the server's own."""

from __future__ import annotations

import itertools
import json
from concurrent.futures import Future

import pytest
from tinker import types

from rlrunbook.backend import LocalServiceClient, LocalSettings

KEY_A, KEY_B = "tml-tenant-a-key", "tml-tenant-b-key"
API = "/api/v1"
_SEQ: dict[str, itertools.count] = {}


def next_seq(model_id: str) -> int:
    """The SDK numbers every call of a training client; the server runs them in that order."""
    return next(_SEQ.setdefault(model_id, itertools.count(1)))


@pytest.fixture(scope="module")
def app_storage(tmp_path_factory):
    import torch
    from starlette.testclient import TestClient

    from rlrunbook.service.server import ServeOptions, build_app

    root = tmp_path_factory.mktemp("serve")
    storage = root / "storage"
    service = LocalServiceClient(LocalSettings(device="cpu", dtype=torch.float32, storage_dir=storage))
    app = build_app(service, ServeOptions(api_keys=(KEY_A, KEY_B), storage=storage))
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client, storage, root
    app.app.state.serve.close()


def _post(client, route: str, body, key: str = KEY_A, raw: bytes | None = None):
    content = raw if raw is not None else json.dumps(body).encode()
    return client.post(API + route, content=content, headers={"X-API-Key": key, "content-type": "application/json"})


def _result(client, answer, key: str = KEY_A) -> dict:
    """The outcome of a queued call: polls /retrieve_future until it is not "try again"."""
    assert answer.status_code == 200, answer.text
    rid = answer.json()["request_id"]
    for _ in range(100):
        got = _post(client, "/retrieve_future", {"request_id": rid}, key)
        assert got.status_code == 200, got.text
        if got.json().get("type") != "try_again":
            return got.json()
    raise AssertionError("the call did not finish")


def _model(client, key: str) -> tuple[str, str]:
    """A session and a tiny model of the tenant of ``key``, with one saved state: (model id, its tinker path)."""
    session = _post(client, "/create_session", types.CreateSessionRequest(
        tags=[], user_metadata={}, sdk_version="test").model_dump(mode="json"), key).json()["session_id"]
    create = types.CreateModelRequest(session_id=session, model_seq_id=0, base_model="tiny",
                                      lora_config=types.LoraConfig(rank=4))
    model_id = _result(client, _post(client, "/create_model", create.model_dump(mode="json"), key), key)["model_id"]
    save = types.SaveWeightsRequest(model_id=model_id, path="first", seq_id=next_seq(model_id))
    path = _result(client, _post(client, "/save_weights", save.model_dump(mode="json"), key), key)["path"]
    return model_id, path


@pytest.fixture(scope="module")
def models(app_storage):
    client = app_storage[0]
    return {"a": _model(client, KEY_A), "b": _model(client, KEY_B)}


@pytest.mark.parametrize("path", [
    "tinker://../weights/planted", "tinker://%2e%2e/weights/planted", "tinker://run/weights/..",
    "tinker://run/weights/.hidden", "tinker:///etc/weights/x", "tinker://run/weights/a\u0000b",
    "tinker://run/weights/" + "x" * 300, "tinker://" + "r" * 4000 + "/weights/x",
], ids=["dotdot", "encoded-dotdot", "name-dotdot", "hidden", "absolute", "nul", "long-name", "long-run"])
def test_a_path_that_would_leave_its_folder_is_the_callers_error(app_storage, path):
    client, storage, root = app_storage
    planted = root / "weights" / "planted"  # beside the storage, where `..` would lead
    planted.mkdir(parents=True, exist_ok=True)
    (planted / "adapter_model.safetensors").write_bytes(b"not for you")
    answer = _post(client, "/weights_info", {"tinker_path": path})
    assert answer.status_code in (400, 404), answer.text
    assert str(root) not in answer.text  # no folder of the server is named


def test_a_run_id_that_leaves_the_storage_is_refused_on_every_route(app_storage, tmp_path):
    client, storage, root = app_storage
    outside = tmp_path / "elsewhere"
    (outside / "weights" / "x").mkdir(parents=True)
    (outside / "training_run.json").write_text("{}")
    storage.mkdir(exist_ok=True)
    (storage / "linked").symlink_to(outside)
    for run in ("%2e%2e", "linked", ".hidden"):
        for route in (f"/training_runs/{run}", f"/training_runs/{run}/checkpoints"):
            answer = client.get(API + route, headers={"X-API-Key": KEY_A})
            assert answer.status_code == 400, (route, answer.text)


def test_a_bad_learning_rate_is_refused_in_its_turn_and_changes_nothing(app_storage, models):
    """Each refused step takes its seq_id (the SDK numbered it), fails naming the field, and leaves the weights."""
    import torch

    from rlrunbook.backend.lora import adapter_parameters

    client = app_storage[0]
    model_id = models["a"][0]
    local = client.app.app.state.serve.holdings.models[model_id].client.result()
    before = {name: p.detach().clone() for name, p in adapter_parameters(local._host.model).items()}
    for value in ("NaN", "Infinity", "-1e30", "1e30"):
        raw = (f'{{"model_id": "{model_id}", "seq_id": {next_seq(model_id)}, "type": "optim_step", "optim_params": '
               f'{{"learning_rate": {value}, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12, "weight_decay": 0.0, '
               '"grad_clip_norm": 0.0}}')
        outcome = _result(client, _post(client, "/optim_step", None, raw=raw.encode()))
        assert "AdamParams.learning_rate" in outcome.get("error", ""), (value, outcome)
    after = adapter_parameters(local._host.model)
    assert all(torch.equal(before[name], after[name]) for name in before)
    save = types.SaveWeightsRequest(model_id=model_id, path="after-refusals", seq_id=next_seq(model_id))
    assert "path" in _result(client, _post(client, "/save_weights", save.model_dump(mode="json")))


def test_the_long_poll_answers_the_sdks_try_again(app_storage, monkeypatch):
    from tinker.types.try_again_response import TryAgainResponse

    from rlrunbook.service import routes

    client = app_storage[0]
    serve = client.app.app.state.serve
    monkeypatch.setattr(routes, "LONG_POLL_S", 0.05)
    pending: Future = Future()
    rid = serve.futures.add(pending, lambda value: value, tenant=serve_tenant(KEY_A))
    answer = _post(client, "/retrieve_future", {"request_id": rid})
    assert answer.status_code == 200, answer.text
    parsed = TryAgainResponse.model_validate(answer.json())  # the SDK's own reading of the body
    assert parsed.type == "try_again" and parsed.request_id == rid
    pending.set_result({"ok": True})


def serve_tenant(key: str) -> str:
    from rlrunbook.service.store import tenant_of

    return tenant_of(key)


@pytest.mark.parametrize("raw", [b"[" * 100_000 + b"]" * 100_000, b'{"a":' * 50_000 + b"1" + b"}" * 50_000,
                                 b"\xff\xfe", b'{"request_id": ' + b"9" * 10_000 + b"}"],
                         ids=["nested-lists", "nested-objects", "not-utf8", "huge-number"])
def test_a_hostile_body_is_the_callers_error(app_storage, raw):
    answer = _post(app_storage[0], "/retrieve_future", None, raw=raw)
    assert 400 <= answer.status_code < 500, answer.text[:300]


def test_a_hidden_or_overlong_checkpoint_name_is_refused_and_what_is_acknowledged_lists(app_storage, models):
    client = app_storage[0]
    model_id, path = models["a"]
    for name in (".hidden", "x" * 300, "a/b"):
        save = types.SaveWeightsRequest(model_id=model_id, path=name, seq_id=next_seq(model_id))
        outcome = _result(client, _post(client, "/save_weights", save.model_dump(mode="json")))
        assert "checkpoint name" in outcome.get("error", ""), (name, outcome)
    listed = client.get(f"{API}/training_runs/{model_id}/checkpoints", headers={"X-API-Key": KEY_A})
    assert listed.status_code == 200, listed.text  # the SDK's model id names its run
    paths = {c["tinker_path"] for c in listed.json()["checkpoints"]}
    assert path in paths and not any(("/." in p or "x" * 300 in p) for p in paths)


def test_a_tenants_checkpoints_are_unknown_to_another(app_storage, models):
    client = app_storage[0]
    a_model, a_path = models["a"]
    a_run = a_path.split("/")[2]
    as_b = {"X-API-Key": KEY_B}
    assert client.get(f"{API}/training_runs/{a_run}", headers=as_b).status_code == 404
    assert client.get(f"{API}/training_runs/{a_run}/checkpoints", headers=as_b).status_code == 404
    assert client.get(f"{API}/training_runs/{a_model}/checkpoints", headers=as_b).status_code == 404
    assert _post(client, "/weights_info", {"tinker_path": a_path}, KEY_B).status_code == 404
    runs_b = client.get(f"{API}/training_runs", headers=as_b).json()["training_runs"]
    assert a_run not in {run["training_run_id"] for run in runs_b} and len(runs_b) == 1
    listed_b = client.get(f"{API}/checkpoints", headers=as_b).json()["checkpoints"]
    assert a_path not in {c["tinker_path"] for c in listed_b} and len(listed_b) == 1
    session_b = _post(client, "/create_session", types.CreateSessionRequest(
        tags=[], user_metadata={}, sdk_version="test").model_dump(mode="json"), KEY_B).json()["session_id"]
    sampler = types.CreateSamplingSessionRequest(session_id=session_b, sampling_session_seq_id=0, model_path=a_path)
    assert _post(client, "/create_sampling_session", sampler.model_dump(mode="json"), KEY_B).status_code == 404
    assert client.delete(f"{API}/training_runs/{a_run}/checkpoints/weights/first", headers=as_b).status_code == 404
    assert _post(client, "/weights_info", {"tinker_path": a_path}, KEY_A).status_code == 200


@pytest.mark.parametrize(("headers", "status", "named"), [
    ([("x-api-key", KEY_B), ("x-api-key", KEY_A)], 400, "2 X-API-Key headers"),
    ([("x-api-key", KEY_A), ("content-length", "12abc")], 400, "is not one byte count"),
    ([("x-api-key", KEY_A), ("content-length", "2"), ("content-length", "2")], 400, "is not one byte count"),
    ([("x-api-key", KEY_A)], 200, ""),
])
def test_ambiguous_key_or_length_headers_are_the_callers_error(app_storage, models, headers, status, named):
    """Several keys are not read as the last one (another tenant's), nor a length that is not digits as too long."""
    client = app_storage[0]
    _, path = models["a"]
    body = json.dumps({"tinker_path": path}).encode()
    answer = client.post(API + "/weights_info", content=body,
                         headers=[("content-type", "application/json"), *headers])
    assert answer.status_code == status and named in answer.text, answer.text


def test_weights_info_of_a_checkpoint_name_never_saved_is_unknown(app_storage, models):
    client, _, root = app_storage
    _, path = models["a"]
    missing = path.rsplit("/", 1)[0] + "/never-saved"
    answer = _post(client, "/weights_info", {"tinker_path": missing}, KEY_A)
    assert answer.status_code == 404 and "never-saved" in answer.text and str(root) not in answer.text, answer.text
    assert _post(client, "/weights_info", {"tinker_path": path}, KEY_A).status_code == 200


def test_a_deleted_checkpoint_leaves_the_disk_and_the_listing(app_storage, models):
    client, storage, _ = app_storage
    model_id, _ = models["b"]
    save = types.SaveWeightsRequest(model_id=model_id, path="superseded", seq_id=next_seq(model_id))
    path = _result(client, _post(client, "/save_weights", save.model_dump(mode="json"), KEY_B), KEY_B)["path"]
    run = path.split("/")[2]
    assert (storage / run / "weights" / "superseded").is_dir()
    gone = client.delete(f"{API}/training_runs/{run}/checkpoints/weights/superseded", headers={"X-API-Key": KEY_B})
    assert gone.status_code == 200, gone.text
    assert not (storage / run / "weights" / "superseded").exists()
    listed = client.get(f"{API}/training_runs/{run}/checkpoints", headers={"X-API-Key": KEY_B}).json()
    assert path not in {c["tinker_path"] for c in listed["checkpoints"]}
    ttl = client.put(f"{API}/training_runs/{run}/checkpoints/weights/first/ttl", content=json.dumps(
        {"ttl_seconds": 7200}), headers={"X-API-Key": KEY_B, "content-type": "application/json"})
    assert ttl.status_code == 200, ttl.text
    expires = [c for c in client.get(f"{API}/training_runs/{run}/checkpoints", headers={"X-API-Key": KEY_B})
               .json()["checkpoints"] if c["tinker_path"].endswith("/first")]
    assert expires and expires[0]["expires_at"] is not None


def test_a_tenant_holds_at_most_its_limits_and_another_tenant_is_not_affected(tmp_path):
    """With --max-sessions 2 --max-models 1: the third session and the second model of one key are 429 naming the
    option; a closed session frees its room; the other key still gets its own."""
    import torch
    from starlette.testclient import TestClient

    from rlrunbook.service.server import ServeOptions, build_app

    storage = tmp_path / "storage"
    service = LocalServiceClient(LocalSettings(device="cpu", dtype=torch.float32, storage_dir=storage))
    app = build_app(service, ServeOptions(api_keys=(KEY_A, KEY_B), storage=storage, max_sessions=2, max_models=1))
    session_body = types.CreateSessionRequest(tags=[], user_metadata={}, sdk_version="test").model_dump(mode="json")
    try:
        with TestClient(app, raise_server_exceptions=False) as client:
            first, second = (_post(client, "/create_session", session_body).json()["session_id"] for _ in range(2))
            refused = _post(client, "/create_session", session_body)
            assert refused.status_code == 429 and "--max-sessions 2" in refused.text, refused.text
            assert _post(client, "/create_session", session_body, KEY_B).status_code == 200
            assert client.post(f"{API}/sessions/{second}/finish", headers={"X-API-Key": KEY_A}).status_code == 200
            assert _post(client, "/create_session", session_body).status_code == 200  # the closed one's room
            create = types.CreateModelRequest(session_id=first, model_seq_id=0, base_model="tiny",
                                              lora_config=types.LoraConfig(rank=4))
            assert "model_id" in _result(client, _post(client, "/create_model", create.model_dump(mode="json")))
            again = _post(client, "/create_model", create.model_copy(update={"model_seq_id": 1}).model_dump(
                mode="json"))
            assert again.status_code == 429 and "--max-models 1" in again.text, again.text
    finally:
        app.app.state.serve.close()
