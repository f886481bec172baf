"""Hostile HTTP against ``rlrunbook serve``: every route that takes a run id, checkpoint name or ``tinker://`` path
with paths that try to leave the storage, malformed and oversized bodies, one tenant's requests on the other's
runs, checkpoints, models, samplers and request ids, missing and wrong keys, unknown routes and methods.

For every case the suite proves: no 5xx (nor a call failed as the server's fault), no Python traceback and no
folder of the server in any answer, nothing read, listed, written or changed outside the storage (a canary run
beside it, reached through ``..``, absolute paths and links inside the storage, is never listed, loaded or
changed: watched by an audit hook and by fingerprints), A's and B's saved checkpoints intact, and no answer to
one tenant carrying the other's data. A refusal is a 4xx or a failed call. Last, both tenants still train, save
and list normally. The app runs in process with two API keys (Starlette's TestClient, plain JSON), as in
``test_boundaries.py``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from urllib.parse import quote, unquote

import pytest
from hostile_http_watch import CANARY_SECRET, OutsideWatch, files_outside, plant_canary
from tinker import types
from tinker.proto import request_conv

from rlrunbook.backend import LocalServiceClient, LocalSettings

KEY_A, KEY_B = "tml-hostile-a-key", "tml-hostile-b-key"
API = "/api/v1"
MAX_BODY = 256 * 1024  # the app's body limit here: a body over it is cheap to send
NO_KEY = object()  # send no X-API-Key header
TRACEBACK = "Traceback (most recent call last)"
CANARY_ABS = "\x00canary-abs\x00"  # stands for the canary run's absolute folder (known once it is planted)


@dataclass
class Tenant:
    key: str
    secret: str  # in its run's user metadata: only its own answers may carry it
    session: str = ""
    model: str = ""  # the SDK model id, "<session>:train:0"
    run: str = ""  # the storage's run id
    path: str = ""  # tinker://<run>/weights/first
    sampler_path: str = ""  # tinker://<run>/sampler_weights/samp
    sampler: str = ""  # a sampling session of sampler_path
    request: str = ""  # a request id of a finished call
    scratch: str = ""  # a second model for the body cases (refused seq_ids may leave gaps)
    other_layout: str = ""  # a model of rank 2, beside the rank-4 ones

    def markers(self) -> list[str]:
        return [self.secret, self.session, self.run, self.request]


@dataclass
class World:
    client: object
    storage: Path
    root: Path
    a: Tenant
    b: Tenant
    canary: Path = Path()
    watch: OutsideWatch | None = None
    outside: dict = field(default_factory=dict)  # as the last case left it
    first_outside: dict = field(default_factory=dict)  # as planted
    protected: dict = field(default_factory=dict)
    sampler_seq: Iterator[int] = field(default_factory=lambda: iter(range(100, 100_000)))

    @property
    def serve(self):
        return self.client.app.app.state.serve

    def seq(self, model_id: str) -> int:
        """The next seq_id of a model as the server counts them: a request refused before its turn took none."""
        model = self.serve.holdings.models.get(model_id)
        return 1 if model is None else model.last_seq + 1


@dataclass(frozen=True)
class Req:
    method: str
    path: str  # under /api/v1 unless it starts with "//", as sent (percent-encoding kept)
    body: object = None  # JSON-able, bytes sent as they are, or None for no body
    key: object = KEY_A  # a str, bytes, or NO_KEY
    headers: tuple[tuple[str, str], ...] = ()
    chunked: bool = False  # the body sent without Content-Length

    def raw_body(self) -> bytes | None:
        if self.body is None or isinstance(self.body, bytes):
            return self.body
        return json.dumps(self.body).encode()

    def text(self) -> str:
        """What the caller sent, as text: an answer may echo it."""
        body = self.raw_body() or b""
        key = self.key if isinstance(self.key, str) else ""
        return " ".join([self.path, unquote(self.path), body.decode("utf-8", "replace"), key])


@dataclass(frozen=True)
class Case:
    name: str
    build: Callable[[World], Req]
    expect: str = "refused"  # "refused": a 4xx or a failed call; "any": only the invariants; or a status code
    caller_is_b: bool = False
    defect: str = ""  # a known defect outside what this suite may change: the case is xfail(strict=True)

    def param(self):
        marks = [pytest.mark.xfail(strict=True, reason=self.defect)] if self.defect else []
        return pytest.param(self, id=self.name, marks=marks)


def _send(client, req: Req):
    headers = dict(req.headers)
    if req.key is not NO_KEY:
        headers["X-API-Key"] = req.key
    content = req.raw_body()
    if content is not None:
        headers.setdefault("content-type", "application/json")
        if req.chunked:
            content = iter([content[i:i + 65536] for i in range(0, len(content), 65536)])
    url = req.path[1:] if req.path.startswith("//") else API + req.path
    return client.request(req.method, url, content=content, headers=headers)


def _post(client, route: str, body, key: str = KEY_A):
    return _send(client, Req("POST", route, body, key))


def _poll(client, rid: str, key) -> tuple[int, str]:
    """The outcome of a queued call as (status, body): polls until it is not "try again"."""
    for _ in range(200):
        got = _send(client, Req("POST", "/retrieve_future", {"request_id": rid}, key))
        if got.status_code != 200 or got.headers.get("content-type", "").startswith("application/x-protobuf"):
            return got.status_code, got.text if got.status_code != 200 else "<protobuf>"
        if got.json().get("type") != "try_again":
            return 200, got.text
    raise AssertionError(f"request {rid} did not finish")


def _result(client, answer, key: str = KEY_A) -> dict:
    assert answer.status_code == 200, answer.text
    status, text = _poll(client, answer.json()["request_id"], key)
    assert status == 200, text
    return json.loads(text)


def _session(client, key: str, secret: str = "") -> str:
    body = types.CreateSessionRequest(tags=[], user_metadata={"who": secret}, sdk_version="test")
    return _post(client, "/create_session", body.model_dump(mode="json"), key).json()["session_id"]


def _create_model(world: World, key: str, session: str, seq: int, secret: str, rank: int = 4) -> str:
    create = types.CreateModelRequest(session_id=session, model_seq_id=seq, base_model="tiny",
                                      lora_config=types.LoraConfig(rank=rank), user_metadata={"secret": secret})
    return _result(world.client, _post(world.client, "/create_model", create.model_dump(mode="json"), key),
                   key)["model_id"]


def _save(world: World, key: str, model: str, name: str, route: str = "/save_weights") -> str:
    kind = types.SaveWeightsRequest if route == "/save_weights" else types.SaveWeightsForSamplerRequest
    body = kind(model_id=model, path=name, seq_id=world.seq(model)).model_dump(mode="json")
    return _result(world.client, _post(world.client, route, body, key), key)["path"]


def _tenant(world: World, tenant: Tenant) -> None:
    client = world.client
    tenant.session = _session(client, tenant.key, tenant.secret)
    tenant.model = _create_model(world, tenant.key, tenant.session, 0, tenant.secret)
    tenant.scratch = _create_model(world, tenant.key, tenant.session, 1, tenant.secret)
    tenant.other_layout = _create_model(world, tenant.key, tenant.session, 2, tenant.secret, rank=2)
    save = types.SaveWeightsRequest(model_id=tenant.model, path="first", seq_id=world.seq(tenant.model))
    answer = _post(client, "/save_weights", save.model_dump(mode="json"), tenant.key)
    tenant.request = answer.json()["request_id"]
    tenant.path = _result(client, answer, tenant.key)["path"]
    tenant.run = tenant.path.split("/")[2]
    tenant.sampler_path = _save(world, tenant.key, tenant.model, "samp", "/save_weights_for_sampler")
    sampler = types.CreateSamplingSessionRequest(session_id=tenant.session, sampling_session_seq_id=0,
                                                 model_path=tenant.sampler_path)
    made = _post(client, "/create_sampling_session", sampler.model_dump(mode="json"), tenant.key)
    assert made.status_code == 200, made.text
    tenant.sampler = made.json()["sampling_session_id"]


def _protected(world: World) -> dict[str, str]:
    """Digests of A's and B's saved checkpoints: no hostile request may change or remove them."""
    found = {}
    for tenant in (world.a, world.b):
        for kind, name in (("weights", "first"), ("sampler_weights", "samp")):
            folder = world.storage / tenant.run / kind / name
            for file in sorted(folder.iterdir()):
                if file.name != "rlrunbook_checkpoint.json":  # its TTL; not set by any case
                    found[str(file.relative_to(world.storage))] = hashlib.sha256(file.read_bytes()).hexdigest()
    return found


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Iterator[World]:
    import torch
    from starlette.testclient import TestClient

    from rlrunbook.service import routes
    from rlrunbook.service.server import ServeOptions, build_app

    root = tmp_path_factory.mktemp("hostile-http")
    storage = root / "storage"
    service = LocalServiceClient(LocalSettings(device="cpu", dtype=torch.float32, storage_dir=storage))
    app = build_app(service, ServeOptions(api_keys=(KEY_A, KEY_B), storage=storage, max_body_bytes=MAX_BODY,
                                          max_sessions=10_000, max_models=10_000))  # limits: test_boundaries
    long_poll, routes.LONG_POLL_S = routes.LONG_POLL_S, 0.5
    try:
        with TestClient(app, raise_server_exceptions=False) as client:
            world = World(client, storage, root, Tenant(KEY_A, "tenant-a-secret-51c2"),
                          Tenant(KEY_B, "tenant-b-secret-9e07"))
            _tenant(world, world.a)
            _tenant(world, world.b)
            world.canary = plant_canary(root, storage, storage / world.a.run / "weights" / "first", world.a.run)
            world.outside = world.first_outside = files_outside(root, storage)
            world.protected = _protected(world)
            world.watch = OutsideWatch(root, storage)
            yield world
            world.watch.stop()
    finally:
        routes.LONG_POLL_S = long_poll
        app.app.state.serve.close()


def _texts(world: World, req: Req) -> tuple[int, list[str], bool]:
    """Send ``req``; (status, every body it led to, whether it was refused). A queued call is polled to its
    outcome, which counts as refused when it failed; a failure of the server's own (category "server") is
    reported as a 500."""
    answer = _send(world.client, req)
    texts = [answer.text]
    status, refused = answer.status_code, 400 <= answer.status_code < 500
    queued = (status == 200 and req.path != "/retrieve_future" and "application/json" in answer.headers.get(
        "content-type", "") and isinstance(answer.json(), dict) and "request_id" in answer.json())
    if queued:
        polled_status, polled = _poll(world.client, answer.json()["request_id"], req.key)
        texts.append(polled)
        outcome = json.loads(polled) if polled_status == 200 and polled.startswith("{") else {}
        refused = 400 <= polled_status < 500 or "error" in outcome
        if polled_status >= 500 or outcome.get("category") == "server":
            status = 500
    elif status == 200 and req.path == "/retrieve_future" and answer.text.startswith("{"):
        refused = "error" in answer.json()
    return status, texts, refused


def _check(world: World, case: Case, req: Req) -> None:
    world.watch.take()
    world.watch.on = True
    try:
        status, texts, refused = _texts(world, req)
    finally:
        world.watch.on = False
    sent = req.text()
    shown = " | ".join(text[:400] for text in texts)
    assert status < 500, f"{case.name}: {status}: {shown}"
    for text in texts:
        assert TRACEBACK not in text, f"{case.name}: a traceback: {shown}"
        assert str(world.storage) not in text, f"{case.name}: names the storage folder: {shown}"
        for folder in {str(world.root), str(world.root.resolve())}:
            assert folder not in text or folder in sent, f"{case.name}: names a folder of the server: {shown}"
        assert CANARY_SECRET not in text, f"{case.name}: the canary run was read: {shown}"
        assert "canary-run" not in text or "canary-run" in sent, f"{case.name}: the canary run was listed: {shown}"
        others = [world.a] if case.caller_is_b else [world.b] if req.key == KEY_A else [world.a, world.b]
        assert not [t for t in others if t.secret in text], f"{case.name}: another tenant's run record: {shown}"
        if 200 <= status < 300:  # the other tenant's ids in an answer that succeeded (not echoed from the request)
            leaked = [m for t in others for m in t.markers() if m and m in text and m not in sent]
            assert not leaked, f"{case.name}: another tenant's {leaked} in {shown}"
    touched = world.watch.take()
    assert not touched, f"{case.name}: touched files outside the storage: {touched[:3]}"
    outside, protected = files_outside(world.root, world.storage), _protected(world)
    changed = sorted(name for name in outside.keys() | world.outside.keys()
                     if outside.get(name) != world.outside.get(name))
    world.outside, world.protected, before = outside, protected, world.protected  # the next case starts afresh
    assert not changed, f"{case.name}: changed files outside the storage: {changed}"
    assert protected == before, f"{case.name}: changed a tenant's checkpoint"
    if case.expect == "refused":
        assert refused, f"{case.name}: not refused: {status}: {shown}"
    elif case.expect != "any":
        assert status == int(case.expect), f"{case.name}: {status}, not {case.expect}: {shown}"


# -- paths --------------------------------------------------------------------------------------------------------
# (id, the value, how it is written in a URL: None = percent-encoded whole, so a '/' in it stays one segment)
FORMS = [
    ("dotdot", "..", "%2E%2E"), ("encoded-dotdot", "%2e%2e", "%2e%2e"), ("dot-slash", "./x", None),
    ("absolute-canary", CANARY_ABS, None), ("absolute-etc", "/etc", None), ("slash", "a/b", None),
    ("slash-raw", "a/b", "a/b"), ("backslash", "..\\..\\canary-run", None), ("nul", "a\x00b", None),
    ("newline", "a\nb", None), ("long-name", "x" * 300, None), ("long-id", "r" * 4000, None),
    ("rtl-override", "\u202etsrif", None), ("fullwidth-dots", "\uff0e\uff0e", None),
    ("symlink-run", "linked", None), ("symlink-checkpoint", "escape", None), ("linked-files", "linkfiles", None),
    ("linked-record", "linkrecord", None), ("linked-kind", "op-run", None), ("hidden", ".hidden", None),
    ("empty", "", None),
]
# plain names (they may name a checkpoint inside the storage): a save of one may succeed
PLAIN = {"encoded-dotdot", "fullwidth-dots", "linked-files", "symlink-run", "symlink-checkpoint", "linked-record",
         "linked-kind"}


def _value(world: World, value: str) -> str:
    return str(world.canary) if value == CANARY_ABS else value


def _segment(world: World, value: str, url: str | None) -> str:
    return url if url is not None else quote(_value(world, value), safe="")


def _path_routes() -> list[tuple[str, Callable[[World, str, str], Req]]]:
    """(route id, build(world, value, url segment)): each hostile value in one place of one route of A's. The
    names go into A's run, where the links and the hidden copy are planted (a sampler is made of either kind)."""
    def seq_body(w: World, kind, **fields) -> dict:
        return kind(model_id=w.a.model, seq_id=w.seq(w.a.model), **fields).model_dump(mode="json")

    def sampler(w: World, path: str) -> dict:
        return types.CreateSamplingSessionRequest(session_id=w.a.session, sampling_session_seq_id=next(
            w.sampler_seq), model_path=path).model_dump(mode="json")

    return [
        ("weights_info-run", lambda w, v, u: Req("POST", "/weights_info",
                                                 {"tinker_path": f"tinker://{v}/weights/first"})),
        ("weights_info-name", lambda w, v, u: Req("POST", "/weights_info",
                                                  {"tinker_path": f"tinker://{w.a.run}/weights/{v}"})),
        ("training_run", lambda w, v, u: Req("GET", f"/training_runs/{u}")),
        ("run_checkpoints", lambda w, v, u: Req("GET", f"/training_runs/{u}/checkpoints")),
        ("ttl-name", lambda w, v, u: Req("PUT", f"/training_runs/{w.a.run}/checkpoints/weights/{u}/ttl",
                                         {"ttl_seconds": 7200})),
        ("load_weights-name", lambda w, v, u: Req("POST", "/load_weights", seq_body(
            w, types.LoadWeightsRequest, path=f"tinker://{w.a.run}/weights/{v}", optimizer=False))),
        ("load_weights-run", lambda w, v, u: Req("POST", "/load_weights", seq_body(
            w, types.LoadWeightsRequest, path=f"tinker://{v}/weights/first", optimizer=True))),
        ("load_new-name", lambda w, v, u: Req("POST", "/load_weights", types.LoadWeightsRequest(
            session_id=w.a.session, model_seq_id=next(w.sampler_seq), path=f"tinker://{w.a.run}/weights/{v}",
            optimizer=False).model_dump(mode="json"))),
        ("sampling-name", lambda w, v, u: Req("POST", "/create_sampling_session", sampler(
            w, f"tinker://{w.a.run}/weights/{v}"))),
        ("sampling-run", lambda w, v, u: Req("POST", "/create_sampling_session", sampler(
            w, f"tinker://{v}/sampler_weights/first"))),
        ("delete-run", lambda w, v, u: Req("DELETE", f"/training_runs/{u}/checkpoints/weights/first")),
        ("delete-name", lambda w, v, u: Req("DELETE", f"/training_runs/{w.a.run}/checkpoints/weights/{u}")),
        ("save_weights", lambda w, v, u: Req("POST", "/save_weights", seq_body(w, types.SaveWeightsRequest, path=v))),
        ("save_for_sampler", lambda w, v, u: Req("POST", "/save_weights_for_sampler", seq_body(
            w, types.SaveWeightsForSamplerRequest, path=v))),
    ]


