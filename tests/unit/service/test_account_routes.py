"""The SDK's account routes on ``rlrunbook serve``: session search, projects, checkpoint storage usage, the key
check of ``tinker auth login``; the routes it cannot serve refused as the caller's error naming why; compressed
bodies refused; a model an earlier server made counts toward ``--max-models`` only once it holds weights again.
Plain HTTP against the app in process with two keys, each answer read with the SDK's own response type."""

from __future__ import annotations

import itertools
import json
from datetime import datetime

import pytest
from tinker import types

from rlrunbook.backend import LocalServiceClient, LocalSettings
from rlrunbook.service.routes import NOT_OFFERED
from rlrunbook.service.store import tenant_of

KEY_A, KEY_B = "tml-account-a-key", "tml-account-b-key"
API = "/api/v1"


def _app(storage, **options):
    import torch

    from rlrunbook.service.server import ServeOptions, build_app

    service = LocalServiceClient(LocalSettings(device="cpu", dtype=torch.float32, storage_dir=storage))
    return build_app(service, ServeOptions(api_keys=(KEY_A, KEY_B), storage=storage, **options))


@pytest.fixture
def app(tmp_path):
    from starlette.testclient import TestClient

    built = _app(tmp_path / "storage")
    with TestClient(built, raise_server_exceptions=False) as client:
        yield client, built.app.state.serve
    built.app.state.serve.close()


def _post(client, route: str, body, key: str = KEY_A):
    return client.post(API + route, content=json.dumps(body).encode(),
                       headers={"X-API-Key": key, "content-type": "application/json"})


def _session(client, key: str = KEY_A, **fields) -> str:
    request = types.CreateSessionRequest(tags=[], user_metadata=fields.pop("user_metadata", {}), sdk_version="test",
                                         **fields)
    answer = _post(client, "/create_session", request.model_dump(mode="json"), key)
    assert answer.status_code == 200, answer.text
    return answer.json()["session_id"]


def _search(client, key: str = KEY_A, **fields) -> types.SessionSearchResponse:
    request = types.SessionSearchRequest(**fields)
    answer = _post(client, "/sessions/search", request.model_dump(mode="json", exclude_none=True), key)
    assert answer.status_code == 200, answer.text
    return types.SessionSearchResponse.model_validate(answer.json())


def _ids(found: types.SessionSearchResponse) -> list[str]:
    return [summary.session_id for summary in found.sessions]


def _finish(client, session: str, reason: str | None, key: str = KEY_A) -> None:
    body = {"reason": {"type": reason}, "detail": None} if reason else {}
    answer = _post(client, f"/sessions/{session}/finish", body, key)
    assert answer.status_code == 200, answer.text


def _result(client, answer, key: str = KEY_A) -> dict:
    assert answer.status_code == 200, answer.text
    for _ in range(100):
        got = _post(client, "/retrieve_future", {"request_id": answer.json()["request_id"]}, key)
        assert got.status_code == 200, got.text
        if got.json().get("type") != "try_again":
            return got.json()
    raise AssertionError("the call did not finish")


def _model(client, session: str, key: str = KEY_A, seq: int = 0) -> str:
    create = types.CreateModelRequest(session_id=session, model_seq_id=seq, base_model="tiny",
                                      lora_config=types.LoraConfig(rank=4))
    return _result(client, _post(client, "/create_model", create.model_dump(mode="json"), key), key)["model_id"]


