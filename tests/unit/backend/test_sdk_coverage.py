"""Every public method of the installed Tinker SDK's four clients works locally or is refused with a reason.

docs/tinker-api.md has one table per client; the tests here build the list of methods from the installed SDK
and hold the page, the local classes and rlrunbook.backend.unsupported.REFUSED to it. The behaviour tests
below pin what the methods added for issue 28 (point 4) do, with expectations derivable by hand: a copy
samples and scores exactly as its source, an async twin returns what its method returns, a handle's client
samples the same tokens as the handle's, a TTL shows up as now + TTL, an export downloads to the adapter that
was trained.
"""

from __future__ import annotations

import asyncio
import base64
import inspect
import json
import logging
import re
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
import tinker
import torch
from safetensors.torch import load_file
from tinker import types

from rlrunbook.backend import LocalRestClient, LocalSamplingClient, LocalServiceClient, LocalSettings
from rlrunbook.backend import service_client as service_module
from rlrunbook.backend.storage import CheckpointStore, RunRecord, parse_tinker_path, set_expiry
from rlrunbook.backend.unsupported import refusal_reason
from rlrunbook.errors import ConfigError, ModelNotFoundError

ROOT = Path(__file__).resolve().parents[3]
PAGE = ROOT / "docs" / "tinker-api.md"
CLIENTS = {
    "ServiceClient": (tinker.ServiceClient, LocalServiceClient),
    "TrainingClient": (tinker.TrainingClient, service_module.LocalTrainingClient),
    "SamplingClient": (tinker.SamplingClient, LocalSamplingClient),
    "RestClient": (tinker.RestClient, LocalRestClient),
}
ROW = re.compile(r"^\| `(\w+)` \| (.+?) \|$")
ADAPTER = "adapter_model.safetensors"

SEQUENCE = [5, 17, 42, 9, 11, 3, 7, 8, 30, 31]
PROMPT = types.ModelInput.from_ints(SEQUENCE[:5])
ADAM = types.AdamParams(learning_rate=5e-2)
DAY = 24 * 3600


# -- the page against the installed SDK -------------------------------------------------------------------
def page_tables(text: str) -> dict[str, dict[str, str]]:
    """``{client: {method: status}}`` from the page's ``## <Client>`` sections' table rows."""
    tables: dict[str, dict[str, str]] = {}
    current = None
    for line in text.splitlines():
        if line.startswith("## "):
            current = line[3:].strip() if line[3:].strip() in CLIENTS else None
            if current is not None:
                tables[current] = {}
        elif current is not None and (row := ROW.match(line)):
            assert row.group(1) not in tables[current], f"{current}.{row.group(1)} is listed twice"
            tables[current][row.group(1)] = row.group(2)
    return tables


TABLES = page_tables(PAGE.read_text())


def sdk_public_names(sdk_class: type) -> set[str]:
    return {name for name in dir(sdk_class) if not name.startswith("_")}


def test_page_parser_reads_rows_of_each_client_section():
    text = ("## ServiceClient\n\n| method | status |\n|---|---|\n| `close` | works |\n\n"
            "## Other\n| `x` | works |\n")
    assert page_tables(text) == {"ServiceClient": {"close": "works"}}


@pytest.mark.parametrize("client", CLIENTS)
def test_page_names_every_public_method_of_the_installed_sdk(client):
    sdk_class, _ = CLIENTS[client]
    listed = set(TABLES.get(client, {}))
    missing, stale = sdk_public_names(sdk_class) - listed, listed - sdk_public_names(sdk_class)
    assert not missing, f"docs/tinker-api.md's {client} table lacks {sorted(missing)} (new in the SDK?)"
    assert not stale, f"docs/tinker-api.md's {client} table lists {sorted(stale)}, which the SDK lacks"


@pytest.mark.parametrize("client", CLIENTS)
def test_page_statuses_match_the_local_class(client):
    sdk_class, local_class = CLIENTS[client]
    for name, status in TABLES[client].items():
        assert re.match(r"(works|refused)(: .+)?$", status), f"{client}.{name}: status {status!r}"
        if status.startswith("works"):
            assert hasattr(local_class, name), f"the page says {client}.{name} works; the class lacks it"
            static = [isinstance(inspect.getattr_static(c, name), staticmethod)
                      for c in (sdk_class, local_class)]
            assert static[0] == static[1], f"{client}.{name}: static in one class and not the other"
            sdk_async = inspect.iscoroutinefunction(inspect.unwrap(getattr(sdk_class, name)))
            assert inspect.iscoroutinefunction(getattr(local_class, name)) == sdk_async, \
                f"{client}.{name}: the SDK's is {'a' if sdk_async else 'not a'} coroutine function"
        else:
            assert not hasattr(local_class, name), f"the page says {client}.{name} is refused; it is there"
            assert refusal_reason(client, name), f"{client}.{name} is refused without a reason in REFUSED"