def _path_cases() -> list[Case]:
    cases = []
    for route, build in _path_routes():  # deletions and saves last: they may remove or replace what a name names
        for form, value, url in FORMS:
            # a plain name may be saved; weights_info reads the run's record, not the checkpoint's folder; op-run
            # is an operator's run (its linked sampler_weights left out)
            lenient = route.startswith(("save", "weights_info"))
            operators = route in ("training_run", "run_checkpoints") and form == "linked-kind"
            expect = "any" if lenient and form in PLAIN or operators else "refused"
            cases.append(Case(f"path-{route}-{form}", lambda w, b=build, v=value, u=url: b(
                w, _value(w, v), _segment(w, v, u)), expect))
    cases += [
        Case("path-load_weights-other-layout", lambda w: Req("POST", "/load_weights", types.LoadWeightsRequest(
            model_id=w.a.other_layout, seq_id=w.seq(w.a.other_layout), path=w.a.path, optimizer=True).model_dump(
            mode="json"))),
        Case("path-sampling-training-checkpoint", lambda w: Req("POST", "/create_sampling_session",
                                                                types.CreateSamplingSessionRequest(
                                                                    session_id=w.a.session,
                                                                    sampling_session_seq_id=next(w.sampler_seq),
                                                                    model_path=w.a.path).model_dump(mode="json")),
             "any"),
        Case("path-weights_info-not-tinker", lambda w: Req("POST", "/weights_info", {
            "tinker_path": f"file://{w.canary}/weights/first"})),
        Case("path-weights_info-upper-scheme", lambda w: Req("POST", "/weights_info", {
            "tinker_path": w.a.path.replace("tinker://", "TINKER://")})),
        Case("path-weights_info-unknown-kind", lambda w: Req("POST", "/weights_info", {
            "tinker_path": f"tinker://{w.a.run}/../first"})),
        Case("path-weights_info-extra-segment", lambda w: Req("POST", "/weights_info", {
            "tinker_path": w.a.path + "/adapter_model.safetensors"})),
        Case("path-delete-kind-dotdot", lambda w: Req("DELETE", f"/training_runs/{w.a.run}/checkpoints/%2E%2E/first")),
    ]
    return cases