def test_search_matches_names_ids_metadata_statuses_and_projects_of_the_callers_sessions_only(app):
    client, _ = app
    sweep = _session(client, display_name="GRPO sweep lr 1e-4", user_metadata={"team": "rl", "lr": "1e-4"})
    other = _session(client, display_name="SFT warmup", user_metadata={"team": "rl"})
    errored = _session(client, display_name="grpo SWEEP retry", project_id="ablations")
    nameless = _session(client)
    theirs = _session(client, KEY_B, display_name="GRPO sweep lr 1e-4")
    _finish(client, errored, "errored")
    _finish(client, other, None)  # an older SDK's close: no reason given

    assert set(_ids(_search(client))) == {sweep, other, errored, nameless}  # never another key's
    assert _ids(_search(client, KEY_B)) == [theirs]
    # Every word of the name, in any case; with session_id, either one matches.
    assert _ids(_search(client, display_name="sweep GRPO")) == [errored, sweep]  # newest first
    assert _ids(_search(client, display_name="sweep warmup")) == []
    assert set(_ids(_search(client, display_name="warmup", session_id=nameless))) == {other, nameless}
    assert _ids(_search(client, session_id=theirs)) == []
    assert _ids(_search(client, user_metadata={"team": "rl", "lr": "1e-4"})) == [sweep]
    # Statuses: active; finished with the reason its client gave (none given: no status).
    assert set(_ids(_search(client, statuses=[types.ActiveSessionStatusQuery()]))) == {sweep, nameless}
    finished = types.ClientFinishedSessionStatusQuery
    assert _ids(_search(client, statuses=[finished()])) == [errored]
    assert _ids(_search(client, statuses=[finished(reasons=["success", "interrupted"])])) == []
    assert _ids(_search(client, statuses=[types.FailedSessionStatusQuery()])) == []
    # Projects: each session's own, "default" unless its client named one; another is unknown to this key.
    assert _ids(_search(client, project_ids=["ablations"])) == [errored]
    assert set(_ids(_search(client, project_ids=["default"]))) == {sweep, other, nameless}
    unknown = _post(client, "/sessions/search", {"project_ids": ["nobody-s"]})
    assert unknown.status_code == 404 and "no project 'nobody-s'" in unknown.text
    # Owners: this key's own; naming only another owner finds nothing.
    summary = _search(client, session_id=sweep).sessions[0]
    assert summary.owner == f"rlrunbook:{tenant_of(KEY_A)}" and KEY_A not in summary.owner
    assert _ids(_search(client, owner=types.UserSearchOwner(owner_urns=["rlrunbook:someone"]))) == []
    assert len(_ids(_search(client, owner=types.AccessibleSearchOwner()))) == 4
    assert (summary.display_name, summary.user_metadata, summary.project_id) == (
        "GRPO sweep lr 1e-4", {"team": "rl", "lr": "1e-4"}, "default")
    assert summary.status.type == "active" and summary.checkpoints_count == 0


def test_search_pages_through_every_session_once_newest_first(app):
    client, _ = app
    made = [_session(client, display_name=f"run {n}") for n in range(7)]
    seen, cursor = [], None
    for _ in range(10):
        page = _search(client, limit=3, cursor=cursor)
        assert len(page.sessions) <= 3
        seen += _ids(page)
        cursor = page.next_cursor
        if cursor is None:
            break
    assert seen == made[::-1]
    created = [summary.created_at for summary in _search(client, limit=200).sessions]
    assert created == sorted(created, reverse=True) and all(isinstance(c, datetime) for c in created)


def test_a_session_moves_to_a_project_of_its_own_keys_choosing(app):
    client, _ = app
    session = _session(client)
    moved = client.put(f"{API}/sessions/{session}/project", content=json.dumps({"project_id": "eval"}),
                       headers={"X-API-Key": KEY_A})
    assert moved.status_code == 200, moved.text
    assert _ids(_search(client, project_ids=["eval"])) == [session]
    for key, project, status in ((KEY_B, "eval", 404), (KEY_A, "", 400), (KEY_A, "bad\nname", 400)):
        answer = client.put(f"{API}/sessions/{session}/project", content=json.dumps({"project_id": project}),
                            headers={"X-API-Key": key})
        assert answer.status_code == status, answer.text
    assert _search(client, session_id=session).sessions[0].project_id == "eval"


def test_checkpoint_storage_usage_is_the_callers_checkpoints_on_disk_by_project(app):
    client, serve = app
    session = _session(client, project_id="exp")
    model = _model(client, session)
    for seq, name in ((1, "one"), (2, "two")):
        save = types.SaveWeightsRequest(model_id=model, path=name, seq_id=seq)
        _result(client, _post(client, "/save_weights", save.model_dump(mode="json")))
    usage = client.get(f"{API}/billing/usage/checkpoints/current", headers={"X-API-Key": KEY_A})
    assert usage.status_code == 200, usage.text
    (item,) = types.CurrentCheckpointStorageUsageResponse.model_validate(usage.json()).data
    stored = serve.stored_bytes(tenant_of(KEY_A))
    assert (item.project_id, item.checkpoint_count, item.size_bytes) == ("exp", 2, stored) and stored > 0
    assert item.size_gigabytes == pytest.approx(stored / 1e9)
    assert _search(client, session_id=session).sessions[0].checkpoints_count == 2
    assert _search(client, session_id=session).sessions[0].checkpoint_storage_bytes == stored
    other = client.get(f"{API}/billing/usage/checkpoints/current", params={"project_id": "default"},
                       headers={"X-API-Key": KEY_A}).json()["data"]
    assert [(row["project_id"], row["checkpoint_count"], row["size_bytes"]) for row in other] == [("default", 0, 0)]
    assert client.get(f"{API}/billing/usage/checkpoints/current", headers={"X-API-Key": KEY_B}).json()["data"] == []


