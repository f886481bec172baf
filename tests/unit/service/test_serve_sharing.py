"""The SDK's session lookups, copies, external weights and publishing through ``rlrunbook serve``, with two tenants:
the unmodified Tinker SDK against a real server on loopback."""

from __future__ import annotations

import asyncio

import pytest
import tinker
from tinker import types
from tinker._client import AsyncTinker

from rlrunbook.testing.serve import start_server

pytestmark = pytest.mark.slow

KEY_A = "tml-sharing-a-key-0001"
KEY_B = "tml-sharing-b-key-0002"
DATA = [types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3, 4, 5]),
                    loss_fn_inputs={"target_tokens": types.TensorData(data=[2, 3, 4, 5, 6], dtype="int64"),
                                    "weights": types.TensorData(data=[1.0] * 5, dtype="float32")})]
PROMPT = types.ModelInput.from_ints([3, 1, 4, 1, 5])
PARAMS = types.SamplingParams(max_tokens=6, seed=11, temperature=1.0)


@pytest.fixture(autouse=True)
def _no_telemetry(monkeypatch):
    monkeypatch.setenv("TINKER_TELEMETRY", "0")


@pytest.fixture(scope="module")
def storage(tmp_path_factory):
    return tmp_path_factory.mktemp("serve-sharing") / "storage"


@pytest.fixture(scope="module")
def server(storage):
    running = start_server(storage, "--api-key", KEY_A, "--api-key", KEY_B)
    yield running
    running.stop()