# -- refused methods name the method and the reason ----------------------------------------------------------
REFUSED_METHODS = [(client, name) for client, table in TABLES.items()
                   for name, status in table.items() if status.startswith("refused")]


@pytest.fixture(scope="module")
def clients(tmp_path_factory):
    """One of each local client, on a tiny model (for the refusal tests, which only look attributes up)."""
    settings = LocalSettings(device="cpu", dtype=torch.float32, storage_dir=tmp_path_factory.mktemp("tinker"))
    with LocalServiceClient(settings) as service:
        training = service.create_lora_training_client("tiny", rank=4, seed=0)
        yield {"ServiceClient": service, "TrainingClient": training,
               "SamplingClient": training.save_weights_and_get_sampling_client(),
               "RestClient": service.create_rest_client()}


@pytest.mark.parametrize(("client", "name"), REFUSED_METHODS, ids=[f"{c}.{n}" for c, n in REFUSED_METHODS])
def test_refused_methods_name_the_method_and_the_reason(clients, client, name):
    with pytest.raises(AttributeError) as raised:
        getattr(clients[client], name)()
    message = str(raised.value)
    assert f"{client}.{name} is part of the Tinker SDK" in message
    assert refusal_reason(client, name) in message and "TINKER_BACKEND=api" in message
    assert "no local equivalent yet" not in message and "has no attribute" not in message


def test_refused_and_working_lists_are_not_empty():
    """The parametrised tests above would pass vacuously on an unparsed page."""
    assert len(REFUSED_METHODS) >= 10
    assert sum(s.startswith("works") for table in TABLES.values() for s in table.values()) >= 80


# -- behaviour of the methods that work ----------------------------------------------------------------------
def _datum(sequence: list[int]) -> types.Datum:
    weights = [0.0] * 3 + [1.0] * (len(sequence) - 4)
    return types.Datum(model_input=types.ModelInput.from_ints(sequence[:-1]),
                       loss_fn_inputs={"target_tokens": types.TensorData(data=sequence[1:], dtype="int64",
                                                                         shape=[len(sequence) - 1]),
                                       "weights": types.TensorData(data=weights, dtype="float32",
                                                                   shape=[len(weights)])})


def trained(service, user_metadata=None):
    """A training client one cross_entropy step away from its zero-initialised LoRA (not the base model)."""
    client = service.create_lora_training_client("tiny", rank=4, seed=0, user_metadata=user_metadata)
    client.forward_backward([_datum(SEQUENCE)], "cross_entropy")
    client.optim_step(ADAM).result()
    return client


def scores(client) -> list[float]:
    """Per-token logprobs of SEQUENCE under the client's weights (training or sampling client)."""
    if hasattr(client, "compute_logprobs"):
        return client.compute_logprobs(types.ModelInput.from_ints(SEQUENCE)).result()[1:]
    out = client.forward([_datum(SEQUENCE)], "cross_entropy").result()
    return out.loss_fn_outputs[0]["logprobs"].to_torch().tolist()


def sampled_tokens(sampler, seed: int = 3) -> list[list[int]]:
    params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=seed, stop=[])
    return [s.tokens for s in sampler.sample(PROMPT, 3, params).result().sequences]


