"""What the server holds: sessions, training models and samplers, each mapped onto the local backend.

One :class:`~rlrunbook.backend.LocalServiceClient` serves every client: each training model the SDK creates
(``"{session_id}:train:{model_seq_id}"``) is a ``LocalTrainingClient`` of its own (its own LoRA adapter, AdamW
state and engine over the one resident copy of its base model) and each sampling session a
``LocalSamplingClient``. The backend's worker serves the models in turn (one lane each), so one client's queue
of calls does not hold back another's. Nothing here computes: every call is the local client's, so over the
wire and in process the same seed gives the same bits.

Each session, model and sampler belongs to the tenant (API key) that created it; an id of another tenant is
answered as unknown (404). Everything acknowledged is recorded in the store (:mod:`rlrunbook.service.store`):
after a restart on the same storage the sessions and models are known again, a model's in-memory weights are
not (its calls are refused, naming its last saved state, until ``load_state`` restores one), and every request
id answers. A session that sends no heartbeat (nor any other request) for ``session_timeout_s`` expires: its models and samplers are
released (their memory freed); its checkpoints stay.

Each method takes the SDK's own request type (``tinker.types``) and the caller's tenant, and returns the JSON
body of the response; a queued call's body carries the request id the SDK then polls
(:mod:`rlrunbook.service.futures`).
"""

from __future__ import annotations

import gc
import secrets
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from tinker import types

from rlrunbook.backend import LocalRestClient, LocalServiceClient
from rlrunbook.errors import InputError, RlrunbookError
from rlrunbook.service.futures import FutureRegistry, SeqOrder, failed
from rlrunbook.service.store import ServeStore
from rlrunbook.service.wire import ForwardBackwardCall, encode_forward_backward_output, encode_sample_response

MAX_SAMPLES_PER_REQUEST = 10_000  # sequences one sample request may ask for (each gets an id at once)
DEFAULT_SESSION_TIMEOUT_S = 300.0  # the SDK heartbeats every 10 s; five minutes of silence ends a session
RESTARTED = ("rlrunbook serve restarted while this request was pending; its result is lost. Calls of a "
             "training client made before the restart are gone with the server's memory: restore the last "
             "saved state with training_client.load_state(path) and send the call again.")


class UnknownIdError(RlrunbookError, LookupError):
    """A session, model, sampler or request id this server does not hold for the caller (HTTP 404)."""


class SessionEndedError(RlrunbookError, LookupError):
    """A heartbeat of a session that expired or finished (HTTP 410: the SDK stops its heartbeat loop)."""


class ModelRestartedError(RlrunbookError, RuntimeError):
    """A call of a model whose in-memory state a restart of the server lost."""


def dump(value: Any) -> dict:
    """The JSON body of an SDK response type."""
    return value.model_dump(mode="json")


@dataclass
class Session:
    """A ``tinker.ServiceClient`` of some process: ``create_session`` to ``sessions/{id}/finish`` or expiry."""

    session_id: str
    tenant: str
    user_metadata: dict[str, str]
    created: float = field(default_factory=time.time)
    last_heartbeat: float = field(default_factory=time.monotonic)
    status: str = "active"  # | "finished" | "expired"


@dataclass
class Model:
    """A training model: its record, the future of its local client, and the order its calls run in.

    ``status``: ``live`` (its client is, or is being, made), ``restarted`` (known from the store; its weights
    died with the previous server until ``load_state``), ``released`` (its session ended; memory freed)."""

    model_id: str
    session_id: str
    tenant: str
    base_model: str
    lora: dict[str, Any]
    order: SeqOrder
    client: Future | None = None  # of a LocalTrainingClient
    status: str = "live"
    last_saved: str | None = None
    last_seq: int = 0  # the highest seq_id accepted


@dataclass
class Sampler:
    """A sampling session: its local sampling client (made again after a restart where its weights are saved)."""

    sampler_id: str
    session_id: str
    tenant: str
    client: Any  # a LocalSamplingClient, or None until made again
    model_path: str | None
    base_model: str | None
    snapshot: bool = False  # weights held in memory only (save_weights_and_get_sampling_client)


