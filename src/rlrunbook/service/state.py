"""What the server holds: sessions, training models and samplers, each mapped onto the local backend.

One :class:`~rlrunbook.backend.LocalServiceClient` serves every client: each training model the SDK creates
(``"{session_id}:train:{model_seq_id}"``) is a ``LocalTrainingClient`` of its own (its own LoRA adapter and
AdamW state) and each sampling session a ``LocalSamplingClient``. Nothing here computes: every call is the
local client's, so over the wire and in process the same seed gives the same bits.

Each method takes the SDK's own request type (``tinker.types``) and returns the JSON body of the response;
a queued call's body carries the request id the SDK then polls (:mod:`rlrunbook.service.futures`).
"""

from __future__ import annotations

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
from rlrunbook.service.wire import ForwardBackwardCall, encode_forward_backward_output, encode_sample_response

MAX_SAMPLES_PER_REQUEST = 10_000  # sequences one sample request may ask for (each gets an id at once)


class UnknownIdError(RlrunbookError, LookupError):
    """A session, model, sampler or request id this server does not hold (HTTP 404)."""


def dump(value: Any) -> dict:
    """The JSON body of an SDK response type."""
    return value.model_dump(mode="json")


@dataclass
class Session:
    """A ``tinker.ServiceClient`` of some process: ``create_session`` to ``sessions/{id}/finish``."""

    session_id: str
    user_metadata: dict[str, str]
    created: float = field(default_factory=time.time)
    last_heartbeat: float = field(default_factory=time.time)
    finished: bool = False


@dataclass
class Model:
    """A training model: the future of its local client, and the order its calls run in."""

    model_id: str
    session_id: str
    client: Future  # of a LocalTrainingClient
    order: SeqOrder


@dataclass
class Sampler:
    """A sampling session: a local sampling client."""

    sampler_id: str
    client: Any  # a LocalSamplingClient
    model_path: str | None