def test_copy_weights_makes_a_new_run_whose_checkpoint_scores_as_the_source(local_service):
    client = trained(local_service)
    state = client.save_state("s").result().path
    sampler_path = client.save_weights_for_sampler("w").result().path
    before = datetime.now(timezone.utc)
    copy = local_service.copy_weights(state, ttl_seconds=2 * DAY).result()
    rest = local_service.create_rest_client()
    sampler_copy = rest.copy_weights(sampler_path).result()

    copied, source = parse_tinker_path(copy), parse_tinker_path(state)
    assert copied.model_id != source.model_id and (copied.kind, copied.name) == ("weights", "s")
    assert parse_tinker_path(sampler_copy).kind == "sampler_weights"
    resumed = local_service.create_training_client_from_state(copy)
    assert scores(resumed) == scores(client)
    base = local_service.create_sampling_client(base_model="tiny")
    assert scores(local_service.create_sampling_client(model_path=sampler_copy)) == scores(
        local_service.create_sampling_client(model_path=sampler_path)) != scores(base)
    listed = {c.tinker_path: c.expires_at
              for c in rest.list_checkpoints(copied.model_id).result().checkpoints}
    assert before + timedelta(days=2) <= listed[copy] <= datetime.now(timezone.utc) + timedelta(days=2)
    run = rest.get_training_run(copied.model_id).result()
    assert (run.base_model, run.lora_rank) == ("tiny", 4)
    source_run = rest.get_training_run(source.model_id).result()
    assert source_run.last_checkpoint.expires_at is None, "the source's expiry is untouched"


def test_ttl_is_recorded_listed_and_never_deletes(local_service):
    client = trained(local_service)
    path = client.save_state("s", ttl_seconds=3600).result().path
    rest = local_service.create_rest_client()

    def expiry():
        (checkpoint,) = rest.list_checkpoints(client.model_id).result().checkpoints
        return checkpoint.expires_at

    assert timedelta(minutes=59) < expiry() - datetime.now(timezone.utc) <= timedelta(hours=1)
    before = datetime.now(timezone.utc)
    assert rest.set_checkpoint_ttl_from_tinker_path(path, 7 * DAY).result() is None
    assert before + timedelta(days=7) <= expiry() <= datetime.now(timezone.utc) + timedelta(days=7)
    rest.set_checkpoint_ttl_from_tinker_path(path, None).result()
    assert expiry() is None
    for bad in (60, 11 * 365 * DAY, 3600.5):
        with pytest.raises(ConfigError, match="ttl_seconds"):
            rest.set_checkpoint_ttl_from_tinker_path(path, bad)
    folder = local_service._store.folder(parse_tinker_path(path))
    set_expiry(folder, 3600, now=datetime(2000, 1, 1, tzinfo=timezone.utc))  # long expired
    assert expiry() == datetime(2000, 1, 1, 1, tzinfo=timezone.utc)  # listed with its expiry until deleted
    for use in (lambda: local_service.create_training_client_from_state(path),  # gone, as on the hosted service
                lambda: rest.get_weights_info_by_tinker_path(path),
                lambda: rest.set_checkpoint_ttl_from_tinker_path(path, 7 * DAY)):
        with pytest.raises(ModelNotFoundError, match="expired at 2000-01-01T01:00:00"):
            use()
    rest.delete_checkpoint_from_tinker_path(path).result()  # deleting it still works
    assert rest.list_checkpoints(client.model_id).result().checkpoints == []


def test_rest_async_twins_return_what_their_methods_return(local_service):
    client = trained(local_service)
    state = client.save_state("s").result().path
    export = client.save_weights_external("e").result().path
    sampler = client.save_weights_and_get_sampling_client()
    rest = local_service.create_rest_client()
    calls = {
        "get_training_run": (client.model_id,), "get_training_run_by_tinker_path": (state,),
        "list_training_runs": (), "list_checkpoints": (client.model_id,), "list_user_checkpoints": (),
        "list_sessions": (), "get_session": (local_service.session_id,),
        "get_sampler": (sampler._sampler_id,),
    }

    async def both(name, args):
        return getattr(rest, name)(*args).result(), await getattr(rest, f"{name}_async")(*args)

    for name, args in calls.items():
        sync, twin = asyncio.run(both(name, args))
        assert twin == sync and twin is not None, name
    urls, urls_twin = asyncio.run(both("get_external_weights_urls", (export,)))
    assert urls_twin.urls == urls.urls and "adapter_model.safetensors" in urls.urls  # `expires`: now + a day
    assert asyncio.run(rest.set_checkpoint_ttl_from_tinker_path_async(state, 3600)) is None
    copy = asyncio.run(rest.copy_weights_async(state))
    assert parse_tinker_path(copy).name == "s" and copy != state
    assert asyncio.run(rest.delete_checkpoint_async(parse_tinker_path(copy).model_id, "weights/s")) is None
    assert asyncio.run(rest.delete_checkpoint_from_tinker_path_async(state)) is None
    remaining = [c.tinker_path for c in rest.list_user_checkpoints().result().checkpoints]
    assert state not in remaining and copy not in remaining and export in remaining
    tested = set(calls) | {"get_external_weights_urls", "set_checkpoint_ttl_from_tinker_path", "copy_weights",
                           "delete_checkpoint", "delete_checkpoint_from_tinker_path"}
    working_twins = {n.removesuffix("_async") for n, s in TABLES["RestClient"].items()
                     if n.endswith("_async") and s.startswith("works")}
    assert working_twins == tested


