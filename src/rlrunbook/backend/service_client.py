"""The local ServiceClient: creates training and sampling clients on in-process models.

``tinker://<model_id>/<weights|sampler_weights>/<name>`` paths map onto folders under the
storage directory (``TINKER_LOCAL_STORAGE``; see :mod:`rlrunbook.backend.storage`), so a run
can be resumed, or sampled from, by another process.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import uuid
import weakref
from pathlib import Path
from typing import Any

import torch
from tinker import types
from typing_extensions import Self

from rlrunbook.backend import sessions, sharding
from rlrunbook.backend.futures import OrderedWorker, completed
from rlrunbook.backend.lora import load_saved_adapter, lora_tensors, wrap_with_lora
from rlrunbook.backend.memory import (
    SAMPLER_SHARE,
    MicroBatching,
    plan_full_micro_batching,
    plan_micro_batching,
)
from rlrunbook.backend.model_host import ModelHost, ResidentModel, SamplerWeights, host_over, load_resident
from rlrunbook.backend.model_state import BASE_MODEL_FILE, read_adapter
from rlrunbook.backend.rest_client import LocalRestClient, capabilities, copy_checkpoint
from rlrunbook.backend.sample_log import SampleLog
from rlrunbook.backend.sampling_client import (
    LocalSamplingClient,
    refuse_stability_info,
    register_handle_resolver,
)
from rlrunbook.backend.settings import LocalSettings
from rlrunbook.backend.storage import ADAPTER_FILE, CheckpointStore, RunRecord, parse_tinker_path
from rlrunbook.backend.timeline import Timeline
from rlrunbook.backend.trainer import Trainer
from rlrunbook.backend.training_client import LocalTrainingClient
from rlrunbook.backend.unsupported import refuse_sdk_attribute
from rlrunbook.backend.vllm_sampling import VllmSamplers, refuse_users_server
from rlrunbook.engines.decoder import unsupported_reason
from rlrunbook.engines.noise import mix_seed
from rlrunbook.errors import ConfigError, ModelNotFoundError

# Every LocalServiceClient of this process not yet closed: what a signal must stop before the process exits.
_LIVE: weakref.WeakSet[LocalServiceClient] = weakref.WeakSet()


def stop_live_services(timeout: float | None = None) -> bool:
    """Stop every local backend of this process that is not closed (:meth:`LocalServiceClient.stop_now`):
    what a command does after a signal, so the process never exits while a backend thread is inside torch.
    True when none computes any more."""
    return all([service.stop_now(timeout) for service in list(_LIVE)])


def _no_version() -> None:
    """The weights version of a base-model sampler: it has none."""
    return None


def micro_batching(host: ModelHost, settings: LocalSettings, reference: torch.nn.Module | None = None) -> MicroBatching:
    """How this host's trainer splits ``forward_backward`` batches (see :func:`plan_micro_batching`, and
    :func:`plan_full_micro_batching` for full-parameter training with its KL ``reference``).

    The share of the device left to sampling: an in-process sampler's caches, or a managed vLLM server's
    ``gpu_memory_utilization`` when it runs on the same GPU; none for a vLLM server reached by URL.
    """
    share = SAMPLER_SHARE
    if settings.sampler == "vllm":
        external = bool(settings.vllm.url)
        share = 0.0 if external or not settings.device.startswith("cuda") else settings.vllm.gpu_memory_utilization
    if sharding.is_sharded(host.model):
        return plan_full_micro_batching(host.model, reference, compute_dtype=settings.resolved_dtype(),
                                        device=settings.device, numerics=settings.decoder_numerics(),
                                        tokens=settings.micro_batch_tokens, checkpointing=_checkpointing(settings),
                                        sampler_share=share)
    reason = unsupported_reason(host.model)
    if reason is not None:  # transformers' own forward over padded datums: no traced cost to derive a budget from
        tokens = settings.micro_batch_tokens or None
        return MicroBatching(tokens, False, f"{tokens or 'no'} token limit; the padded path ({reason})")
    return plan_micro_batching(host.model, device=settings.device, numerics=settings.decoder_numerics(),
                               tokens=settings.micro_batch_tokens, checkpointing=_checkpointing(settings),
                               sampler_share=share)


def _checkpointing(settings: LocalSettings) -> str:
    """The checkpointing choice the micro-batch planner takes: ``planned`` where a run's plan chose it (see
    ``LocalSettings.planned_recompute``), else the setting."""
    return "planned" if settings.planned_recompute and settings.activation_checkpointing == "auto" else (
        settings.activation_checkpointing)


class LocalServiceClient:
    """Entry point of the local backend, with the SDK ServiceClient's creation methods.

    Keyword arguments the hosted SDK takes (``api_key``, ``base_url``, ``display_name``, ...) are
    accepted and ignored (``user_metadata`` is the session's, as ``RestClient.get_session`` reports),
    so code written for the service constructs this one unchanged. Each client is one session. Created
    clients are returned ready; they also behave as the SDK's finished client futures
    (``.result()``, ``await``). ``with LocalServiceClient() as service:`` closes it at the end.
    """

    def __init__(self, settings: LocalSettings | None = None, **_sdk_kwargs: object):
        self.settings = settings if settings is not None else LocalSettings.from_env()
        self._store = CheckpointStore(self.settings.resolved_storage_dir())
        training_threads, self._sampler_threads = self.settings.worker_threads()
        self._timeline = Timeline(self.settings.timeline) if self.settings.timeline is not None else None
        self._sample_log = SampleLog(self.settings.sample_log) if self.settings.sample_log is not None else None
        self._worker = OrderedWorker(max_batch_rows=self.settings.max_batch_rows, threads=training_threads,
                                     batch_window_s=self.settings.batch_window_ms / 1000,
                                     timeline=self._timeline)
        self._sampling_worker: OrderedWorker | None = None  # made on first use, with concurrent_sampling
        self._base_hosts: dict[str, ModelHost] = {}
        # One copy of each base model's weights, shared by every host over it (each training client's own modules,
        # adapter and engine; each base-model sampler's), keyed by what the name resolves to.
        self._resident: dict[str, ResidentModel] = {}
        self._training: dict[str, LocalTrainingClient] = {}
        self._samplers_made = itertools.count()  # the SDK's sampling_session_seq_id of this ServiceClient
        self._vllm = VllmSamplers(self.settings) if self.settings.sampler == "vllm" else None
        self._closed = False
        metadata = _sdk_kwargs.get("user_metadata")
        metadata = metadata if isinstance(metadata, dict) else None
        # The session's id: what its runs, samplers and LossHandles name.
        self.session_id = sessions.open_session(self._store.root, metadata).session_id
        _LIVE.add(self)

    def result(self, timeout: float | None = None) -> Self:
        return self

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __getattr__(self, name: str) -> Any:
        from tinker.lib.public_interfaces.service_client import ServiceClient

        raise refuse_sdk_attribute("ServiceClient", ServiceClient, name)

    # -- training ---------------------------------------------------------------------------
    def create_lora_training_client(
        self, base_model: str, rank: int = 32, seed: int | None = None, train_mlp: bool = True,
        train_attn: bool = True, train_unembed: bool = True, user_metadata: dict[str, str] | None = None,
        optimizer: object = None,
    ) -> LocalTrainingClient:
        """A LoRA training client on a fresh copy of ``base_model`` (a built-in name, folder or hub id)."""
        if optimizer is not None and not isinstance(optimizer, types.AdamOptimizerConfig):
            raise ConfigError(f"the local backend trains with AdamW only; got optimizer={optimizer!r}.")
        record = RunRecord(model_id=f"local-{uuid.uuid4().hex[:12]}", base_model=base_model, lora_rank=rank,
                           train_mlp=train_mlp, train_attn=train_attn, train_unembed=train_unembed,
                           user_metadata=dict(user_metadata or {}), session_id=self.session_id)
        return self._training_client(record, seed)

    async def create_lora_training_client_async(self, base_model: str, rank: int = 32, seed: int | None = None,
                                                **kwargs: object) -> LocalTrainingClient:
        return self.create_lora_training_client(base_model, rank, seed, **kwargs)

    def create_full_training_client(self, base_model: str, *, with_reference: bool = False,
                                    user_metadata: dict[str, str] | None = None) -> LocalTrainingClient:
        """LOCAL EXTENSION (the hosted service trains LoRA only): a client that trains every weight of its own copy
        of ``base_model``, sharded with FSDP2 over the ranks of a torchrun launch (one rank otherwise).

        The forward/backward/optim_step calls are the LoRA client's; its samplers sample the live weights (valid
        until the next ``optim_step``; no copies are kept). ``with_reference``: keep a frozen copy of the initial
        weights (compute dtype, sharded) for the ``kl_coef`` term. Sampling runs in process, or with
        ``TINKER_LOCAL_SAMPLER=vllm`` on a managed vLLM server of this client's own whose weights are replaced before
        each new version is first sampled (``generate`` is refused). Adapter folders (``save_state``, ``save_weights_for_sampler``) are refused;
        its training state moves with ``export_training_state``/``import_training_state``. Under torchrun every
        rank makes the same training calls in the same order.
        """
        if self.settings.sampler == "generate":
            raise ConfigError("full-parameter training samples with the in-process engine (hf) or a vLLM server "
                              "(vllm); TINKER_LOCAL_SAMPLER=generate is not supported for it.")
        if self.settings.sampler == "vllm" and self.settings.vllm.url:  # before the model loads
            raise ConfigError(refuse_users_server(self.settings.vllm.url))
        if self.settings.load_in_4bit:
            raise ConfigError("full-parameter training trains every weight: 4-bit (frozen) base weights cannot train; "
                              "unset load_in_4bit or train LoRA.")
        record = RunRecord(model_id=f"local-{uuid.uuid4().hex[:12]}", base_model=base_model, lora_rank=0,
                           user_metadata=dict(user_metadata or {}), session_id=self.session_id)
        return self._training_client(record, None, full=True, with_reference=with_reference)

    def _full_host(self, base_model: str, with_reference: bool) -> tuple[ModelHost, torch.nn.Module | None]:
        """A host with weights of its own, sharded for full-parameter training, and the frozen reference if asked."""
        resident = self._resident_model(base_model)
        host = host_over(resident, base_model, self.settings, own_weights=True)
        reference = resident.load() if with_reference else None
        sharding.shard(host.model, self.settings.resolved_dtype())
        if reference is not None:
            sharding.shard_reference(reference)
        return host, reference

    def _training_client(self, record: RunRecord, seed: int | None, *, full: bool = False,
                         with_reference: bool = False) -> LocalTrainingClient:
        settings = self.settings

        def build() -> LocalTrainingClient:
            reference = None
            if full:
                host, reference = self._full_host(record.base_model, with_reference)
            else:
                host = self._host(record.base_model)
                host.model = wrap_with_lora(
                    host.model, rank=record.lora_rank, alpha=settings.lora_alpha,
                    seed=settings.seed if seed is None else seed, train_attn=record.train_attn,
                    train_mlp=record.train_mlp, train_unembed=record.train_unembed,
                )
                host.engine.model = host.model
            self._attach_sampler(host)
            batching = micro_batching(host, settings, reference)
            trainer = Trainer(host.model, pad_token_id=host.pad_token_id,
                              vocab_size=host.engine.vocab_size, grad_accum_chunks=settings.grad_accum_chunks,
                              accept_zero_advantages=settings.zero_advantage_batches == "accept",
                              numerics=settings.decoder_numerics(), micro_batch_tokens=batching.tokens,
                              recompute_layers=batching.recompute_layers, full_parameters=full, reference=reference,
                              plain_cost=batching.plain, kept_source=host.engine)
            self._store.write_run(record)
            return LocalTrainingClient(host, trainer, self._worker.lane(id(host)), model_id=record.model_id,
                                       rank=record.lora_rank, store=self._store,
                                       sampling_client_factory=self._sampling_client,
                                       session_id=self.session_id)

        client = self._worker.run(build)
        self._training[client.model_id] = client
        return client

    def create_training_client_from_state(self, path: str, base_model: str | None = None,
                                          user_metadata: dict[str, str] | None = None,
                                          weights_access_token: str | None = None,
                                          optimizer: object = None) -> LocalTrainingClient:
        """A new training run whose adapter starts from ``save_state``'s checkpoint; the optimizer starts fresh."""
        return self._from_state(path, base_model, user_metadata, optimizer, with_optimizer=False)

    def create_training_client_from_state_with_optimizer(self, path: str, base_model: str | None = None,
                                                         user_metadata: dict[str, str] | None = None,
                                                         weights_access_token: str | None = None
                                                         ) -> LocalTrainingClient:
        """Like ``create_training_client_from_state``, and AdamW continues from the checkpoint's state."""
        return self._from_state(path, base_model, user_metadata, None, with_optimizer=True)

    async def create_training_client_from_state_async(self, path, base_model=None, user_metadata=None,
                                                      weights_access_token=None, optimizer=None):
        return self.create_training_client_from_state(path, base_model, user_metadata, optimizer=optimizer)

    async def create_training_client_from_state_with_optimizer_async(self, path, base_model=None,
                                                                     user_metadata=None, weights_access_token=None):
        return self.create_training_client_from_state_with_optimizer(path, base_model, user_metadata)

    def _from_state(self, path: str, base_model: str | None, user_metadata: dict[str, str] | None,
                    optimizer: object, *, with_optimizer: bool) -> LocalTrainingClient:
        if optimizer is not None and not isinstance(optimizer, types.AdamOptimizerConfig):
            raise ConfigError(f"the local backend trains with AdamW only; got optimizer={optimizer!r}.")
        parsed = parse_tinker_path(path, kind="weights")
        self._store.existing_folder(parsed)
        source = self._store.read_run(parsed.model_id)
        record = RunRecord(model_id=f"local-{uuid.uuid4().hex[:12]}", base_model=base_model or source.base_model,
                           lora_rank=source.lora_rank, train_mlp=source.train_mlp, train_attn=source.train_attn,
                           train_unembed=source.train_unembed,
                           session_id=self.session_id,
                           user_metadata=dict(source.user_metadata if user_metadata is None else user_metadata))
        client = self._training_client(record, seed=None)
        client._load(path, with_optimizer=with_optimizer).result()
        return client

    # -- sampling ---------------------------------------------------------------------------
    def create_sampling_client(self, model_path: str | None = None, base_model: str | None = None,
                               retry_config: object = None, record_stability_info: bool = False,
                               **_: object) -> LocalSamplingClient:
        """A SamplingClient on saved weights (``model_path``, either kind of checkpoint) or on a base model."""
        refuse_stability_info(record_stability_info)
        if (model_path is None) == (base_model is None):
            raise ConfigError("pass exactly one of model_path (saved weights) or base_model.")
        return self._sampling_client(None, None, model_path, None, base_model=base_model)

    async def create_sampling_client_async(self, model_path=None, base_model=None, retry_config=None,
                                           record_stability_info=False, **_):
        return self.create_sampling_client(model_path, base_model, retry_config, record_stability_info)

    def _sampling_client(self, host: ModelHost | None, weights: SamplerWeights | None, model_path: str | None,
                         live_version, *, base_model: str | None = None) -> LocalSamplingClient:
        if base_model is not None:
            host, weights = self._worker.run(self._base_host, base_model), SamplerWeights.base()
            live_version = _no_version
        elif host is None or weights is None:
            host, weights, live_version = self._saved_weights(model_path)
        lane = id(host)  # the samplers of one model take turns with other models' calls as one client
        # Its unseeded requests are seeded by its place among this ServiceClient's samplers (see LocalSamplingClient).
        seed_base = mix_seed(self.settings.seed, next(self._samplers_made))
        return LocalSamplingClient(host, weights, self._worker_for(host).lane(lane), live_version, model_path,
                                   self._worker.lane(lane), session_id=self.session_id, storage_root=self._store.root,
                                   seed_base=seed_base, sample_log=self._sample_log)

    def _saved_weights(self, model_path: str | None):
        """(host, weights, live_version) of a sampler of the checkpoint at ``model_path``."""
        assert model_path is not None
        parsed = parse_tinker_path(model_path)
        folder = self._store.existing_folder(parsed)
        live = self._training.get(parsed.model_id)
        if live is not None:  # the run is in this process: share its model, sample the saved snapshot
            weights = SamplerWeights(adapter=self._worker.run(read_adapter, live._host, folder), version=-1)
            return live._host, weights, live._live_version
        host = self._worker.run(self._host_from_adapter, folder)
        return host, SamplerWeights(adapter=lora_tensors(host.model), version=0), lambda: 0

    def _worker_for(self, host: ModelHost) -> OrderedWorker:
        """The worker a sampling client of ``host`` runs on: the sampling worker with ``concurrent_sampling``
        where sampling never touches the live model (the in-process ``hf`` engine samples a pinned copy of the
        snapshot; a vLLM server samples the snapshot written as an adapter folder), else the one worker.

        The ``generate`` engine computes with the live adapter, and a full-parameter trainer's sampler with its
        live weights, so their calls stay on the training worker, in submission order with the training calls (as do a vLLM client's prompt logprobs, computed in process)."""
        if not self.settings.concurrent_sampling or sharding.is_sharded(host.model) or (
                host.vllm is None and getattr(host.engine, "pinned_weights", None) is None):
            return self._worker
        if self._sampling_worker is None:
            self._sampling_worker = OrderedWorker(name="rlrunbook-sampler", max_batch_rows=self.settings.max_batch_rows,
                                                  batch_window_s=self.settings.batch_window_ms / 1000,
                                                  threads=self._sampler_threads, timeline=self._timeline)
        return self._sampling_worker

    def _host(self, base_model: str) -> ModelHost:
        """A host of its own over the one resident copy of ``base_model``'s weights (loaded on first use).
        Runs on the worker."""
        return host_over(self._resident_model(base_model), base_model, self.settings)

    def _resident_model(self, base_model: str) -> ResidentModel:
        """The one resident copy of ``base_model``'s weights, loaded on first use. Runs on the worker."""
        key = self.settings.model_for(base_model)
        if key not in self._resident:
            self._resident[key] = load_resident(base_model, self.settings)
        return self._resident[key]

    def _base_host(self, base_model: str) -> ModelHost:
        if base_model not in self._base_hosts:
            self._base_hosts[base_model] = self._attach_sampler(self._host(base_model))
        return self._base_hosts[base_model]

    def _attach_sampler(self, host: ModelHost) -> ModelHost:
        """With TINKER_LOCAL_SAMPLER=vllm, hand the host's sampling to its base model's vLLM server."""
        if self._vllm is not None:
            host.vllm = self._vllm.engine_for(host)
        return host

    def _host_from_adapter(self, folder) -> ModelHost:
        meta = folder / BASE_MODEL_FILE
        if not meta.is_file():
            raise ModelNotFoundError(f"{folder} does not name its base model ({BASE_MODEL_FILE} missing).")
        host = self._host(json.loads(meta.read_text())["base_model"])
        host.model = load_saved_adapter(host.model, str(folder))
        host.engine.model = host.model
        return self._attach_sampler(host)

    def release_training_client(self, model_id: str) -> None:
        """LOCAL EXTENSION: this ServiceClient forgets the training client ``model_id`` (for a server whose
        client went away): once nothing else holds it or a sampler of its weights, its adapter, optimizer state
        and engine caches are freed. Its saved checkpoints stay; calls already queued still run."""
        self._training.pop(model_id, None)

    def resident_models(self) -> list[dict[str, object]]:
        """LOCAL EXTENSION: each base model loaded once and shared by every client over it, with its bytes."""
        return [{"base_model": name, "bytes": resident.nbytes} for name, resident in list(self._resident.items())]

    # -- information ------------------------------------------------------------------------
    def create_rest_client(self) -> LocalRestClient:
        """Run and checkpoint queries over this backend's storage folder."""
        return LocalRestClient(self._store)

    def create_custom_loss(self, fn, input_ranks):
        """An APIFuture of a ``LossHandle`` for ``TrainingClient.forward_backward_custom``, as the SDK makes it:
        ``fn(logprobs, <loss_fn_inputs it reads>...) -> (loss, metrics)`` per datum, traced with torch.fx and
        checked by the SDK's own rules (``input_ranks`` gives each parameter's rank). It runs in process;
        only training clients of this ServiceClient accept it."""
        from tinker.lib.public_interfaces.custom_loss import trace_loss

        return completed(trace_loss(fn, input_ranks, self.session_id))

    async def create_custom_loss_async(self, fn, input_ranks):
        return self.create_custom_loss(fn, input_ranks).result()

    def get_server_capabilities(self) -> types.GetServerCapabilitiesResponse:
        """The built-in models; any local folder or cached hub id works as well."""
        return capabilities()

    def copy_weights(self, path: str, *, ttl_seconds: int | None = None,
                     weights_access_token: str | None = None):
        """Finished future of the tinker path of a copy of ``path`` (either kind, which the copy keeps), in a
        new training run of a new session, expiring after ``ttl_seconds`` (recorded; see
        ``RestClient.copy_weights``). The bytes are copied; there are no projects locally."""
        return completed(copy_checkpoint(self._store, path, ttl_seconds))

    def get_telemetry(self) -> None:
        """None: the local backend collects no telemetry (the SDK returns None when it has none)."""
        return None

    async def get_server_capabilities_async(self) -> types.GetServerCapabilitiesResponse:
        return capabilities()

    def close(self, status: str = "success", detail: str | None = None):
        """Stop the worker thread (after the calls already queued). Returns a finished future, as the SDK does."""
        if not self._closed:
            self._closed = True
            _LIVE.discard(self)
            if self._sampling_worker is not None:  # its queued calls first: they may sample on a vLLM server
                self._sampling_worker.shutdown()
            if self._vllm is not None:  # after the queued calls, on the thread its servers die with
                self._worker.run(self._vllm.close)
            self._worker.shutdown()
        return completed(None)

    def cancel_queued(self) -> int:
        """LOCAL EXTENSION, for a server that stops: cancel every call queued and not started (their futures
        raise ``CancelledError``); the running one and calls submitted later still run. How many."""
        sampling = self._sampling_worker
        return self._worker.cancel_pending() + (0 if sampling is None else sampling.cancel_pending())

    def stop_now(self, timeout: float | None = None) -> bool:
        """Local extension, for Ctrl-C: cancel the queued calls, let the running one finish (up to ``timeout``
        seconds), stop a vLLM sampler's servers, stop the worker. True when the worker has ended (nothing runs
        in torch any more); ``close`` afterwards does nothing."""
        sampling = self._sampling_worker
        if self._closed:
            return self._worker.shutdown(timeout=timeout) and (sampling is None or sampling.shutdown(timeout=timeout))
        self._closed = True
        _LIVE.discard(self)
        self._worker.cancel_pending()
        if sampling is not None:
            sampling.cancel_pending()
        if self._vllm is not None:  # queued behind the running call, on the thread its servers die with
            self._worker.submit(self._vllm.close)
        stopped = sampling is None or sampling.shutdown(timeout=timeout)
        return self._worker.shutdown(timeout=timeout) and stopped


