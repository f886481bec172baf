"""The local TrainingClient: the SDK's training calls on an in-process LoRA trainer."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from tinker import types

from rlrunbook.backend.futures import OrderedWorker
from rlrunbook.backend.host import ModelHost, SamplerWeights
from rlrunbook.backend.lora import clone_adapter
from rlrunbook.backend.sampling_client import LocalSamplingClient
from rlrunbook.backend.trainer import LoraTrainer
from rlrunbook.errors import ConfigError


class LocalTrainingClient:
    """A LoRA training run on a local model. Every call returns at once with an APIFuture;
    calls take effect in submission order (one worker per ServiceClient)."""

    def __init__(self, host: ModelHost, trainer: LoraTrainer, worker: OrderedWorker, *,
                 model_id: str, rank: int, storage_dir: Path, sampling_client_factory):
        self._host = host
        self._trainer = trainer
        self._worker = worker
        self.model_id = model_id
        self._rank = rank
        self._storage_dir = storage_dir
        self._make_sampling_client = sampling_client_factory
        self._snapshots = 0

    def result(self, timeout: float | None = None) -> "LocalTrainingClient":
        return self

    async def result_async(self, timeout: float | None = None) -> "LocalTrainingClient":
        return self

    # -- training -------------------------------------------------------------------------
    def forward(self, data: list[types.Datum], loss_fn: str, loss_fn_config: Mapping[str, float | str] | None = None):
        """APIFuture of the loss and per-datum logprobs, without gradients."""
        return self._worker.submit(self._trainer.forward, list(data), loss_fn, loss_fn_config)

    def forward_backward(self, data: list[types.Datum], loss_fn: str,
                         loss_fn_config: Mapping[str, float | str] | None = None):
        """APIFuture of a ForwardBackwardOutput; gradients accumulate until ``optim_step``."""
        return self._worker.submit(self._trainer.forward_backward, list(data), loss_fn, loss_fn_config)

    async def forward_async(self, data, loss_fn, loss_fn_config=None):
        return self.forward(data, loss_fn, loss_fn_config)

    async def forward_backward_async(self, data, loss_fn, loss_fn_config=None):
        return self.forward_backward(data, loss_fn, loss_fn_config)

    def optim_step(self, optim_params: types.AdamParams | None = None, *, adam_params: types.AdamParams | None = None):
        """APIFuture of an OptimStepResponse (AdamW with optional grad-norm clipping)."""
        if optim_params is not None and adam_params is not None:
            raise ConfigError("pass optim_params or adam_params, not both.")
        params = optim_params if optim_params is not None else adam_params
        if not isinstance(params, types.AdamParams):
            raise ConfigError(f"the local backend optimizes with AdamW: pass types.AdamParams, got {params!r}.")
        return self._worker.submit(self._trainer.optim_step, params)

    async def optim_step_async(self, optim_params=None, *, adam_params=None):
        return self.optim_step(optim_params, adam_params=adam_params)

    # -- sampler weights ------------------------------------------------------------------
    def _snapshot(self) -> SamplerWeights:
        return SamplerWeights(adapter=clone_adapter(self._host.model), version=self._trainer.weights_version)

    def save_weights_for_sampler(self, name: str, ttl_seconds: int | None = None,
                                 user_metadata: dict[str, str] | None = None):
        """Save the adapter under ``tinker://<model_id>/sampler_weights/<name>`` (a local folder)."""
        path = f"tinker://{self.model_id}/sampler_weights/{name}"
        folder = self._storage_dir / self.model_id / "sampler_weights" / name

        def run() -> types.SaveWeightsForSamplerResponse:
            folder.parent.mkdir(parents=True, exist_ok=True)
            self._host.model.save_pretrained(str(folder), save_embedding_layers=False)
            (folder / "rlrunbook_base_model.json").write_text(json.dumps({"base_model": self._host.name}))
            return types.SaveWeightsForSamplerResponse(path=path)

        return self._worker.submit(run)

    async def save_weights_for_sampler_async(self, name, ttl_seconds=None, user_metadata=None):
        return self.save_weights_for_sampler(name, ttl_seconds, user_metadata)

    def save_weights_and_get_sampling_client(self, name: str | None = None, retry_config: object = None,
                                             **_: object) -> LocalSamplingClient:
        """A SamplingClient on the weights as they are after every call submitted so far."""
        self._snapshots += 1
        weights = self._worker.run(self._snapshot)
        path = f"tinker://{self.model_id}/sampler_weights/ephemeral-{self._snapshots}"
        return self._make_sampling_client(self._host, weights, path, self._live_version)

    async def save_weights_and_get_sampling_client_async(self, name=None, retry_config=None, **_):
        return self.save_weights_and_get_sampling_client(name, retry_config)

    def create_sampling_client(self, model_path: str, retry_config: object = None) -> LocalSamplingClient:
        """A SamplingClient on weights saved by ``save_weights_for_sampler``."""
        return self._make_sampling_client(None, None, model_path, None)

    def _live_version(self) -> int:
        return self._trainer.weights_version

    # -- information ----------------------------------------------------------------------
    def get_tokenizer(self):
        return self._host.tokenizer

    def get_info(self) -> types.GetInfoResponse:
        return types.GetInfoResponse(
            model_data=types.ModelData(arch=type(self._host.model.get_base_model()).__name__,
                                       model_name=self._host.name, tokenizer_id=str(self._host.folder)),
            model_id=self.model_id, is_lora=True, lora_rank=self._rank, model_name=self._host.name,
        )

    async def get_info_async(self) -> types.GetInfoResponse:
        return self.get_info()