def test_sampler_handle_gives_a_client_of_the_same_sampler(local_service):
    client = trained(local_service)
    sampler = client.save_weights_and_get_sampling_client()
    expected_tokens, expected_scores = sampled_tokens(sampler), scores(sampler)
    handle = sampler.get_sampler_handle()
    client.forward_backward([_datum(SEQUENCE)], "cross_entropy")
    client.optim_step(ADAM).result()  # the live weights move on; the handle names the snapshot

    twin = LocalSamplingClient.from_sampler_handle(handle)
    assert twin is not sampler and twin._sampler_id == sampler._sampler_id
    assert sampled_tokens(twin) == expected_tokens and scores(twin) == expected_scores
    assert scores(twin) != scores(client.save_weights_and_get_sampling_client())
    created = LocalSamplingClient.create(local_service, sampling_session_id=sampler._sampler_id).result()
    assert scores(created) == expected_scores
    rest = local_service.create_rest_client()
    info = rest.get_sampler(sampler._sampler_id).result()
    assert (info.sampler_id, info.base_model, info.model_path) == (
        sampler._sampler_id, "tiny", sampler.model_path)
    with pytest.raises(ConfigError, match="not a sampler handle"):
        LocalSamplingClient.from_sampler_handle("not-a-handle")
    with pytest.raises(ConfigError, match="holder"):
        LocalSamplingClient.create(object(), base_model="tiny")

    with pytest.raises(ModelNotFoundError, match="save_weights_for_sampler"):
        LocalSamplingClient.from_sampler_handle(made_elsewhere(handle))  # a snapshot stays in its process


def made_elsewhere(handle: str) -> str:
    """``handle`` as another process would have made it: its sampler is not one of this process."""
    fields = json.loads(base64.urlsafe_b64decode(handle))
    fields["sampler_id"] = "local-session-elsewhere:sample:0"
    return base64.urlsafe_b64encode(json.dumps(fields).encode()).decode()


def test_sampler_handle_of_saved_weights_outlives_its_client(local_service, monkeypatch):
    """What another process does with a handle: no live sampler, so the saved weights are loaded anew."""
    monkeypatch.setenv("TINKER_LOCAL_DEVICE", "cpu")
    monkeypatch.setenv("TINKER_LOCAL_DTYPE", "float32")
    path = trained(local_service).save_weights_for_sampler("h").result().path
    sampler = LocalSamplingClient.create(local_service, model_path=path).result()
    expected_tokens, expected_scores = sampled_tokens(sampler), scores(sampler)
    rebuilt = LocalSamplingClient.from_sampler_handle(made_elsewhere(sampler.get_sampler_handle()))
    try:
        assert rebuilt._host is not sampler._host, "loaded anew, as in another process"
        assert rebuilt.model_path == path and rebuilt.get_base_model() == "tiny"
        assert sampled_tokens(rebuilt) == expected_tokens
        assert scores(rebuilt) == pytest.approx(expected_scores, abs=1e-6)
    finally:
        service_module._HANDLE_SERVICES.pop(local_service._store.root).close()


def test_save_weights_external_writes_the_trained_adapter(local_service):
    client = trained(local_service)
    state = client.save_state("s").result().path
    export = client.save_weights_external("e", ttl_seconds=3600).result().path
    assert export == f"tinker://{client.model_id}/external_weights/e"
    response = local_service.create_rest_client().get_external_weights_urls(export).result()
    folder = local_service._store.folder(parse_tinker_path(export))
    files = {p.name for p in folder.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "rlrunbook_checkpoint.json"} <= files
    assert set(response.urls) == files - {"rlrunbook_checkpoint.json"}, "every file but the recorded expiry"
    assert response.urls[ADAPTER] == (folder / ADAPTER).resolve().as_uri()
    exported = load_file(str(folder / ADAPTER))
    saved = load_file(str(local_service._store.folder(parse_tinker_path(state)) / ADAPTER))
    assert exported.keys() == saved.keys() and all(torch.equal(exported[k], saved[k]) for k in saved)
    assert scores(local_service.create_sampling_client(model_path=export)) == scores(client)
    with pytest.raises(ConfigError, match="external_weights"):
        local_service.create_rest_client().get_external_weights_urls(state)
    with pytest.raises(ConfigError, match="age recipient 'nope'"):
        client.save_weights_external("x", age_encryption_recipients=["nope"])
    assert inspect.isawaitable(twin := asyncio.run(client.save_weights_external_async("e2")))
    assert twin.result().path.endswith("/external_weights/e2"), "the SDK's twin gives the future itself"