# -- tenants: B on A's runs, checkpoints, models, samplers and request ids (and A on B's, a few) ------------------
def _fb_proto(model_id: str, seq_id: int, tokens: list[int] | None = None) -> bytes:
    tokens = tokens or [1, 2, 3, 4]
    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={
        "target_tokens": types.TensorData(data=tokens[1:], dtype="int64"),
        "weights": types.TensorData(data=[1.0] * (len(tokens) - 1), dtype="float32")})
    request = types.ForwardBackwardRequest(forward_backward_input=types.ForwardBackwardInput(
        data=[datum], loss_fn="cross_entropy"), model_id=model_id, seq_id=seq_id)
    return request_conv.forward_backward_request_to_proto(request).SerializeToString()


def _tenant_cases() -> list[Case]:
    def b_session(w: World) -> str:
        return w.b.session

    def as_b(name: str, build: Callable[[World], Req], expect: str = "refused") -> Case:
        return Case(f"tenant-b-{name}", lambda w: replace(build(w), key=KEY_B), expect, caller_is_b=True)

    ckpt = "checkpoints/weights/first"
    cases = [
        as_b("training_run-by-run", lambda w: Req("GET", f"/training_runs/{w.a.run}")),
        as_b("training_run-by-model-id", lambda w: Req("GET", f"/training_runs/{quote(w.a.model)}")),
        as_b("checkpoints-by-run", lambda w: Req("GET", f"/training_runs/{w.a.run}/checkpoints")),
        as_b("checkpoints-by-model-id", lambda w: Req("GET", f"/training_runs/{w.a.model}/checkpoints")),
        as_b("list-runs", lambda w: Req("GET", "/training_runs?limit=1000"), "200"),
        as_b("list-checkpoints", lambda w: Req("GET", "/checkpoints?limit=1000"), "200"),
        as_b("list-runs-offset", lambda w: Req("GET", "/training_runs?limit=5&offset=1"), "200"),
        as_b("status", lambda w: Req("GET", "/rlrunbook/status"), "200"),
        as_b("weights_info-by-path", lambda w: Req("POST", "/weights_info", {"tinker_path": w.a.path})),
        as_b("weights_info-sampler-path", lambda w: Req("POST", "/weights_info", {"tinker_path": w.a.sampler_path})),
        as_b("weights_info-by-model-id", lambda w: Req("POST", "/weights_info",
                                                       {"tinker_path": f"tinker://{w.a.model}/weights/first"})),
        as_b("delete-by-run", lambda w: Req("DELETE", f"/training_runs/{w.a.run}/{ckpt}")),
        as_b("delete-by-model-id", lambda w: Req("DELETE", f"/training_runs/{w.a.model}/{ckpt}")),
        as_b("delete-sampler-weights", lambda w: Req("DELETE",
                                                     f"/training_runs/{w.a.run}/checkpoints/sampler_weights/samp")),
        as_b("ttl-by-run", lambda w: Req("PUT", f"/training_runs/{w.a.run}/{ckpt}/ttl", {"ttl_seconds": 3600})),
        as_b("ttl-by-model-id", lambda w: Req("PUT", f"/training_runs/{w.a.model}/{ckpt}/ttl",
                                              {"ttl_seconds": None})),
        as_b("load-into-own-model", lambda w: Req("POST", "/load_weights", types.LoadWeightsRequest(
            model_id=w.b.model, seq_id=w.seq(w.b.model), path=w.a.path, optimizer=True).model_dump(mode="json"))),
        as_b("load-new-model", lambda w: Req("POST", "/load_weights", types.LoadWeightsRequest(
            session_id=b_session(w), model_seq_id=50, path=w.a.path, optimizer=False).model_dump(mode="json"))),
        as_b("load-by-model-id-path", lambda w: Req("POST", "/load_weights", types.LoadWeightsRequest(
            model_id=w.b.model, seq_id=w.seq(w.b.model), path=f"tinker://{w.a.model}/weights/first",
            optimizer=False).model_dump(mode="json"))),
        as_b("load-into-a-model", lambda w: Req("POST", "/load_weights", types.LoadWeightsRequest(
            model_id=w.a.model, seq_id=w.seq(w.a.model), path=w.b.path, optimizer=False).model_dump(mode="json"))),
        as_b("load-in-a-session", lambda w: Req("POST", "/load_weights", types.LoadWeightsRequest(
            session_id=w.a.session, model_seq_id=51, path=w.b.path, optimizer=False).model_dump(mode="json"))),
        as_b("sample-a-path", lambda w: Req("POST", "/create_sampling_session", types.CreateSamplingSessionRequest(
            session_id=b_session(w), sampling_session_seq_id=next(w.sampler_seq),
            model_path=w.a.sampler_path).model_dump(mode="json"))),
        as_b("sample-a-weights-path", lambda w: Req("POST", "/create_sampling_session",
                                                    types.CreateSamplingSessionRequest(
                                                        session_id=b_session(w), sampling_session_seq_id=next(
                                                            w.sampler_seq), model_path=w.a.path).model_dump(
                                                        mode="json"))),
        as_b("sampler-in-a-session", lambda w: Req("POST", "/create_sampling_session",
                                                   types.CreateSamplingSessionRequest(
                                                       session_id=w.a.session, sampling_session_seq_id=next(
                                                           w.sampler_seq), base_model="tiny").model_dump(
                                                       mode="json"))),
        as_b("sampler-info", lambda w: Req("GET", f"/samplers/{quote(w.a.sampler)}")),
        as_b("asample-a-sampler", lambda w: Req("POST", "/asample", types.SampleRequest(
            sampling_session_id=w.a.sampler, seq_id=1, num_samples=1, prompt=types.ModelInput.from_ints([1, 2]),
            sampling_params=types.SamplingParams(max_tokens=2)).model_dump(mode="json"))),
        as_b("retrieve-a-request", lambda w: Req("POST", "/retrieve_future", {"request_id": w.a.request})),
        as_b("save-a-model", lambda w: Req("POST", "/save_weights", types.SaveWeightsRequest(
            model_id=w.a.model, path="stolen", seq_id=w.seq(w.a.model)).model_dump(mode="json"))),
        as_b("save-sampler-a-model", lambda w: Req("POST", "/save_weights_for_sampler",
                                                   types.SaveWeightsForSamplerRequest(
                                                       model_id=w.a.model, sampling_session_seq_id=900,
                                                       seq_id=w.seq(w.a.model)).model_dump(mode="json"))),
        as_b("get_info-a-model", lambda w: Req("POST", "/get_info", {"model_id": w.a.model})),
        as_b("optim_step-a-model", lambda w: Req("POST", "/optim_step", types.OptimStepRequest(
            model_id=w.a.model, seq_id=w.seq(w.a.model), optim_params=types.AdamParams(learning_rate=1.0)).model_dump(
            mode="json"))),
        as_b("forward_backward-a-model", lambda w: Req("POST", "/forward_backward", _fb_proto(
            w.a.model, w.seq(w.a.model)))),
        as_b("create_model-a-session", lambda w: Req("POST", "/create_model", types.CreateModelRequest(
            session_id=w.a.session, model_seq_id=52, base_model="tiny").model_dump(mode="json"))),
        as_b("heartbeat-a-session", lambda w: Req("POST", "/session_heartbeat", {"session_id": w.a.session})),
        as_b("finish-a-session", lambda w: Req("POST", f"/sessions/{w.a.session}/finish", {})),
        as_b("session-of-a", lambda w: Req("GET", f"/sessions/{w.a.session}")),
        as_b("project-of-a-session", lambda w: Req("PUT", f"/sessions/{w.a.session}/project",
                                                   {"project_id": "taken"})),
        as_b("search-a-session-id", lambda w: Req("POST", "/sessions/search", {"session_id": w.a.session}), "200"),
        as_b("search-everything", lambda w: Req("POST", "/sessions/search", {"owner": {"type": "accessible"}}), "200"),
        as_b("search-a-owner", lambda w: Req("POST", "/sessions/search", {"owner": {
            "type": "user", "owner_urns": ["rlrunbook:" + w.a.key[:4], "rlrunbook:open"]}}), "200"),
        as_b("storage-usage", lambda w: Req("GET", "/billing/usage/checkpoints/current"), "200"),
        as_b("storage-usage-of-a-project", lambda w: Req("GET", "/billing/usage/checkpoints/current?project_id="
                                                              "default"), "200"),
        as_b("whoami", lambda w: Req("GET", "/auth/apikey/me"), "200"),
    ]
    cases += [
        Case("tenant-a-training_run-of-b", lambda w: Req("GET", f"/training_runs/{w.b.run}")),
        Case("tenant-a-weights_info-of-b", lambda w: Req("POST", "/weights_info", {"tinker_path": w.b.path})),
        Case("tenant-a-retrieve-b-request", lambda w: Req("POST", "/retrieve_future", {"request_id": w.b.request})),
        Case("tenant-a-sampler-of-b", lambda w: Req("GET", f"/samplers/{quote(w.b.sampler)}")),
        Case("tenant-a-delete-b", lambda w: Req("DELETE",
                                                f"/training_runs/{w.b.run}/checkpoints/sampler_weights/samp")),
        Case("tenant-a-list-runs", lambda w: Req("GET", "/training_runs?limit=1000"), "200"),
        Case("tenant-a-list-checkpoints", lambda w: Req("GET", "/checkpoints"), "200"),
    ]
    return cases