class ServeState:
    """The server's sessions, models and samplers over one local ServiceClient (see the module docstring)."""

    def __init__(self, service: LocalServiceClient, store: ServeStore,
                 session_timeout_s: float = DEFAULT_SESSION_TIMEOUT_S):
        self.service = service
        self.store = store
        self.session_timeout_s = session_timeout_s
        self.futures = FutureRegistry(store)
        self.rest = LocalRestClient(service._store)
        self._sessions: dict[str, Session] = {}
        self._models: dict[str, Model] = {}
        self._samplers: dict[str, Sampler] = {}
        self._lock = threading.RLock()
        self._creator = ThreadPoolExecutor(max_workers=2, thread_name_prefix="rlrunbook-serve-create")
        self.restored = self._restore()

    def close(self) -> None:
        """Stop the models' threads and the local backend (after the calls already queued)."""
        for model in list(self._models.values()):
            model.order.close()
        self._creator.shutdown(wait=False, cancel_futures=True)
        self.service.close()
        self.futures.close()
        self.store.close()

    def _restore(self) -> dict[str, int]:
        """What an earlier server on this storage acknowledged: sessions, models, samplers; its pending futures
        fail (they answer that the server restarted). Sessions get a full timeout to send a heartbeat."""
        pending = self.store.fail_pending(RESTARTED)
        self.store.sweep()
        for row in self.store.sessions():
            status = row["status"]
            self._sessions[row["session_id"]] = Session(row["session_id"], row["tenant"], row["user_metadata"],
                                                        created=row["created"], status=status)
        for row in self.store.models():
            status = "restarted" if row["status"] == "live" else row["status"]
            if status != row["status"]:
                self.store.model_update(row["model_id"], status=status)
            self._models[row["model_id"]] = Model(
                row["model_id"], row["session_id"], row["tenant"], row["base_model"], row["lora"],
                SeqOrder(_thread_name(row["model_id"]), first=row["last_seq"] + 1), status=status,
                last_saved=row["last_saved"], last_seq=row["last_seq"])
        for row in self.store.samplers():
            self._samplers[row["sampler_id"]] = Sampler(row["sampler_id"], row["session_id"], row["tenant"], None,
                                                        row["model_path"], row["base_model"], row["snapshot"])
        return {"sessions": len(self._sessions), "models": len(self._models), "pending_failed": pending}

    # -- lookups (an id of another tenant is as unknown as a made-up one) -----------------------------------
    def _session(self, session_id: str, tenant: str) -> Session:
        session = self._sessions.get(session_id)
        if session is None or session.tenant != tenant:
            raise UnknownIdError(f"no session {session_id!r} on this server; create a new tinker.ServiceClient.")
        if session.status != "active":
            raise UnknownIdError(_ended(session, self.session_timeout_s))
        session.last_heartbeat = time.monotonic()  # any request of a session shows its client is alive
        return session

    def _touch(self, session_id: str) -> None:
        session = self._sessions.get(session_id)
        if session is not None and session.status == "active":
            session.last_heartbeat = time.monotonic()

    def _model(self, model_id: str, tenant: str) -> Model:
        model = self._models.get(model_id)
        if model is None or model.tenant != tenant:
            raise UnknownIdError(f"no training model {model_id!r} on this server; create one with "
                                 "ServiceClient.create_lora_training_client.")
        if model.status == "released":
            session = self._sessions.get(model.session_id)
            reason = _ended(session, self.session_timeout_s) if session is not None else "its session ended"
            raise UnknownIdError(f"training model {model_id} was released: {reason}")
        self._touch(model.session_id)
        return model

    def _sampler(self, sampler_id: str | None, tenant: str) -> Sampler:
        sampler = self._samplers.get(sampler_id or "")
        if sampler is None or sampler.tenant != tenant:
            raise UnknownIdError(f"no sampling session {sampler_id!r} on this server; create one with "
                                 "ServiceClient.create_sampling_client or save_weights_and_get_sampling_client.")
        session = self._sessions.get(sampler.session_id)
        if session is not None and session.status != "active":
            raise UnknownIdError(f"sampling session {sampler_id} was released: {_ended(session, self.session_timeout_s)}")
        self._touch(sampler.session_id)
        if sampler.client is None:
            if sampler.snapshot:
                raise UnknownIdError(f"sampling session {sampler_id} sampled weights held in the memory of a server "
                                     "that has since restarted; save weights with save_weights_for_sampler(name) "
                                     "and create a sampling client of that path.")
            with self._lock:
                if sampler.client is None:
                    client = (self.service.create_sampling_client(model_path=sampler.model_path)
                              if sampler.model_path is not None
                              else self.service.create_sampling_client(base_model=sampler.base_model))
                    sampler.client = self._seeded(client, int(sampler.sampler_id.rsplit(":", 1)[-1]))
        return sampler

    # -- sessions -----------------------------------------------------------------------------------------
    def create_session(self, request: types.CreateSessionRequest, tenant: str) -> dict:
        session = Session(session_id=f"session-{secrets.token_urlsafe(16)}", tenant=tenant,
                          user_metadata=dict(request.user_metadata or {}))
        self.store.add_session(session.session_id, tenant, session.user_metadata)
        with self._lock:
            self._sessions[session.session_id] = session
        return dump(types.CreateSessionResponse(session_id=session.session_id))

    def heartbeat(self, request: types.SessionHeartbeatRequest, tenant: str) -> dict:
        session = self._sessions.get(request.session_id)
        if session is not None and session.tenant == tenant and session.status != "active":
            raise SessionEndedError(_ended(session, self.session_timeout_s))
        session = self._session(request.session_id, tenant)
        session.last_heartbeat = time.monotonic()
        return dump(types.SessionHeartbeatResponse())

    def finish(self, session_id: str, tenant: str) -> dict:
        """The SDK's ``ServiceClient`` closed: its models and samplers are released now (checkpoints stay)."""
        self._end(self._session(session_id, tenant), "finished")
        return {}

    def expire_idle(self, now: float | None = None) -> list[str]:
        """End every active session whose last heartbeat is older than the timeout; the ids ended."""
        now = time.monotonic() if now is None else now
        idle = [s for s in list(self._sessions.values())
                if s.status == "active" and now - s.last_heartbeat > self.session_timeout_s]
        for session in idle:
            self._end(session, "expired")
        return [session.session_id for session in idle]

    def _end(self, session: Session, status: str) -> None:
        with self._lock:
            session.status = status
            models = [m for m in self._models.values() if m.session_id == session.session_id and m.status != "released"]
            samplers = [s for s in self._samplers.values() if s.session_id == session.session_id]
            for model in models:
                model.status = "released"
            for sampler in samplers:
                sampler.client = None
        self.store.set_session_status(session.session_id, status)
        for model in models:
            self.store.model_update(model.model_id, status="released")
            model.order.close()
            client = model.client
            model.client = None
            if client is not None and client.done() and client.exception() is None:
                self.service.release_training_client(client.result().model_id)
        gc.collect()  # the peft model holds reference cycles: free its adapter and caches now

    # -- training models ----------------------------------------------------------------------------------
    def _new_model(self, session_id: str, model_seq_id: int, tenant: str, base_model: str, lora: dict,
                   kind: str, create: Callable[[], Any], encode: Callable[[Any], dict]) -> dict:
        """File a model being created by ``create`` (on a creator thread); a retried request gets its first answer."""
        self._session(session_id, tenant)
        model_id = f"{session_id}:train:{model_seq_id}"
        with self._lock:
            known = self.store.call_future(model_id, kind, None)
            if known is not None:
                return {"request_id": known, "model_id": model_id}
            if model_id in self._models:
                raise InputError(f"model {model_id} exists: model_seq_id {model_seq_id} of this session is taken.")
            self.store.add_model(model_id, session_id, tenant, base_model, lora)
            model = Model(model_id, session_id, tenant, base_model, lora, SeqOrder(_thread_name(model_id)))
            model.client = self._creator.submit(self._made, model, create)
            self._models[model_id] = model
            rid = self.futures.add(model.client, encode, tenant=tenant, owner=model_id, kind=kind)
        return {"request_id": rid, "model_id": model_id}

    def _made(self, model: Model, create: Callable[[], Any]):
        client = create()
        record = self.service._store.read_run(client.model_id)  # the layout made: what a restart makes again
        model.lora = {"rank": record.lora_rank, "train_mlp": record.train_mlp, "train_attn": record.train_attn,
                      "train_unembed": record.train_unembed, "seed": model.lora.get("seed")}
        self.store.model_update(model.model_id, run_id=client.model_id, lora=model.lora)
        return client

    def create_model(self, request: types.CreateModelRequest, tenant: str) -> dict:
        lora = request.lora_config or types.LoraConfig(rank=32)
        model_id = f"{request.session_id}:train:{request.model_seq_id}"
        settings = lora.model_dump(mode="json")

        def create():
            return self.service.create_lora_training_client(
                request.base_model, rank=lora.rank, seed=lora.seed, train_mlp=lora.train_mlp,
                train_attn=lora.train_attn, train_unembed=lora.train_unembed,
                user_metadata=request.user_metadata, optimizer=request.optimizer_config)

        return self._new_model(request.session_id, request.model_seq_id, tenant, request.base_model, settings,
                               "create", create, lambda _client: dump(types.CreateModelResponse(model_id=model_id)))

    def get_info(self, request: types.GetInfoRequest, tenant: str) -> dict:
        model = self._model(request.model_id, tenant)
        if model.client is None:
            raise ModelRestartedError(_restarted(model))
        client = model.client.result()
        return dump(client.get_info().model_copy(update={"model_id": request.model_id}))

    def _sequenced(self, model_id: str, seq_id: int | None, tenant: str, call: Callable[[Any], Any],
                   encode: Callable[[Any], Any], *, restores: bool = False) -> dict:
        """Queue ``call(local training client)`` as this model's call ``seq_id``; the body names its request id.

        On a model a restart left without weights only a call that ``restores`` them runs (``call(None)``);
        the others fail naming the last saved state."""
        model = self._model(model_id, tenant)
        if seq_id is None:
            raise InputError(f"a call of model {model_id} without seq_id; the SDK numbers every call of a "
                             "training client.")
        with self._lock:
            known = self.store.call_future(model_id, "call", seq_id)
            if known is not None:
                return {"request_id": known, "model_id": model_id}

            def run():
                if model.status == "restarted" and not restores:
                    raise ModelRestartedError(_restarted(model))
                return call(None if model.status == "restarted" else model.client.result())

            future = model.order.submit(seq_id, run)
            if seq_id > model.last_seq:
                model.last_seq = seq_id
                self.store.model_update(model_id, last_seq=seq_id)
            rid = self.futures.add(future, encode, tenant=tenant, owner=model_id, seq_id=seq_id)
        return {"request_id": rid, "model_id": model_id}

    def forward_backward(self, request: ForwardBackwardCall, tenant: str) -> dict:
        def call(client):
            method = client.forward if request.forward_only else client.forward_backward
            return method(request.data, request.loss_fn, request.loss_fn_config)

        return self._sequenced(request.model_id, request.seq_id, tenant, call, encode_forward_backward_output)

    def optim_step(self, request: types.OptimStepRequest, tenant: str) -> dict:
        return self._sequenced(request.model_id, request.seq_id, tenant,
                               lambda client: client.optim_step(request.optim_params), dump)

    def save_weights(self, request: types.SaveWeightsRequest, tenant: str) -> dict:
        model = self._model(request.model_id, tenant)

        def call(client):
            if not request.path:
                raise InputError("save_weights needs a name (path); TrainingClient.save_state(name) sends one.")
            saved = client.save_state(request.path, request.ttl_seconds, request.overwrite,
                                      request.user_metadata).result()
            model.last_saved = saved.path
            self.store.model_update(model.model_id, last_saved=saved.path)
            return saved

        return self._sequenced(request.model_id, request.seq_id, tenant, call, dump)

    def save_weights_for_sampler(self, request: types.SaveWeightsForSamplerRequest, tenant: str) -> dict:
        model = self._model(request.model_id, tenant)

        def call(client):
            if request.path is not None:
                return client.save_weights_for_sampler(request.path, request.ttl_seconds, request.user_metadata)
            if request.kind != "snapshot":
                raise InputError(f"kind={request.kind!r}: rlrunbook serve samples snapshots only; leave kind at "
                                 "'snapshot' (save_weights_and_get_sampling_client's default).")
            sampler_id = f"{model.session_id}:sample:{request.sampling_session_seq_id}"
            sampling = self._seeded(client.save_weights_and_get_sampling_client(), request.sampling_session_seq_id)
            self._add_sampler(Sampler(sampler_id, model.session_id, tenant, sampling, None, model.base_model,
                                      snapshot=True))
            return types.SaveWeightsForSamplerResponseInternal(sampling_session_id=sampler_id)

        return self._sequenced(request.model_id, request.seq_id, tenant, call, dump)

    def load_weights(self, request: types.LoadWeightsRequest, tenant: str) -> dict:
        """``load_state(_with_optimizer)`` of a model (``model_id``, ``seq_id``; after a restart it makes the
        model's client again first), or a new model made from a checkpoint (``session_id``, ``model_seq_id``:
        ``create_training_client_from_state(_with_optimizer)``)."""
        if request.model_id is not None:
            model = self._model(request.model_id, tenant)

            def call(client):
                if client is None:  # restarted: a client of the recorded layout, then the saved state
                    client = self._recreate(model)
                load = client.load_state_with_optimizer if request.optimizer else client.load_state
                return load(request.path)

            return self._sequenced(request.model_id, request.seq_id, tenant, call, dump, restores=True)
        if request.session_id is None or request.model_seq_id is None:
            raise InputError("load_weights needs model_id and seq_id (load_state), or session_id and model_seq_id "
                             "(create_training_client_from_state).")
        model_id = f"{request.session_id}:train:{request.model_seq_id}"

        def create():
            if request.optimizer:
                return self.service.create_training_client_from_state_with_optimizer(
                    request.path, request.base_model, request.user_metadata)
            return self.service.create_training_client_from_state(
                request.path, request.base_model, request.user_metadata, optimizer=request.optimizer_config)

        source = self.rest.get_weights_info_by_tinker_path(request.path).result()
        return self._new_model(request.session_id, request.model_seq_id, tenant,
                               request.base_model or source.base_model, {"rank": source.lora_rank}, "load", create,
                               lambda _client: dump(types.LoadWeightsResponse(path=request.path, model_id=model_id)))

    def _recreate(self, model: Model):
        """The local client of a restarted model, made again from its record (before its state is loaded)."""
        lora = model.lora
        client = self.service.create_lora_training_client(
            model.base_model, rank=int(lora.get("rank", 32)), seed=lora.get("seed"),
            train_mlp=bool(lora.get("train_mlp", True)), train_attn=bool(lora.get("train_attn", True)),
            train_unembed=bool(lora.get("train_unembed", True)))
        made: Future = Future()
        made.set_result(client)
        model.client, model.status = made, "live"
        self.store.model_update(model.model_id, run_id=client.model_id, status="live")
        return client

    # -- sampling -----------------------------------------------------------------------------------------
    def _seeded(self, client, sampling_session_seq_id: int):
        """``client`` seeding its unseeded requests as the in-process backend seeds the sampler of that number
        (:class:`~rlrunbook.backend.LocalSamplingClient`): the same script gets the same samples both ways."""
        client.reseed(sampling_session_seq_id, self.service.settings.seed)
        return client

    def _add_sampler(self, sampler: Sampler) -> None:
        with self._lock:
            if sampler.sampler_id in self._samplers:
                raise InputError(f"sampling session {sampler.sampler_id} exists: its sampling_session_seq_id "
                                 "is taken.")
            self._samplers[sampler.sampler_id] = sampler
        self.store.add_sampler(sampler.sampler_id, sampler.session_id, sampler.tenant, sampler.base_model,
                               sampler.model_path, sampler.snapshot)

    def create_sampling_session(self, request: types.CreateSamplingSessionRequest, tenant: str) -> dict:
        self._session(request.session_id, tenant)
        sampler_id = f"{request.session_id}:sample:{request.sampling_session_seq_id}"
        if sampler_id not in self._samplers:  # else a retried request: the sampler it made
            if request.model_path is not None:
                client = self.service.create_sampling_client(model_path=request.model_path)
            else:
                client = self.service.create_sampling_client(base_model=request.base_model)
            self._seeded(client, request.sampling_session_seq_id)
            self._add_sampler(Sampler(sampler_id, request.session_id, tenant, client, request.model_path,
                                      request.base_model))
        else:
            self._sampler(sampler_id, tenant)
        return dump(types.CreateSamplingSessionResponse(sampling_session_id=sampler_id))

    def sampler_info(self, sampler_id: str, tenant: str) -> dict:
        sampler = self._sampler(sampler_id, tenant)
        return dump(types.GetSamplerResponse(sampler_id=sampler_id, base_model=sampler.client.get_base_model(),
                                             model_path=sampler.model_path))

    def sample(self, request: types.SampleRequest, tenant: str) -> dict:
        if isinstance(request.num_samples, int) and request.num_samples > MAX_SAMPLES_PER_REQUEST:
            # Refused before any work: the answer must carry one id per sample (the SDK checks the count).
            raise InputError(f"num_samples={request.num_samples} is above rlrunbook serve's limit of "
                             f"{MAX_SAMPLES_PER_REQUEST} per request; split it into several sample calls.")
        sampler = self._sampler(request.sampling_session_id, tenant)
        count = request.num_samples if isinstance(request.num_samples, int) and request.num_samples > 0 else 0
        ids = [f"seq-{secrets.token_urlsafe(9)}" for _ in range(count)]
        if request.seq_id is not None:
            known = self.store.call_future(sampler.sampler_id, "sample", request.seq_id)
            if known is not None:
                return {"request_id": known, "sample_sequence_ids": ids}
        try:
            if request.record_stability_info:
                raise InputError("record_stability_info is not supported by rlrunbook serve; leave it False.")
            future = sampler.client.sample(
                request.prompt, request.num_samples, request.sampling_params,
                include_prompt_logprobs=bool(request.prompt_logprobs),
                topk_prompt_logprobs=request.topk_prompt_logprobs, topk_sample_logprobs=request.topk_sample_logprobs,
                target_prompt_logprobs=request.target_prompt_logprobs,
                prompt_alt_tokens_k=request.prompt_alt_tokens_k,
                prompt_logprobs_last_n=request.prompt_logprobs_last_n, request_index=request.seq_id).future()
        except Exception as error:  # noqa: BLE001 - a refused request fails its future, naming the cause
            future = failed(error)
        rid = self.futures.add(future, encode_sample_response, tenant=tenant, owner=sampler.sampler_id,
                               seq_id=request.seq_id, kind="sample")
        return {"request_id": rid, "sample_sequence_ids": ids}

    # -- what the server holds ----------------------------------------------------------------------------
    def status(self, tenant: str) -> dict:
        """The caller's sessions and models with the memory each model holds, and the resident base models."""
        models, pending = [], self.futures.pending()
        for model in [m for m in list(self._models.values()) if m.tenant == tenant]:
            entry = {"model_id": model.model_id, "session_id": model.session_id, "status": model.status,
                     "base_model": model.base_model, "last_saved": model.last_saved, "last_seq_id": model.last_seq,
                     "pending_calls": pending.get(model.model_id, 0)}
            client = model.client
            if model.status == "live" and client is not None and client.done() and client.exception() is None:
                entry["memory_bytes"] = client.result().memory_bytes()
            models.append(entry)
        now = time.monotonic()
        sessions = [{"session_id": s.session_id, "status": s.status, "idle_s": round(now - s.last_heartbeat, 1)}
                    for s in list(self._sessions.values()) if s.tenant == tenant]
        return {"sessions": sessions, "models": models, "resident": self.service.resident_models(),
                "session_timeout_s": self.session_timeout_s}


def _thread_name(model_id: str) -> str:
    return "model-" + model_id.rsplit(":", 1)[-1]


def _ended(session: Session, timeout_s: float) -> str:
    if session.status == "expired":
        return (f"session {session.session_id} expired: no heartbeat for {timeout_s:.0f} s (rlrunbook serve "
                "--session-timeout), so its models and samplers were released; its saved checkpoints stay. Create "
                "a new ServiceClient and continue from a checkpoint (create_training_client_from_state).")
    return (f"session {session.session_id} finished (its ServiceClient was closed), so its models and samplers "
            "were released; its saved checkpoints stay.")


def _restarted(model: Model) -> str:
    resume = (f"training_client.load_state({model.last_saved!r}) (or load_state_with_optimizer) restores its "
              "last saved state" if model.last_saved else "it saved no state (save_state), so create a new "
              "training client")
    return (f"rlrunbook serve restarted since training model {model.model_id} was last used; its adapter and "
            f"optimizer state in memory are gone: {resume}.")