def _trained(url: str, key: str, seed: int, **metadata: str):
    """A training client of the tenant of ``key`` after one step (its ServiceClient's session holds it)."""
    service = tinker.ServiceClient(user_metadata=metadata or None, base_url=url, api_key=key)
    training = service.create_lora_training_client(base_model="tiny", rank=4, seed=seed).result()
    training.forward_backward(DATA, "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    return service, training


def _session_of(training) -> str:
    return training.model_id.split(":train:")[0]


def test_a_tenant_lists_and_looks_up_its_own_sessions_only(server):
    _, first = _trained(server.url, KEY_A, 1, purpose="first")
    _service, second = _trained(server.url, KEY_A, 2)
    sampler = second.save_weights_and_get_sampling_client().result()
    _, others = _trained(server.url, KEY_B, 3)
    rest_a = tinker.RestClient(base_url=server.url, api_key=KEY_A)
    rest_b = tinker.RestClient(base_url=server.url, api_key=KEY_B)

    listed = rest_a.list_sessions(limit=100).result().sessions
    assert _session_of(first) in listed and _session_of(second) in listed and _session_of(others) not in listed
    assert listed.index(_session_of(second)) < listed.index(_session_of(first))  # newest first
    assert rest_a.list_sessions(limit=1, offset=1).result().sessions == [listed[1]]
    assert _session_of(others) in rest_b.list_sessions(limit=100).result().sessions

    looked_up = rest_a.get_session(_session_of(second)).result()
    assert looked_up.training_run_ids == [second.model_id]
    assert looked_up.sampler_ids == [sampler._sampling_session_id]
    assert rest_a.get_session(_session_of(first)).result().user_metadata == {"purpose": "first"}
    with pytest.raises(tinker.NotFoundError, match="no session"):
        rest_b.get_session(_session_of(first)).result()
    # The training run ids a session lists name its runs on the run routes.
    assert rest_a.get_training_run(looked_up.training_run_ids[0]).result().base_model == "tiny"


def test_a_copy_is_the_callers_run_and_loads_as_its_source(server):
    service, training = _trained(server.url, KEY_A, 4)
    saved = training.save_state("to-copy").result().path
    loss = training.forward(DATA, "cross_entropy").result().metrics["loss:sum"]
    rest_a = tinker.RestClient(base_url=server.url, api_key=KEY_A)
    copied = rest_a.copy_weights(saved, "any-project").result()
    assert copied != saved and copied.endswith("/weights/to-copy") and copied.split("/")[2] != saved.split("/")[2]
    again = service.create_training_client_from_state(copied).result()
    assert again.forward(DATA, "cross_entropy").result().metrics["loss:sum"] == loss
    assert copied in {c.tinker_path for c in rest_a.list_user_checkpoints(limit=1000).result().checkpoints}

    rest_b = tinker.RestClient(base_url=server.url, api_key=KEY_B)
    with pytest.raises(tinker.NotFoundError):  # A's copy is A's run, as unknown to B as A's source
        rest_b.get_weights_info_by_tinker_path(copied).result()
    with pytest.raises(tinker.NotFoundError):
        rest_b.copy_weights(saved, "any-project").result()
    assert copied not in {c.tinker_path for c in rest_b.list_user_checkpoints(limit=1000).result().checkpoints}


def test_external_weights_are_saved_and_listed_and_their_urls_refused_naming_why(server):
    _service, training = _trained(server.url, KEY_A, 5)
    path = training.save_weights_external("export").result().path
    assert path.endswith("/external_weights/export")
    rest = tinker.RestClient(base_url=server.url, api_key=KEY_A)
    listed = rest.list_checkpoints(training.model_id).result().checkpoints
    assert [c.checkpoint_type for c in listed if c.tinker_path == path] == ["external"]
    with pytest.raises(tinker.BadRequestError, match="no download URLs"):
        rest.get_external_weights_urls(path).result()


def test_retrieve_futures_is_refused_naming_the_config_that_turns_it_off(server):
    async def poll() -> None:
        client = AsyncTinker(api_key=KEY_A, base_url=server.url, max_retries=0)
        try:
            await client.futures.retrieve_multi(request=types.FuturesRetrieveRequest(
                target=types.SamplingSessionFuturesTarget(sampling_session_id="session-x:sample:0")))
        finally:
            await client.close()

    with pytest.raises(tinker.BadRequestError, match="sample_use_retrieve_futures"):
        asyncio.run(poll())


def test_a_published_checkpoint_is_readable_by_another_tenant_until_unpublished_and_after_a_restart(storage):
    server = start_server(storage.parent / "publishing", "--api-key", KEY_A, "--api-key", KEY_B)
    try:
        service_a, training = _trained(server.url, KEY_A, 6)
        weights = training.save_state("shared").result().path
        sampler_path = training.save_weights_for_sampler("shared").result().path
        rest_a = tinker.RestClient(base_url=server.url, api_key=KEY_A)
        service_b = tinker.ServiceClient(base_url=server.url, api_key=KEY_B)
        rest_b = tinker.RestClient(base_url=server.url, api_key=KEY_B)
        with pytest.raises(tinker.NotFoundError):
            rest_b.get_weights_info_by_tinker_path(weights).result()
        with pytest.raises(tinker.NotFoundError):  # only the owner publishes
            rest_b.publish_checkpoint_from_tinker_path(weights).result()

        rest_a.publish_checkpoint_from_tinker_path(weights).result()
        rest_a.publish_checkpoint_from_tinker_path(weights).result()  # again: no change, no error
        rest_a.publish_checkpoint_from_tinker_path(sampler_path).result()
        public = {c.tinker_path: c.public for c in rest_a.list_checkpoints(training.model_id).result().checkpoints}
        assert public[weights] and public[sampler_path]
        assert rest_b.get_weights_info_by_tinker_path(weights).result().base_model == "tiny"
        loss = training.forward(DATA, "cross_entropy").result().metrics["loss:sum"]
        loaded = service_b.create_training_client_from_state(weights).result()
        assert loaded.forward(DATA, "cross_entropy").result().metrics["loss:sum"] == loss
        own = service_a.create_sampling_client(model_path=sampler_path).result().sample(PROMPT, 2, PARAMS).result()
        theirs = service_b.create_sampling_client(model_path=sampler_path).result().sample(PROMPT, 2, PARAMS).result()
        assert [s.tokens for s in theirs.sequences] == [s.tokens for s in own.sequences]
        with pytest.raises(tinker.NotFoundError):  # the run itself stays A's
            rest_b.list_checkpoints(weights.split("/")[2]).result()

        # Deleted, then saved again under its name: private again.
        rest_a.delete_checkpoint_from_tinker_path(sampler_path).result()
        assert training.save_weights_for_sampler("shared").result().path == sampler_path
        with pytest.raises(tinker.NotFoundError):
            rest_b.get_weights_info_by_tinker_path(sampler_path).result()

        server.stop()
        server = start_server(storage.parent / "publishing", "--api-key", KEY_A, "--api-key", KEY_B,
                              port=server.port)
        rest_a = tinker.RestClient(base_url=server.url, api_key=KEY_A)
        rest_b = tinker.RestClient(base_url=server.url, api_key=KEY_B)
        assert rest_b.get_weights_info_by_tinker_path(weights).result().base_model == "tiny"  # kept
        rest_a.unpublish_checkpoint_from_tinker_path(weights).result()
        with pytest.raises(tinker.NotFoundError):
            rest_b.get_weights_info_by_tinker_path(weights).result()
    finally:
        server.stop()


@pytest.mark.filterwarnings("ignore:RestClient.search_sessions is experimental")
def test_the_sdks_account_calls_answer_for_the_callers_own_sessions(server):
    """search_sessions, assign_session_project, the storage usage of AdminClient, the key check of `tinker auth
    login` and a close's reason, through the unmodified SDK; a trace export is refused naming why."""
    import httpx
    from tinker.cli.auth_api import TinkerAuthApi

    service = tinker.ServiceClient(base_url=server.url, api_key=KEY_A, display_name="account sweep 7")
    training = service.create_lora_training_client(base_model="tiny", rank=4, seed=5).result()
    training.save_state("account-kept").result()
    session = _session_of(training)
    rest = tinker.RestClient(base_url=server.url, api_key=KEY_A)

    found = rest.search_sessions(types.SessionSearchRequest(display_name="SWEEP 7")).result()
    assert [summary.session_id for summary in found.sessions] == [session]
    assert found.sessions[0].checkpoints_count == 1 and found.sessions[0].status.type == "active"
    rest.assign_session_project(session, "account-tests").result()
    usage = tinker.AdminClient(base_url=server.url, api_key=KEY_A).get_current_checkpoint_storage_usage(
        "account-tests").result()
    assert [(item.project_id, item.checkpoint_count) for item in usage.data] == [("account-tests", 1)]
    assert usage.data[0].size_bytes == found.sessions[0].checkpoint_storage_bytes > 0
    other = tinker.RestClient(base_url=server.url, api_key=KEY_B)
    assert other.search_sessions(types.SessionSearchRequest(display_name="sweep 7")).result().sessions == []
    with pytest.raises(tinker.BadRequestError, match="no Perfetto traces"):
        rest.export_session_trace(session).result()
    with httpx.Client() as http:
        assert TinkerAuthApi(http, base_url=server.url).get_self_api_key(KEY_A).name.startswith("key-")

    service.close("errored").result()
    closed = rest.search_sessions(types.SessionSearchRequest(session_id=session)).result().sessions[0]
    assert closed.status.type == "client_finished" and closed.status.reason.type == "errored"