# -- headers and keys ---------------------------------------------------------------------------------------------
def _key_cases() -> list[Case]:
    keys = [("no-key", NO_KEY), ("empty-key", ""), ("wrong-key", "tml-wrong-key-0000"),
            ("a-key-prefix", KEY_A[:-1]), ("a-key-longer", KEY_A + "x"), ("a-key-upper", KEY_A.upper()),
            ("a-key-spaced", " " + KEY_A), ("long-key", "tml-" + "k" * 100_000),
            ("latin1-key", b"tml-\xff\xfe\xfd-key")]
    targets = [("training_run", lambda w: Req("GET", f"/training_runs/{w.a.run}")),
               ("delete", lambda w: Req("DELETE", f"/training_runs/{w.a.run}/checkpoints/weights/first")),
               ("retrieve", lambda w: Req("POST", "/retrieve_future", {"request_id": w.a.request}))]
    cases = [Case(f"key-{name}-{target}", lambda w, k=key, b=build: replace(b(w), key=k), "401")
             for name, key in keys for target, build in targets]
    cases += [
        Case("key-bearer-instead", lambda w: Req("GET", "/training_runs", key=NO_KEY,
                                                 headers=(("Authorization", f"Bearer {KEY_A}"),)), "401"),
        Case("key-no-key-healthz-trailing-slash", lambda w: Req("GET", "/healthz/", key=NO_KEY), "401"),
        Case("key-no-key-healthz-dotdot", lambda w: Req("GET", "/healthz%2F..%2Ftraining_runs", key=NO_KEY), "401"),
        Case("key-no-key-status", lambda w: Req("GET", "/rlrunbook/status", key=NO_KEY), "401"),
        Case("key-no-key-unknown-route", lambda w: Req("GET", "/nope", key=NO_KEY), "401"),
        Case("key-no-key-create_session", lambda w: Req("POST", "/create_session", {
            "tags": [], "user_metadata": {}, "sdk_version": "x"}, key=NO_KEY), "401"),
        Case("key-long-header-other", lambda w: Req("GET", "/healthz", headers=(("X-Junk", "j" * 200_000),)), "200"),
    ]
    return cases