def test_the_cookbook_downloads_a_training_checkpoint_through_an_encrypted_export(local_service, monkeypatch,
                                                                                   tmp_path):
    """tinker_cookbook.weights.download: create_training_client_from_state, save_weights_external encrypted
    to a new age key, get_external_weights_urls, set_checkpoint_ttl_from_tinker_path, fetch, decrypt,
    delete."""
    from rlrunbook.backend import SdkLocalServiceClient
    from tinker_cookbook import weights

    monkeypatch.setenv("TINKER_LOCAL_DEVICE", "cpu")
    monkeypatch.setenv("TINKER_LOCAL_DTYPE", "float32")
    monkeypatch.setenv("TINKER_LOCAL_STORAGE", str(local_service._store.root))
    monkeypatch.setattr(tinker, "ServiceClient", SdkLocalServiceClient)
    monkeypatch.setattr(tinker, "RestClient", LocalRestClient)
    client = trained(local_service)
    state = client.save_state("s").result().path

    out = Path(weights.download(tinker_path=state, output_dir=str(tmp_path / "adapter")))
    downloaded = load_file(str(out / ADAPTER))
    saved = load_file(str(local_service._store.folder(parse_tinker_path(state)) / ADAPTER))
    assert downloaded.keys() == saved.keys() and all(torch.equal(downloaded[k], saved[k]) for k in saved)
    assert not list(out.glob("*.age"))
    exports = [c for c in local_service.create_rest_client().list_user_checkpoints().result().checkpoints
               if c.checkpoint_type == "external"]
    assert exports == [], "the temporary export is deleted, as on the service"


def test_sessions_list_runs_from_storage_and_samplers_of_this_process(tmp_path):
    settings = LocalSettings(device="cpu", dtype=torch.float32, storage_dir=tmp_path / "tinker")
    with LocalServiceClient(settings, user_metadata={"who": "test"}) as service:
        client = service.create_lora_training_client("tiny", rank=4)
        sampler = client.save_weights_and_get_sampling_client()
        rest = LocalRestClient(CheckpointStore(tmp_path / "tinker"))
        CheckpointStore(tmp_path / "tinker").write_run(RunRecord("local-older", "tiny", 4, created=1.0,
                                                                 session_id="local-session-older"))
        assert rest.list_sessions().result().sessions == [service.session_id, "local-session-older"]
        assert rest.list_sessions(limit=1, offset=1).result().sessions == ["local-session-older"]
        mine = rest.get_session(service.session_id).result()
        assert (mine.training_run_ids, mine.sampler_ids, mine.user_metadata) == (
            [client.model_id], [sampler._sampler_id], {"who": "test"})
        older = rest.get_session("local-session-older").result()
        assert (older.training_run_ids, older.sampler_ids, older.user_metadata) == (["local-older"], [], None)
        with pytest.raises(ModelNotFoundError, match="list_sessions"):
            rest.get_session("local-session-unknown")
        with pytest.raises(ModelNotFoundError, match="no sampler"):
            rest.get_sampler("local-session-unknown:sample:0")


def test_telemetry_base_model_and_queue_state(local_service, caplog):
    from tinker.lib.api_future_impl import QueueState

    client = local_service.create_lora_training_client("tiny", rank=4)
    sampler = client.save_weights_and_get_sampling_client()
    for c in (local_service, client, sampler, local_service.create_rest_client()):
        assert c.get_telemetry() is None
    assert asyncio.run(sampler.get_base_model_async()) == "tiny"
    with caplog.at_level(logging.WARNING):
        sampler.on_queue_state_change(QueueState.ACTIVE, None)
        assert not caplog.records
        sampler.on_queue_state_change(QueueState.PAUSED_CAPACITY, "busy")
    assert [r.getMessage() for r in caplog.records] == [
        f"Sampling is paused for sampler {sampler._sampler_id}. Reason: busy"]
