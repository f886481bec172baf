"""The local TrainingClient: the SDK's training calls on an in-process LoRA trainer."""

from __future__ import annotations

from collections.abc import Mapping

from tinker import types

from rlrunbook.adam_params import check_adam_params
from rlrunbook.backend import sharding
from rlrunbook.backend.futures import ResolvedClient, WorkerLane
from rlrunbook.backend.lora import clone_adapter, snapshot_loaded
from rlrunbook.backend.model_host import ModelHost, SamplerWeights
from rlrunbook.backend.model_state import (
    age_recipients,
    load_training_state,
    save_training_state,
    write_adapter,
    write_external_weights,
)
from rlrunbook.backend.sampling_client import LocalSamplingClient, refuse_stability_info
from rlrunbook.backend.storage import (
    CheckpointStore,
    TinkerPath,
    check_ttl,
    checkpoint_name,
    parse_tinker_path,
    set_expiry,
    staged_folder,
)
from rlrunbook.backend.trainer import Trainer, TrainingState
from rlrunbook.backend.unsupported import refuse_sdk_attribute
from rlrunbook.errors import ConfigError


class LocalTrainingClient(ResolvedClient):
    """A LoRA training run on a local model. Every call returns at once with an APIFuture;
    calls take effect in submission order (one worker per ServiceClient).

    Like the SDK's client futures it also resolves to itself (``.result()``, ``await``).
    """

    def __init__(self, host: ModelHost, trainer: Trainer, worker: WorkerLane, *,
                 model_id: str, rank: int, store: CheckpointStore, sampling_client_factory,
                 session_id: str = ""):
        self._host = host
        self._trainer = trainer
        self._worker = worker
        self.model_id = model_id
        self._rank = rank
        self._store = store
        self._make_sampling_client = sampling_client_factory
        self._snapshots = 0
        self.session_id = session_id  # LossHandles of this session only (ServiceClient.create_custom_loss)
        self._custom_loss_failure: Exception | None = None  # after it, training calls are refused (the SDK's rule)

    def __getattr__(self, name: str):
        from tinker.lib.public_interfaces.training_client import TrainingClient

        raise refuse_sdk_attribute("TrainingClient", TrainingClient, name)

    def engine_metrics(self) -> dict[str, float]:
        """LOCAL EXTENSION: counters of the in-process sampling engine (``engine/graph_captures``,
        ``engine/cache_rebuilds``); empty when another engine samples."""
        return self._host.engine.metrics() if self._host.vllm is None else {}

    # -- training -------------------------------------------------------------------------
    def forward(self, data: list[types.Datum], loss_fn: str, loss_fn_config: Mapping[str, float | str] | None = None):
        """APIFuture of the loss and per-datum logprobs, without gradients."""
        return self._worker.submit(self._training_call(self._trainer.forward), list(data), loss_fn, loss_fn_config)

    @property
    def collective_passes(self) -> bool:
        """LOCAL EXTENSION: whether every rank of a torchrun launch must make every ``forward``/``forward_backward``
        call in the same order (full-parameter training: its passes are collectives); a rank with no datums then
        calls with an empty list, which joins the others' passes."""
        return self._trainer.collective_passes

    def forward_backward(self, data: list[types.Datum], loss_fn: str,
                         loss_fn_config: Mapping[str, float | str] | None = None):
        """APIFuture of a ForwardBackwardOutput; gradients accumulate until ``optim_step``.

        ``loss_fn_config`` is passed to the trainer unchanged. Besides the loss's own keys the local backend
        accepts ``kl_coef``, ``kl_estimator`` and ``entropy_coef`` (a LOCAL EXTENSION: the hosted service
        rejects them); see ``Trainer.forward_backward`` for their meaning and the metrics they add.
        """
        return self._worker.submit(self._training_call(self._trainer.forward_backward), list(data), loss_fn,
                                   loss_fn_config)

    def forward_backward_custom(self, data: list[types.Datum], loss_fn, *, loss_type_input: str | None = None):
        """APIFuture of a ForwardBackwardOutput for a loss computed by ``loss_fn`` (the SDK's contract): a callable
        ``loss_fn(data, logprobs_list) -> (loss, metrics)`` or a ``LossHandle`` of
        ``ServiceClient.create_custom_loss``, given one float32 tensor of target logprobs per datum; its
        gradient accumulates until ``optim_step``, like ``forward_backward``'s. ``metrics`` holds the loss's
        own metrics and ``loss:sum``, the loss's value.

        In process the loss's gradient reaches the adapter through autograd (one forward and one backward where
        the batch is one micro-batch; see :mod:`rlrunbook.backend.custom_loss`). A loss that raises or returns
        anything but a finite scalar fails this call, naming the cause; as with the SDK, this client then
        refuses its queued and later training calls.
        """
        from tinker.lib.public_interfaces.custom_loss import LossHandle, check_loss_inputs

        if loss_type_input not in (None, "logprobs"):
            raise ConfigError(f"loss_type_input={loss_type_input!r}: the loss always receives logprobs (the SDK "
                              "deprecated this argument); leave it out.")
        data = list(data)
        if isinstance(loss_fn, LossHandle):
            if loss_fn.session_id != self.session_id:
                raise ConfigError(f"LossHandle {loss_fn.name!r} was created by another ServiceClient (session "
                                  f"{loss_fn.session_id}); create it with this client's ServiceClient.")
            check_loss_inputs(loss_fn, data)
        elif not callable(loss_fn):
            raise ConfigError(f"loss_fn must be a callable (data, logprobs_list) -> (loss, metrics) or a LossHandle, "
                              f"got {type(loss_fn).__name__}.")
        return self._worker.submit(self._training_call(self._custom_step), data, loss_fn)

    async def forward_backward_custom_async(self, data, loss_fn, *, loss_type_input=None):
        return self.forward_backward_custom(data, loss_fn, loss_type_input=loss_type_input)

    def _custom_step(self, data: list[types.Datum], loss_fn) -> types.ForwardBackwardOutput:
        from rlrunbook.backend.custom_loss import CustomLossError

        try:
            return self._trainer.forward_backward_custom(data, loss_fn)
        except CustomLossError as error:
            self._custom_loss_failure = error
            raise

    def _training_call(self, fn):
        """``fn``, refused when it runs if a custom loss failed before it (queued calls included)."""
        def run(*args, **kwargs):
            if self._custom_loss_failure is not None:
                raise ConfigError(f"this training client stopped after a failed forward_backward_custom "
                                  f"({self._custom_loss_failure}); as with the Tinker SDK its later training calls "
                                  "are refused. Create a new training client (load_state restores saved weights).")
            return fn(*args, **kwargs)

        run.__qualname__ = getattr(fn, "__qualname__", "training_call")
        return run

    def forward_on_sampler_weights(self, sampler: LocalSamplingClient, data: list[types.Datum], loss_fn: str,
                                   loss_fn_config: Mapping[str, float | str] | None = None):
        """LOCAL EXTENSION: ``forward`` computed with the weights ``sampler`` samples (one of this client's
        snapshots), in order with the other training calls; the live adapter (and any accumulated gradient) is
        as it was afterwards. An asynchronous loop measures with it the sampler-trainer mismatch at equal
        weights (numerics alone), apart from the lag of a batch sampled from older weights."""
        self._refuse_full("forward_on_sampler_weights",
                          "it computes with a sampler's copy of past weights, and full-parameter training keeps none")
        adapter = sampler.weights_state()
        if adapter is None:
            raise ConfigError("forward_on_sampler_weights needs a sampler of this client's adapter, not the base model.")

        def run() -> types.ForwardBackwardOutput:
            with snapshot_loaded(self._host.model, adapter):
                return self._trainer.forward(list(data), loss_fn, loss_fn_config)

        return self._worker.submit(run)

    async def forward_async(self, data, loss_fn, loss_fn_config=None):
        return self.forward(data, loss_fn, loss_fn_config)

    async def forward_backward_async(self, data, loss_fn, loss_fn_config=None):
        return self.forward_backward(data, loss_fn, loss_fn_config)

    def optim_step(self, optim_params: types.AdamParams | None = None, *, adam_params: types.AdamParams | None = None):
        """APIFuture of an OptimStepResponse (AdamW with optional grad-norm clipping).

        Its metrics: ``grad_norm:mean``, ``learning_rate:mean`` and ``loss:sum``, the summed loss of
        the forward_backward calls whose gradients this step applied.
        """
        if optim_params is not None and adam_params is not None:
            raise ConfigError("pass optim_params or adam_params, not both.")
        params = optim_params if optim_params is not None else adam_params
        if not isinstance(params, types.AdamParams):
            raise ConfigError(f"the local backend optimizes with AdamW: pass types.AdamParams, got {params!r}.")
        check_adam_params(params)  # before the step is queued: a refused step leaves the weights as they are
        return self._worker.submit(self._training_call(self._trainer.optim_step), params)

    async def optim_step_async(self, optim_params=None, *, adam_params=None):
        return self.optim_step(optim_params, adam_params=adam_params)

    # -- training state ---------------------------------------------------------------------
    def save_state(self, name: str, ttl_seconds: int | None = None, overwrite: bool = False,
                   user_metadata: dict[str, str] | None = None):
        """APIFuture of a SaveWeightsResponse: adapter and optimizer under ``tinker://<model_id>/weights/<name>``.

        Restore it with ``service.create_training_client_from_state(_with_optimizer)(path)`` or
        ``load_state(_with_optimizer)(path)``. A name that exists is refused unless ``overwrite``.
        ``ttl_seconds`` is recorded (the checkpoint's ``expires_at``); local checkpoints are not deleted
        when it passes.
        """
        self._refuse_full("save_state", "the Tinker API's checkpoint folders hold LoRA adapters")
        path = TinkerPath(self.model_id, "weights", checkpoint_name(name))
        folder = self._store.folder(path)
        check_ttl(ttl_seconds)

        def run() -> types.SaveWeightsResponse:
            if folder.exists() and not overwrite:
                raise ConfigError(f"checkpoint {path.path} exists; pass overwrite=True or choose another name.")
            with staged_folder(folder) as staging:
                save_training_state(self._host, self._trainer, staging)
                set_expiry(staging, ttl_seconds)
            return types.SaveWeightsResponse(path=path.path)

        return self._worker.submit(run)

    async def save_state_async(self, name, ttl_seconds=None, overwrite=False, user_metadata=None):
        return self.save_state(name, ttl_seconds, overwrite, user_metadata)

    def load_state(self, path: str, weights_access_token: str | None = None):
        """APIFuture of a LoadWeightsResponse: the checkpoint's adapter replaces this run's; the optimizer restarts."""
        return self._load(path, with_optimizer=False)

    def load_state_with_optimizer(self, path: str, weights_access_token: str | None = None):
        """Like ``load_state``, and AdamW's moments and step counts continue from the checkpoint."""
        return self._load(path, with_optimizer=True)

    async def load_state_async(self, path, weights_access_token=None):
        return self.load_state(path)

    async def load_state_with_optimizer_async(self, path, weights_access_token=None):
        return self.load_state_with_optimizer(path)

    def _load(self, path: str, *, with_optimizer: bool):
        self._refuse_full("load_state", "the Tinker API's checkpoint folders hold LoRA adapters")
        parsed = parse_tinker_path(path, kind="weights")
        folder = self._store.existing_folder(parsed)

        def run() -> types.LoadWeightsResponse:
            load_training_state(self._host, self._trainer, folder, with_optimizer=with_optimizer)
            return types.LoadWeightsResponse(path=path)

        return self._worker.submit(run)

    def export_training_state(self, *, sharded: bool = False) -> TrainingState:
        """Local extension (no SDK counterpart): the adapter and AdamW state in memory, as they are after
        every call submitted so far. Blocks until then. For checkpoints that live outside the storage dir.
        Full-parameter training under torchrun: a collective (every rank calls it); the state lands on rank 0, or
        with ``sharded`` each rank gets its own shards (``shard`` set), as sharded checkpoints keep them."""
        return self._worker.run(self._trainer.export_state, sharded=sharded)

    def import_training_state(self, state: TrainingState, *, with_optimizer: bool = True) -> None:
        """Local extension: replace the adapter (and, with ``with_optimizer``, AdamW's state) by ``state``.

        Needs no training step: ``save_weights_and_get_sampling_client()`` afterwards samples the imported
        adapter. ``ConfigError`` if its LoRA layout differs from this client's."""
        self._worker.run(self._trainer.import_state, state, with_optimizer=with_optimizer)

    # -- sampler weights ------------------------------------------------------------------
    def _snapshot(self) -> SamplerWeights:
        if self._trainer.full_parameters:  # no copy: valid until the next optimizer step (see active_weights)
            return SamplerWeights(adapter=None, version=self._trainer.weights_version, full=True)
        return SamplerWeights(adapter=clone_adapter(self._host.model), version=self._trainer.weights_version)

    def _refuse_full(self, call: str, reason: str) -> None:
        if self._trainer.full_parameters:
            raise ConfigError(f"{call} of a full-parameter training client is not available: {reason}. Sample the "
                              "live weights with save_weights_and_get_sampling_client(); keep and restore training "
                              "state with export_training_state()/import_training_state() (what `rlrunbook train` "
                              "checkpoints use).")

    def save_weights_for_sampler(self, name: str, ttl_seconds: int | None = None,
                                 user_metadata: dict[str, str] | None = None):
        """Save the adapter under ``tinker://<model_id>/sampler_weights/<name>`` (a local folder);
        ``ttl_seconds`` is recorded as for ``save_state``."""
        self._refuse_full("save_weights_for_sampler", "the Tinker API's checkpoint folders hold LoRA adapters")
        path = TinkerPath(self.model_id, "sampler_weights", checkpoint_name(name))
        folder = self._store.folder(path)
        check_ttl(ttl_seconds)

        def run() -> types.SaveWeightsForSamplerResponse:
            with staged_folder(folder) as staging:
                write_adapter(self._host, staging)
                set_expiry(staging, ttl_seconds)
            return types.SaveWeightsForSamplerResponse(path=path.path)

        return self._worker.submit(run)

    async def save_weights_for_sampler_async(self, name, ttl_seconds=None, user_metadata=None):
        return self.save_weights_for_sampler(name, ttl_seconds, user_metadata)

    def save_weights_external(self, name: str, ttl_seconds: int | None = None,
                              age_encryption_recipients: list[str] | None = None):
        """APIFuture of a SaveWeightsExternalResponse: the adapter as a peft folder (``adapter_config.json``,
        ``adapter_model.safetensors``) under ``tinker://<model_id>/external_weights/<name>``, replacing an
        export of that name. With ``age_encryption_recipients`` every file is age-encrypted to them
        (``<file>.age``).

        ``rest_client.get_external_weights_urls(path)`` gives a ``file://`` URL per file, so
        ``tinker_cookbook.weights.download`` fetches it as from the service; ``ttl_seconds`` is recorded as
        for ``save_state``."""
        self._refuse_full("save_weights_external", "it writes a peft adapter folder")
        path = TinkerPath(self.model_id, "external_weights", checkpoint_name(name))
        folder = self._store.folder(path)
        check_ttl(ttl_seconds)
        recipients = age_recipients(age_encryption_recipients)

        def run() -> types.SaveWeightsExternalResponse:
            with staged_folder(folder) as staging:
                write_external_weights(self._host, staging, recipients)
                set_expiry(staging, ttl_seconds)
            return types.SaveWeightsExternalResponse(path=path.path)

        return self._worker.submit(run)

    async def save_weights_external_async(self, name, ttl_seconds=None, age_encryption_recipients=None):
        """The SDK's (deprecated) coroutine twin; like the SDK's, it returns the APIFuture, not its result."""
        return self.save_weights_external(name, ttl_seconds, age_encryption_recipients)

    def save_weights_and_get_sampling_client(self, name: str | None = None, retry_config: object = None,
                                             record_stability_info: bool = False,
                                             **_: object) -> LocalSamplingClient:
        """A SamplingClient on the weights as they are after every call submitted so far.

        Several such clients stay valid at once (each samples its own snapshot), as off-policy
        training needs.
        """
        refuse_stability_info(record_stability_info)
        self._snapshots += 1
        weights = self._worker.run(self._snapshot)
        path = f"tinker://{self.model_id}/sampler_weights/ephemeral-{self._snapshots}"
        return self._make_sampling_client(self._host, weights, path, self._live_version)

    async def save_weights_and_get_sampling_client_async(self, name=None, retry_config=None,
                                                         record_stability_info=False, **_):
        return self.save_weights_and_get_sampling_client(name, retry_config, record_stability_info)

    def create_sampling_client(self, model_path: str, retry_config: object = None,
                               record_stability_info: bool = False) -> LocalSamplingClient:
        """A SamplingClient on weights saved by ``save_weights_for_sampler`` (or ``save_state``)."""
        refuse_stability_info(record_stability_info)
        return self._make_sampling_client(None, None, model_path, None)

    async def create_sampling_client_async(self, model_path, retry_config=None, record_stability_info=False):
        return self.create_sampling_client(model_path, retry_config, record_stability_info)

    def _live_version(self) -> int:
        return self._trainer.weights_version

    # -- information ----------------------------------------------------------------------
    def memory_bytes(self) -> dict[str, int]:
        """LOCAL EXTENSION: bytes this client holds now beside its base model's shared weights (``adapter``,
        ``gradients``, ``optimizer``); read without waiting for queued calls. Its engine's caches come on top
        while it samples."""
        for _ in range(3):
            try:
                return self._trainer.state_bytes()
            except RuntimeError:  # the optimizer's state grew while it was read (its first step): read again
                continue
        return self._trainer.state_bytes()

    def get_tokenizer(self):
        return self._host.tokenizer

    def get_telemetry(self) -> None:
        """None: the local backend collects no telemetry (the SDK returns None when it has none)."""
        return None

    def get_info(self) -> types.GetInfoResponse:
        return types.GetInfoResponse(
            model_data=types.ModelData(arch=sharding.architecture(self._host.model),
                                       model_name=self._host.name, tokenizer_id=str(self._host.folder)),
            model_id=self.model_id, is_lora=not self._trainer.full_parameters,
            lora_rank=None if self._trainer.full_parameters else self._rank, model_name=self._host.name,
        )

    async def get_info_async(self) -> types.GetInfoResponse:
        return self.get_info()