# -- unknown routes and methods -----------------------------------------------------------------------------------
def _route_cases() -> list[Case]:
    unknown = [("GET", "/nope"), ("POST", "/nope"), ("GET", "//"), ("GET", "//docs"), ("GET", "//openapi.json"),
               ("GET", "//api/v2/training_runs"), ("POST", "/training_runs"), ("PATCH", "/create_session"),
               ("PUT", "/weights_info"), ("DELETE", "/training_runs"), ("GET", "/create_model"),
               ("OPTIONS", "/training_runs"), ("HEAD", "/nope"), ("TRACE", "/training_runs"), ("FOO", "/healthz"),
               ("GET", "/%2E%2E/%2E%2E/etc/passwd"), ("GET", "/" + "x" * 60_000),
               ("GET", "/training_runs/%00"), ("GET", "/checkpoints/weights/first"),
               ("POST", "/sessions/%2E%2E/finish"), ("GET", "/samplers/%2E%2E%2F%2E%2E")]
    cases = [Case(f"route-{method}-{path[:40]}", lambda w, m=method, p=path: Req(m, p), "refused")
             for method, path in unknown]
    queries = [("limit-negative", "limit=-1"), ("limit-text", "limit=abc"), ("limit-huge", "limit=" + "9" * 5000),
               ("limit-superscript", "limit=%C2%B2"), ("offset-huge", "offset=" + "9" * 400),
               ("limit-arabic-digit", "limit=%D9%A3")]
    cases += [Case(f"route-query-{name}", lambda w, q=query: Req("GET", f"/training_runs?{q}"), "any")
              for name, query in queries]
    cases.append(Case("route-delete-a-run", lambda w: Req("DELETE", f"/training_runs/{w.a.run}")))
    cases.append(Case("route-delete-kind-dotdot", lambda w: Req(
        "DELETE", f"/training_runs/{w.a.run}/checkpoints/%2E%2E/{w.a.run}")))
    return cases