class ServeState:
    """The server's sessions, models and samplers over one local ServiceClient (see the module docstring)."""

    def __init__(self, service: LocalServiceClient):
        self.service = service
        self.futures = FutureRegistry()
        self.rest = LocalRestClient(service._store)
        self._sessions: dict[str, Session] = {}
        self._models: dict[str, Model] = {}
        self._samplers: dict[str, Sampler] = {}
        self._responses: dict[tuple, dict] = {}  # a retried request (same model and seq_id) gets its first answer
        self._lock = threading.RLock()
        self._creator = ThreadPoolExecutor(max_workers=2, thread_name_prefix="rlrunbook-serve-create")

    def close(self) -> None:
        """Stop the models' threads and the local backend (after the calls already queued)."""
        for model in list(self._models.values()):
            model.order.close()
        self._creator.shutdown(wait=False, cancel_futures=True)
        self.service.close()

    # -- lookups ------------------------------------------------------------------------------
    def _session(self, session_id: str) -> Session:
        session = self._sessions.get(session_id)
        if session is None:
            raise UnknownIdError(f"no session {session_id!r} on this server (it restarted, or the id is wrong); "
                                 "create a new tinker.ServiceClient.")
        return session

    def _model(self, model_id: str) -> Model:
        model = self._models.get(model_id)
        if model is None:
            raise UnknownIdError(f"no training model {model_id!r} on this server; create one with "
                                 "ServiceClient.create_lora_training_client.")
        return model

    def _sampler(self, sampler_id: str | None) -> Sampler:
        sampler = self._samplers.get(sampler_id or "")
        if sampler is None:
            raise UnknownIdError(f"no sampling session {sampler_id!r} on this server; create one with "
                                 "ServiceClient.create_sampling_client or save_weights_and_get_sampling_client.")
        return sampler

    # -- sessions -----------------------------------------------------------------------------
    def create_session(self, request: types.CreateSessionRequest) -> dict:
        session = Session(session_id=f"session-{secrets.token_urlsafe(16)}",
                          user_metadata=dict(request.user_metadata or {}))
        with self._lock:
            self._sessions[session.session_id] = session
        return dump(types.CreateSessionResponse(session_id=session.session_id))

    def heartbeat(self, request: types.SessionHeartbeatRequest) -> dict:
        self._session(request.session_id).last_heartbeat = time.time()
        return dump(types.SessionHeartbeatResponse())

    def finish(self, session_id: str) -> dict:
        self._session(session_id).finished = True
        return {}

    # -- training models ----------------------------------------------------------------------
    def _new_model(self, session_id: str, model_seq_id: int, key: tuple, create: Callable[[], Any],
                   encode: Callable[[Any], dict]) -> dict:
        """File a model being created by ``create`` (on a creator thread); a retried request gets its first answer."""
        self._session(session_id)
        model_id = f"{session_id}:train:{model_seq_id}"
        with self._lock:
            if key in self._responses:
                return self._responses[key]
            if model_id in self._models:
                raise InputError(f"model {model_id} exists: model_seq_id {model_seq_id} of this session is taken.")
            future = self._creator.submit(create)
            self._models[model_id] = Model(model_id, session_id, future, SeqOrder(f"model-{model_seq_id}"))
            response = {"request_id": self.futures.add(future, encode), "model_id": model_id}
            self._responses[key] = response
        return response

    def create_model(self, request: types.CreateModelRequest) -> dict:
        lora = request.lora_config or types.LoraConfig(rank=32)
        model_id = f"{request.session_id}:train:{request.model_seq_id}"

        def create():
            return self.service.create_lora_training_client(
                request.base_model, rank=lora.rank, seed=lora.seed, train_mlp=lora.train_mlp,
                train_attn=lora.train_attn, train_unembed=lora.train_unembed,
                user_metadata=request.user_metadata, optimizer=request.optimizer_config)

        return self._new_model(request.session_id, request.model_seq_id, ("create", model_id), create,
                               lambda _client: dump(types.CreateModelResponse(model_id=model_id)))

    def get_info(self, request: types.GetInfoRequest) -> dict:
        client = self._model(request.model_id).client.result()
        return dump(client.get_info().model_copy(update={"model_id": request.model_id}))

    def _sequenced(self, model_id: str, seq_id: int | None, call: Callable[[Any], Any],
                   encode: Callable[[Any], Any]) -> dict:
        """Queue ``call(local training client)`` as this model's call ``seq_id``; the body names its request id."""
        model = self._model(model_id)
        if seq_id is None:
            raise InputError(f"a call of model {model_id} without seq_id; the SDK numbers every call of a "
                             "training client.")
        key = ("model", model_id, seq_id)
        with self._lock:
            if key in self._responses:
                return self._responses[key]
            future = model.order.submit(seq_id, lambda: call(model.client.result()))
            response = {"request_id": self.futures.add(future, encode), "model_id": model_id}
            self._responses[key] = response
        return response

    def forward_backward(self, request: ForwardBackwardCall) -> dict:
        def call(client):
            method = client.forward if request.forward_only else client.forward_backward
            return method(request.data, request.loss_fn, request.loss_fn_config)

        return self._sequenced(request.model_id, request.seq_id, call, encode_forward_backward_output)

    def optim_step(self, request: types.OptimStepRequest) -> dict:
        return self._sequenced(request.model_id, request.seq_id,
                               lambda client: client.optim_step(request.optim_params), dump)

    def save_weights(self, request: types.SaveWeightsRequest) -> dict:
        def call(client):
            if not request.path:
                raise InputError("save_weights needs a name (path); TrainingClient.save_state(name) sends one.")
            return client.save_state(request.path, request.ttl_seconds, request.overwrite, request.user_metadata)

        return self._sequenced(request.model_id, request.seq_id, call, dump)

    def save_weights_for_sampler(self, request: types.SaveWeightsForSamplerRequest) -> dict:
        session_id = self._model(request.model_id).session_id

        def call(client):
            if request.path is not None:
                return client.save_weights_for_sampler(request.path, request.ttl_seconds, request.user_metadata)
            if request.kind != "snapshot":
                raise InputError(f"kind={request.kind!r}: rlrunbook serve samples snapshots only; leave kind at "
                                 "'snapshot' (save_weights_and_get_sampling_client's default).")
            sampler_id = f"{session_id}:sample:{request.sampling_session_seq_id}"
            self._add_sampler(Sampler(sampler_id, client.save_weights_and_get_sampling_client(), None))
            return types.SaveWeightsForSamplerResponseInternal(sampling_session_id=sampler_id)

        return self._sequenced(request.model_id, request.seq_id, call, dump)

    def load_weights(self, request: types.LoadWeightsRequest) -> dict:
        """``load_state(_with_optimizer)`` of a model (``model_id``, ``seq_id``), or a new model made from a
        checkpoint (``session_id``, ``model_seq_id``: ``create_training_client_from_state(_with_optimizer)``)."""
        if request.model_id is not None:
            def call(client):
                load = client.load_state_with_optimizer if request.optimizer else client.load_state
                return load(request.path)

            return self._sequenced(request.model_id, request.seq_id, call, dump)
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

        return self._new_model(request.session_id, request.model_seq_id, ("load", model_id), create,
                               lambda _client: dump(types.LoadWeightsResponse(path=request.path, model_id=model_id)))

    # -- sampling -----------------------------------------------------------------------------
    def _add_sampler(self, sampler: Sampler) -> None:
        with self._lock:
            if sampler.sampler_id in self._samplers:
                raise InputError(f"sampling session {sampler.sampler_id} exists: its sampling_session_seq_id "
                                 "is taken.")
            self._samplers[sampler.sampler_id] = sampler

    def create_sampling_session(self, request: types.CreateSamplingSessionRequest) -> dict:
        self._session(request.session_id)
        sampler_id = f"{request.session_id}:sample:{request.sampling_session_seq_id}"
        if sampler_id not in self._samplers:  # else a retried request: the sampler it made
            if request.model_path is not None:
                client = self.service.create_sampling_client(model_path=request.model_path)
            else:
                client = self.service.create_sampling_client(base_model=request.base_model)
            self._add_sampler(Sampler(sampler_id, client, request.model_path))
        return dump(types.CreateSamplingSessionResponse(sampling_session_id=sampler_id))

    def sampler_info(self, sampler_id: str) -> dict:
        sampler = self._sampler(sampler_id)
        return dump(types.GetSamplerResponse(sampler_id=sampler_id, base_model=sampler.client.get_base_model(),
                                             model_path=sampler.model_path))

    def sample(self, request: types.SampleRequest) -> dict:
        if isinstance(request.num_samples, int) and request.num_samples > MAX_SAMPLES_PER_REQUEST:
            # Refused before any work: the answer must carry one id per sample (the SDK checks the count).
            raise InputError(f"num_samples={request.num_samples} is above rlrunbook serve's limit of "
                             f"{MAX_SAMPLES_PER_REQUEST} per request; split it into several sample calls.")
        sampler = self._sampler(request.sampling_session_id)
        key = ("sample", sampler.sampler_id, request.seq_id)
        with self._lock:
            if request.seq_id is not None and key in self._responses:
                return self._responses[key]
        try:
            if request.record_stability_info:
                raise InputError("record_stability_info is not supported by rlrunbook serve; leave it False.")
            future = sampler.client.sample(
                request.prompt, request.num_samples, request.sampling_params,
                include_prompt_logprobs=bool(request.prompt_logprobs),
                topk_prompt_logprobs=request.topk_prompt_logprobs, topk_sample_logprobs=request.topk_sample_logprobs,
                target_prompt_logprobs=request.target_prompt_logprobs,
                prompt_alt_tokens_k=request.prompt_alt_tokens_k,
                prompt_logprobs_last_n=request.prompt_logprobs_last_n).future()
        except Exception as error:  # noqa: BLE001 - a refused request fails its future, naming the cause
            future = failed(error)
        count = request.num_samples if isinstance(request.num_samples, int) and request.num_samples > 0 else 0
        response = {"request_id": self.futures.add(future, encode_sample_response),
                    "sample_sequence_ids": [f"seq-{secrets.token_urlsafe(9)}" for _ in range(count)]}
        if request.seq_id is not None:
            with self._lock:
                self._responses[key] = response
        return response