def test_the_key_check_of_tinker_auth_login_names_the_tenant_not_the_key(app):
    from tinker.cli.auth_api import SelfApiKeyResponse

    client, _ = app
    answer = client.get(f"{API}/auth/apikey/me", headers={"X-API-Key": KEY_A})
    assert answer.status_code == 200, answer.text
    me = SelfApiKeyResponse.model_validate(answer.json())
    assert me.name == tenant_of(KEY_A) and KEY_A not in answer.text
    assert client.get(f"{API}/auth/apikey/me", headers={"X-API-Key": "tml-not-a-key-of-it"}).status_code == 401


@pytest.mark.parametrize(("method", "path"), sorted(NOT_OFFERED), ids=lambda value: str(value))
def test_a_route_the_server_cannot_offer_is_the_callers_error_naming_why(app, method, path):
    client, _ = app
    answer = client.request(method, API + path.replace("{session_id}", "session-x"), content=b"{}",
                            headers={"X-API-Key": KEY_A})
    assert answer.status_code == 400, answer.text
    assert answer.headers["x-should-retry"] == "false"
    assert answer.json()["detail"] == NOT_OFFERED[(method, path)]


@pytest.mark.parametrize("encoding", ["zstd", "gzip", "identity, zstd"])
def test_a_compressed_body_is_refused_naming_the_client_config(app, encoding):
    client, _ = app
    answer = client.post(f"{API}/create_session", content=b"(\xb5/\xfd", headers={
        "X-API-Key": KEY_A, "content-type": "application/json", "content-encoding": encoding})
    assert answer.status_code == 415, answer.text
    assert "proto_compress_fwdbwd=false" in answer.json()["detail"]


def test_a_close_with_a_reason_or_field_unknown_here_still_closes(app):
    client, serve = app
    for body in ({"reason": {"type": "preempted", "by": "scheduler"}, "detail": "x", "trace_id": 7},
                 {"reason": None}):
        session = _session(client)
        answer = _post(client, f"/sessions/{session}/finish", body)
        assert answer.status_code == 200, answer.text
        assert serve.holdings.sessions[session].status == "finished"
        assert serve.holdings.sessions[session].finish_reason is None


def test_names_projects_and_finish_reasons_survive_a_restart(tmp_path):
    from starlette.testclient import TestClient

    storage = tmp_path / "storage"
    built = _app(storage)
    with TestClient(built, raise_server_exceptions=False) as client:
        kept = _session(client, display_name="kept run", project_id="p1")
        _finish(client, kept, "interrupted")
    built.app.state.serve.close()
    again = _app(storage)
    with TestClient(again, raise_server_exceptions=False) as client:
        (summary,) = _search(client).sessions
    again.app.state.serve.close()
    assert (summary.session_id, summary.display_name, summary.project_id) == (kept, "kept run", "p1")
    assert summary.status.type == "client_finished" and summary.status.reason.type == "interrupted"


def test_a_model_of_an_earlier_server_counts_toward_max_models_once_it_holds_weights_again(tmp_path):
    """With --max-models 1: after a restart the key's model holds no weights, so a new model may be made; loading
    the old one's state would make two, and is refused naming the option."""
    from starlette.testclient import TestClient

    storage = tmp_path / "storage"
    seq = itertools.count(1)
    built = _app(storage, max_models=1)
    with TestClient(built, raise_server_exceptions=False) as client:
        session = _session(client)
        old = _model(client, session)
        save = types.SaveWeightsRequest(model_id=old, path="kept", seq_id=next(seq))
        path = _result(client, _post(client, "/save_weights", save.model_dump(mode="json")))["path"]
    built.app.state.serve.close()
    again = _app(storage, max_models=1)
    with TestClient(again, raise_server_exceptions=False) as client:
        new = _model(client, session, seq=1)  # the restarted one holds nothing: room for one
        assert new != old
        load = types.LoadWeightsRequest(model_id=old, path=path, seq_id=next(seq), optimizer=False)
        refused = _post(client, "/load_weights", load.model_dump(mode="json"))
        assert refused.status_code == 429 and "--max-models 1" in refused.text, refused.text
    again.app.state.serve.close()