# -- bodies -------------------------------------------------------------------------------------------------------
RAW = [("not-json", b"this is not json"), ("not-utf8", b"\xff\xfe\xfa{}"), ("empty", b""), ("null", b"null"),
       ("list", b"[]"), ("string", b'"x"'), ("nested-lists", b"[" * 100_000 + b"]" * 100_000),
       ("nested-objects", b'{"a":' * 50_000 + b"1" + b"}" * 50_000), ("huge-int", b"9" * 10_000),
       ("truncated", b'{"model_id": "x", "path": '), ("nan", b"NaN")]
RAW_ROUTES = ["/create_session", "/create_model", "/save_weights", "/load_weights", "/create_sampling_session",
              "/asample", "/optim_step", "/retrieve_future", "/weights_info", "/forward_backward"]


def _body_builders() -> dict[str, Callable[[World], dict]]:
    """A valid body of each request type, on A's scratch model (a refused seq_id leaves a gap there only)."""
    return {
        "save_weights": lambda w: types.SaveWeightsRequest(model_id=w.a.scratch, path="body-ok",
                                                           seq_id=w.seq(w.a.scratch)).model_dump(mode="json"),
        "create_model": lambda w: types.CreateModelRequest(session_id=w.a.session, model_seq_id=next(w.sampler_seq),
                                                           base_model="tiny", lora_config=types.LoraConfig(
                                                               rank=2)).model_dump(mode="json"),
        "create_sampling_session": lambda w: types.CreateSamplingSessionRequest(
            session_id=w.a.session, sampling_session_seq_id=next(w.sampler_seq), base_model="tiny").model_dump(
            mode="json"),
        "asample": lambda w: types.SampleRequest(
            sampling_session_id=w.a.sampler, seq_id=next(w.sampler_seq), num_samples=1,
            prompt=types.ModelInput.from_ints([1, 2]), sampling_params=types.SamplingParams(max_tokens=2)).model_dump(
            mode="json"),
        "optim_step": lambda w: types.OptimStepRequest(model_id=w.a.scratch, seq_id=w.seq(w.a.scratch),
                                                       optim_params=types.AdamParams(learning_rate=1e-4)).model_dump(
            mode="json"),
        "load_weights": lambda w: types.LoadWeightsRequest(model_id=w.a.scratch, seq_id=w.seq(w.a.scratch),
                                                           path=w.a.path, optimizer=False).model_dump(mode="json"),
        "sessions/search": lambda w: {"display_name": "x", "limit": 5, "owner": {"type": "own"}, "cursor": {
            "last_created_at": "2026-11-28T00:00:00Z", "last_session_id": w.a.session}},
    }


