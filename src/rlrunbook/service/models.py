"""Training models and their calls, each model a ``LocalTrainingClient`` of its own.

A model (``"{session_id}:train:{model_seq_id}"``) is created on a creator thread (its own LoRA adapter, AdamW
state and engine over the one resident copy of its base model) and answers a request id at once. Its calls
(forward_backward, optim_step, save and load of state, save of sampler weights) run in the SDK's ``seq_id``
order (:class:`~rlrunbook.service.futures.SeqOrder`, a thread per model), and the backend's worker serves the
models in turn (one lane each), so one client's queue of calls does not hold back another's. A retried call
(same ``seq_id``) is answered with its first request id. A model a restart left without weights refuses its
calls, naming its last saved state, until ``load_state`` makes its client again from the recorded LoRA layout
and loads that state.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from tinker import types

from rlrunbook.backend import LocalRestClient, LocalServiceClient
from rlrunbook.errors import InputError
from rlrunbook.service.futures import FutureRegistry, SeqOrder
from rlrunbook.service.holdings import Holdings, TenantLimitError
from rlrunbook.service.records import (
    Model,
    ModelRestartedError,
    Sampler,
    dump,
    order_thread_name,
    restarted_message,
)
from rlrunbook.service.samplers import Samplers
from rlrunbook.service.store import ServeStore
from rlrunbook.service.wire import ForwardBackwardCall, encode_forward_backward_output


class Models:
    """The training models of :class:`Holdings`: created, recorded in the store, and their calls sequenced."""

    def __init__(self, holdings: Holdings, service: LocalServiceClient, store: ServeStore, futures: FutureRegistry,
                 rest: LocalRestClient, samplers: Samplers):
        self.holdings = holdings
        self.service = service
        self.store = store
        self.futures = futures
        self.rest = rest
        self.samplers = samplers
        self._creator = ThreadPoolExecutor(max_workers=2, thread_name_prefix="rlrunbook-serve-create")

    def close(self) -> None:
        """Start no queued call or creation; wait for the ones running (their backend calls run: cancel the
        backend's queue first, so they wait behind nothing)."""
        orders = [model.order for model in list(self.holdings.models.values())]
        for order in orders:
            order.close()
        self._creator.shutdown(wait=True, cancel_futures=True)
        for order in orders:
            order.close(wait=True)

    def _new_model(self, session_id: str, model_seq_id: int, tenant: str, base_model: str, lora: dict,
                   kind: str, create: Callable[[], Any], encode: Callable[[Any], dict]) -> dict:
        """File a model being created by ``create`` (on a creator thread); a retried request gets its first answer."""
        self.holdings.session(session_id, tenant)
        model_id = f"{session_id}:train:{model_seq_id}"
        with self.holdings.lock:
            known = self.store.call_future(model_id, kind, None)
            if known is not None:
                return {"request_id": known, "model_id": model_id}
            if model_id in self.holdings.models:
                raise InputError(f"model {model_id} exists: model_seq_id {model_seq_id} of this session is taken.")
            self.holdings.check_room(tenant, "models")
            self.store.add_model(model_id, session_id, tenant, base_model, lora)
            model = Model(model_id, session_id, tenant, base_model, lora, SeqOrder(order_thread_name(model_id)))
            model.client = self._creator.submit(self._made, model, create)
            self.holdings.models[model_id] = model
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
        model = self.holdings.model(request.model_id, tenant)
        if model.client is None:
            raise ModelRestartedError(restarted_message(model))
        client = model.client.result()
        return dump(client.get_info().model_copy(update={"model_id": request.model_id}))

    def _sequenced(self, model_id: str, seq_id: int | None, tenant: str, call: Callable[[Any], Any],
                   encode: Callable[[Any], Any], *, restores: bool = False,
                   admit: Callable[[], Callable[[], None] | None] | None = None) -> dict:
        """Queue ``call(local training client)`` as this model's call ``seq_id``; the body names its request id.

        On a model a restart left without weights only a call that ``restores`` them runs (``call(None)``);
        the others fail naming the last saved state. ``admit`` may refuse the call before it is queued with a
        :class:`TenantLimitError` (HTTP 429), which is raised; its ``seq_id`` is taken all the same, so the
        client's later calls do not wait for it. What ``admit`` returns, if anything, is called once the call is
        done (what it reserved is released)."""
        model = self.holdings.model(model_id, tenant)
        if seq_id is None:
            raise InputError(f"a call of model {model_id} without seq_id; the SDK numbers every call of a "
                             "training client.")
        with self.holdings.lock:
            known = self.store.call_future(model_id, "call", seq_id)
            if known is not None:
                return {"request_id": known, "model_id": model_id}

            admitted = None
            if admit is not None:
                try:
                    admitted = admit()
                except TenantLimitError as error:
                    refusal = error
                    model.order.submit(seq_id, lambda: _raise(refusal))  # nobody polls it: it only takes the seq_id
                    if seq_id > model.last_seq:
                        model.last_seq = seq_id
                        self.store.model_update(model_id, last_seq=seq_id)
                    raise

            def run():
                if model.status == "restarted" and not restores:
                    raise ModelRestartedError(restarted_message(model))
                return call(None if model.status == "restarted" else model.client.result())

            future = model.order.submit(seq_id, run)
            if admitted is not None:
                future.add_done_callback(lambda _done: admitted())
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

    def save_weights(self, request: types.SaveWeightsRequest, tenant: str,
                     admit: Callable[[str], Callable[[], None] | None] = lambda kind: None) -> dict:
        """``save_state``: the model's adapter and optimizer state under ``weights/<path>``, in its turn;
        ``admit("weights")`` may refuse it first (see :meth:`_sequenced`)."""
        model = self.holdings.model(request.model_id, tenant)

        def call(client):
            if not request.path:
                raise InputError("save_weights needs a name (path); TrainingClient.save_state(name) sends one.")
            saved = client.save_state(request.path, request.ttl_seconds, request.overwrite,
                                      request.user_metadata).result()
            model.last_saved = saved.path
            self.store.model_update(model.model_id, last_saved=saved.path)
            return saved

        return self._sequenced(request.model_id, request.seq_id, tenant, call, dump, admit=lambda: admit("weights"))

    def save_weights_for_sampler(self, request: types.SaveWeightsForSamplerRequest, tenant: str,
                                 admit: Callable[[str], Callable[[], None] | None] = lambda kind: None) -> dict:
        """Named: the adapter under ``sampler_weights/<path>`` (``admit("sampler_weights")`` may refuse it first);
        nameless: a sampling session of the weights in memory (nothing written)."""
        model = self.holdings.model(request.model_id, tenant)

        def call(client):
            if request.path is not None:
                return client.save_weights_for_sampler(request.path, request.ttl_seconds, request.user_metadata)
            if request.kind != "snapshot":
                raise InputError(f"kind={request.kind!r}: rlrunbook serve samples snapshots only; leave kind at "
                                 "'snapshot' (save_weights_and_get_sampling_client's default).")
            sampler_id = f"{model.session_id}:sample:{request.sampling_session_seq_id}"
            sampling = self.samplers.seeded(client.save_weights_and_get_sampling_client(),
                                            request.sampling_session_seq_id)
            self.samplers.add(Sampler(sampler_id, model.session_id, tenant, sampling, None, model.base_model,
                                      snapshot=True))
            return types.SaveWeightsForSamplerResponseInternal(sampling_session_id=sampler_id)

        writes = request.path is not None
        return self._sequenced(request.model_id, request.seq_id, tenant, call, dump,
                               admit=(lambda: admit("sampler_weights")) if writes else None)

    def save_weights_external(self, request: types.SaveWeightsExternalRequest, tenant: str,
                              admit: Callable[[str], Callable[[], None] | None] = lambda kind: None) -> dict:
        """``save_weights_external(name)``: the adapter as a peft folder under
        ``tinker://<run>/external_weights/<name>`` (age-encrypted to the recipients given), in its turn
        (``admit("external_weights")`` may refuse it first); the result is ``SaveWeightsExternalResponseInternal``
        naming that path."""
        def call(client):
            saved = client.save_weights_external(request.path, request.ttl_seconds,
                                                  request.age_encryption_recipients).result()
            return types.SaveWeightsExternalResponseInternal(path=saved.path)

        return self._sequenced(request.model_id, request.seq_id, tenant, call, dump,
                               admit=lambda: admit("external_weights"))

    def load_weights(self, request: types.LoadWeightsRequest, tenant: str,
                     check_path: Callable[[str], None] = lambda path: None) -> dict:
        """``load_state(_with_optimizer)`` of a model (``model_id``, ``seq_id``; after a restart it makes the
        model's client again first), or a new model made from a checkpoint (``session_id``, ``model_seq_id``:
        ``create_training_client_from_state(_with_optimizer)``). ``check_path`` refuses a path the caller may not
        read (see :mod:`rlrunbook.service.ownership`)."""
        if request.model_id is not None:
            model = self.holdings.model(request.model_id, tenant)

            def call(client):
                check_path(request.path)  # in its turn: a refused call still takes its seq_id
                if client is None:  # restarted: a client of the recorded layout, then the saved state
                    client = self._recreate(model)
                load = client.load_state_with_optimizer if request.optimizer else client.load_state
                return load(request.path)

            # A restarted model holds no weights and counts toward no limit until this call gives it some.
            room = (lambda: self.holdings.check_room(tenant, "models")) if model.status == "restarted" else None
            return self._sequenced(request.model_id, request.seq_id, tenant, call, dump, restores=True, admit=room)
        if request.session_id is None or request.model_seq_id is None:
            raise InputError("load_weights needs model_id and seq_id (load_state), or session_id and model_seq_id "
                             "(create_training_client_from_state).")
        model_id = f"{request.session_id}:train:{request.model_seq_id}"
        check_path(request.path)

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


def _raise(error: BaseException):
    raise error