class SdkLocalServiceClient(LocalServiceClient):
    """``LocalServiceClient`` with the SDK ServiceClient's constructor, settings read from the environment.

    This is what ``python -m rlrunbook.cookbook`` binds ``tinker.ServiceClient`` to: recipes call
    ``tinker.ServiceClient(user_metadata, project_id, base_url=..., ...)``, whose first positional
    argument is session metadata, not :class:`LocalSettings`.
    """

    def __init__(self, user_metadata: dict[str, str] | None = None, project_id: str | None = None,
                 **sdk_kwargs: object):
        super().__init__(None, user_metadata=user_metadata)


# ServiceClients that serve SamplingClient.from_sampler_handle for samplers not alive in this process, one per
# storage root; stopped with the others (stop_live_services) or at exit.
_HANDLE_SERVICES: dict[Path, LocalServiceClient] = {}


def sampling_client_from_handle(sampler_id: str, base_model: str, model_path: str | None,
                                storage_root: str | None) -> LocalSamplingClient:
    """A client of the sampler a handle names: a second client of it while it is alive in this process, else a
    client of the same weights (the saved ``model_path`` under ``storage_root``, or the base model) made by a
    ServiceClient of this process's settings on that storage."""
    live = sessions.live_sampler(sampler_id)
    if live is not None:
        return live._twin()
    root = None if storage_root is None else Path(storage_root)
    saved = root is not None and model_path is not None and (
        CheckpointStore(root).folder(parse_tinker_path(model_path)) / ADAPTER_FILE).is_file()
    if model_path is not None and not saved:
        raise ModelNotFoundError(
            f"sampler {sampler_id} sampled weights held in memory ({model_path}, not saved), and it is not "
            "alive in this process. Save them with training_client.save_weights_for_sampler(name) and hand "
            "over the handle of service.create_sampling_client(model_path=<its path>)."
        )
    service = _HANDLE_SERVICES.get(root) if root is not None else None
    if service is None or service._closed:
        settings = LocalSettings.from_env()
        if root is not None:
            settings = dataclasses.replace(settings, storage_dir=root)
        service = LocalServiceClient(settings)
        if root is not None:
            _HANDLE_SERVICES[root] = service
    if model_path is not None:
        return service.create_sampling_client(model_path=model_path)
    return service.create_sampling_client(base_model=base_model)


register_handle_resolver(sampling_client_from_handle)