# (request type, field path, value): each sent in an otherwise valid body; the outcome must be a refusal (but for
# NAMING_NUMBERS)
WRONG = [
    ("save_weights", "model_id", 123), ("save_weights", "model_id", None), ("save_weights", "path", ["x"]),
    ("save_weights", "path", {"$ne": 1}), ("save_weights", "seq_id", "abc"), ("save_weights", "seq_id", 1.5),
    ("save_weights", "seq_id", -1), ("save_weights", "seq_id", 10 ** 400), ("save_weights", "seq_id", 2 ** 63),
    ("save_weights", "seq_id", 2 ** 64), ("save_weights", "ttl_seconds", "soon"), ("save_weights", "ttl_seconds", 1),
    ("save_weights", "ttl_seconds", 10 ** 30), ("save_weights", "overwrite", [1]),
    ("save_weights", "user_metadata", "text"), ("save_weights", "user_metadata", {"k": {"deep": 1}}),
    ("save_weights", "type", "optim_step"),
    ("create_model", "session_id", 5), ("create_model", "model_seq_id", "x"), ("create_model", "model_seq_id", -5),
    ("create_model", "model_seq_id", 10 ** 400), ("create_model", "base_model", ["tiny"]),
    ("create_model", "base_model", "no-such-model"),
    ("create_model", "lora_config", "big"), ("create_model", "lora_config.rank", "x"),
    ("create_model", "lora_config.rank", 0), ("create_model", "lora_config.rank", -4),
    ("create_model", "lora_config.rank", 2 ** 40), ("create_model", "lora_config.seed", 2 ** 80),
    ("create_sampling_session", "sampling_session_seq_id", "x"),
    ("create_sampling_session", "sampling_session_seq_id", 10 ** 400),
    ("create_sampling_session", "sampling_session_seq_id", -3), ("create_sampling_session", "base_model", None),
    ("create_sampling_session", "model_path", 7),
    ("asample", "num_samples", "many"), ("asample", "num_samples", 10 ** 9), ("asample", "num_samples", -1),
    ("asample", "prompt", "text"), ("asample", "prompt.chunks", [{"type": "encoded_text", "tokens": [10 ** 12]}]),
    ("asample", "prompt.chunks", [{"type": "encoded_text", "tokens": [-7]}]),
    ("asample", "sampling_params", 3), ("asample", "sampling_params.max_tokens", 10 ** 12),
    ("asample", "sampling_params.max_tokens", -1), ("asample", "sampling_params.temperature", "hot"),
    ("asample", "seq_id", 10 ** 400), ("asample", "topk_prompt_logprobs", 10 ** 9),
    ("optim_step", "adam_params", "adam"), ("optim_step", "adam_params.beta1", "NaN"),
    ("optim_step", "adam_params.beta2", "Infinity"), ("optim_step", "adam_params.eps", "-Infinity"),
    ("optim_step", "adam_params.weight_decay", "NaN"), ("optim_step", "adam_params.grad_clip_norm", "Infinity"),
    ("optim_step", "adam_params.learning_rate", "1e400"), ("optim_step", "adam_params.learning_rate", "true"),
    ("load_weights", "path", 5), ("load_weights", "optimizer", "maybe"), ("load_weights", "path", None),
    ("load_weights", "seq_id", 10 ** 400),
    ("sessions/search", "limit", 0), ("sessions/search", "limit", 10 ** 9), ("sessions/search", "cursor", "x"),
    ("sessions/search", "cursor.last_created_at", "yesterday"),
    ("sessions/search", "cursor.last_created_at", "2026-11-28T00:00:00"),  # no time zone
    ("sessions/search", "owner.type", "admin"), ("sessions/search", "statuses", []),
    ("sessions/search", "statuses", [{"type": "client_finished", "reasons": ["bored"]}]),
    ("sessions/search", "display_name", ""), ("sessions/search", "project_ids", "p"),
    ("sessions/search", "project_ids", ["never-used"]), ("sessions/search", "user_metadata", {"k": 1}),
    ("sessions/search", "owner", {"type": "user", "owner_urns": []}),
]
MISSING = [("save_weights", "model_id"), ("create_model", "base_model"), ("create_model", "session_id"),
           ("create_sampling_session", "session_id"), ("asample", "prompt"), ("optim_step", "adam_params"),
           ("load_weights", "path")]
# numbers that only name what the caller creates ("<session>:train:<n>"): any int is a name of its own
NAMING_NUMBERS = {("create_model", "model_seq_id"), ("create_sampling_session", "sampling_session_seq_id")}
DEFECTS: dict = {}  # (route, field, repr(value)) -> a known defect: its case is xfail(strict=True)
JSON_LITERALS = {"NaN", "Infinity", "-Infinity", "1e400", "true"}  # sent as JSON tokens, not strings


def _with(body: dict, where: str, value) -> dict:
    body = json.loads(json.dumps(body))
    *parents, last = where.split(".")
    target = body
    for name in parents:
        target = target[name]
    target[last] = value
    return body


def _raw_with(body: dict, where: str, value) -> bytes | dict:
    if isinstance(value, str) and value in JSON_LITERALS:
        marker = "__literal__"
        return json.dumps(_with(body, where, marker)).replace(f'"{marker}"', value).encode()
    return _with(body, where, value)


def _body_cases() -> list[Case]:
    builders = _body_builders()
    cases = [Case(f"body-{route[1:]}-{name}", lambda w, r=route, raw=raw: Req("POST", r, raw))
             for route in RAW_ROUTES for name, raw in RAW]
    for kind, where, value in WRONG:
        shown = repr(value) if len(repr(value)) <= 24 else f"{type(value).__name__}-{len(repr(value))}"
        cases.append(Case(f"body-{kind}-{where}={shown}", lambda w, k=kind, f=where, v=value: Req(
            "POST", f"/{k}", _raw_with(builders[k](w), f, v)), "any" if (kind, where) in NAMING_NUMBERS else "refused",
            defect=DEFECTS.get((kind, where, repr(value)), "")))
    cases += [Case(f"body-{kind}-missing-{where}", lambda w, k=kind, f=where: Req(
        "POST", f"/{k}", {name: v for name, v in builders[k](w).items() if name != f})) for kind, where in MISSING]
    cases += [Case(f"body-{kind}-extra-field", lambda w, k=kind: Req("POST", f"/{k}", {**builders[k](w),
                                                                                       "__proto__": {"x": 1}}))
              for kind in builders]
    cases += [
        Case("body-weights_info-extra-field", lambda w: Req("POST", "/weights_info", {"tinker_path": w.a.path,
                                                                                      "as": "admin"})),
        Case("body-weights_info-path-number", lambda w: Req("POST", "/weights_info", {"tinker_path": 1e308})),
        Case("body-weights_info-nested-in-field", lambda w: Req("POST", "/weights_info", b'{"tinker_path": ' +
                                                                b"[" * 100_000 + b"]" * 100_000 + b"}")),
        Case("body-ttl-not-int", lambda w: Req("PUT", f"/training_runs/{w.a.run}/checkpoints/weights/first/ttl",
                                               {"ttl_seconds": "1h"})),
        Case("body-ttl-nan", lambda w: Req("PUT", f"/training_runs/{w.a.run}/checkpoints/weights/first/ttl",
                                           b'{"ttl_seconds": NaN}')),
        Case("body-ttl-huge", lambda w: Req("PUT", f"/training_runs/{w.a.run}/checkpoints/weights/first/ttl",
                                            {"ttl_seconds": 10 ** 300})),
        Case("body-ttl-missing", lambda w: Req("PUT", f"/training_runs/{w.a.run}/checkpoints/weights/first/ttl",
                                               {})),
        Case("body-heartbeat-wrong-type", lambda w: Req("POST", "/session_heartbeat", {"session_id": ["x"]})),
        Case("body-finish-unknown-session", lambda w: Req("POST", "/sessions/session-nope/finish", b"\xff")),
        Case("body-over-limit-declared", lambda w: Req("POST", "/create_session", b"{" + b" " * MAX_BODY + b"}"),
             "413"),
        Case("body-over-limit-chunked", lambda w: Req("POST", "/create_session", b"{" + b" " * MAX_BODY + b"}",
                                                      chunked=True), "413"),
        Case("body-over-limit-telemetry-chunked", lambda w: Req("POST", "/telemetry", b"x" * (MAX_BODY + 1),
                                                                chunked=True), "413"),
        Case("body-over-limit-forward_backward", lambda w: Req("POST", "/forward_backward", b"\x00" * (MAX_BODY + 1),
                                                               chunked=True), "413"),
        Case("body-form-encoded", lambda w: Req("POST", "/weights_info", b"tinker_path=..%2F..%2Fcanary-run",
                                                headers=(("content-type", "application/x-www-form-urlencoded"),))),
        Case("body-content-length-not-a-number", lambda w: Req("POST", "/weights_info", {"tinker_path": w.a.path},
                                                               headers=(("content-length", "12abc"),))),
        Case("body-fb-garbage-proto", lambda w: Req("POST", "/forward_backward", b"\x0a\xff\xff\xff\xff\x0f")),
        Case("body-fb-token-out-of-vocab", lambda w: Req("POST", "/forward_backward", _fb_proto(
            w.a.scratch, w.seq(w.a.scratch), [1, 2, 10 ** 9, 3]))),
        Case("body-fb-negative-token", lambda w: Req("POST", "/forward_backward", _fb_proto(
            w.a.scratch, w.seq(w.a.scratch), [1, -5, 2]))),
        Case("body-fb-seq-zero", lambda w: Req("POST", "/forward_backward", _fb_proto(w.a.scratch, 0))),
        Case("body-fb-seq-negative", lambda w: Req("POST", "/forward_backward", _fb_proto(w.a.scratch, -2 ** 31))),
        Case("body-fb-unknown-model", lambda w: Req("POST", "/forward_backward", _fb_proto("../../canary-run", 1))),
    ]
    return cases


CASES = _path_cases() + _tenant_cases() + _key_cases() + _route_cases() + _body_cases()


@pytest.mark.parametrize("case", [case.param() for case in CASES])
def test_a_hostile_request_is_answered_safely(world, case):
    _check(world, case, case.build(world))


def test_the_server_still_serves_both_tenants_and_nothing_outside_changed(world):
    """After every case: each tenant creates a model, saves, lists its checkpoint; the first models still work
    (B's attempt to finish A's session ended nothing); listings hold no canary, link or hidden folder."""
    client = world.client
    assert files_outside(world.root, world.storage) == world.first_outside
    assert _protected(world) == world.protected
    world.watch.take()
    world.watch.on = True
    for tenant in (world.a, world.b):
        session = _session(client, tenant.key)
        model = _create_model(world, tenant.key, session, 0, tenant.secret)
        path = _save(world, tenant.key, model, "after")
        run = path.split("/")[2]
        listed = client.get(f"{API}/training_runs/{run}/checkpoints", headers={"X-API-Key": tenant.key})
        assert listed.status_code == 200 and path in {c["tinker_path"] for c in listed.json()["checkpoints"]}
        assert _save(world, tenant.key, tenant.model, "still-mine").endswith("/weights/still-mine")
        everything = client.get(f"{API}/checkpoints?limit=1000", headers={"X-API-Key": tenant.key}).json()
        paths = {c["tinker_path"] for c in everything["checkpoints"]}
        assert tenant.path in paths
        for listed in paths:  # each a plain folder inside the storage, no link out in it
            folder = world.storage / listed[len("tinker://"):]
            assert not folder.name.startswith(".") and not folder.is_symlink(), listed
            assert all(not f.is_symlink() for f in folder.iterdir()), listed
        runs = client.get(f"{API}/training_runs?limit=1000", headers={"X-API-Key": tenant.key}).json()
        ids = {r["training_run_id"] for r in runs["training_runs"]}
        assert not ids & {"linked", "linkrecord", "canary-run", ".."}, ids
        other = world.b if tenant is world.a else world.a
        assert other.run not in ids
    world.watch.on = False
    assert not world.watch.take()
    assert files_outside(world.root, world.storage) == world.first_outside
