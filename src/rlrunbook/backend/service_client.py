"""The local ServiceClient: creates training and sampling clients on in-process models.

``tinker://<model_id>/sampler_weights/<name>`` paths map onto folders under the storage
directory (``TINKER_LOCAL_STORAGE``); each holds a peft adapter and the name of its base model.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

from peft import PeftModel, set_peft_model_state_dict
from safetensors.torch import load_file
from tinker import types
from tinker.types.get_server_capabilities_response import SupportedModel

from rlrunbook.backend.futures import OrderedWorker
from rlrunbook.backend.host import ModelHost, SamplerWeights, load_host
from rlrunbook.backend.lora import clone_adapter, load_adapter, wrap_with_lora
from rlrunbook.backend.sampling_client import LocalSamplingClient
from rlrunbook.backend.settings import LocalSettings
from rlrunbook.backend.trainer import LoraTrainer
from rlrunbook.backend.training_client import LocalTrainingClient
from rlrunbook.errors import ConfigError, ModelNotFoundError
from rlrunbook.models import BUILTIN_MODELS

_BASE_MODEL_FILE = "rlrunbook_base_model.json"


class LocalServiceClient:
    """Entry point of the local backend, with the SDK ServiceClient's creation methods.

    Keyword arguments the hosted SDK takes (``api_key``, ``base_url``, ...) are accepted and
    ignored, so code written for the service constructs this one unchanged.
    """

    def __init__(self, settings: LocalSettings | None = None, **_sdk_kwargs: object):
        self.settings = settings if settings is not None else LocalSettings.from_env()
        self._worker = OrderedWorker(max_batch_rows=self.settings.max_batch_rows)
        self._base_hosts: dict[str, ModelHost] = {}
        self._training: dict[str, LocalTrainingClient] = {}

    def result(self, timeout: float | None = None) -> "LocalServiceClient":
        return self

    # -- training ---------------------------------------------------------------------------
    def create_lora_training_client(
        self, base_model: str, rank: int = 32, seed: int | None = None, train_mlp: bool = True,
        train_attn: bool = True, train_unembed: bool = True, user_metadata: dict[str, str] | None = None,
        optimizer: object = None,
    ) -> LocalTrainingClient:
        """A LoRA training client on a fresh copy of ``base_model`` (a built-in name, folder or hub id)."""
        if optimizer is not None and not isinstance(optimizer, types.AdamOptimizerConfig):
            raise ConfigError(f"the local backend trains with AdamW only; got optimizer={optimizer!r}.")
        settings = self.settings

        def build() -> LocalTrainingClient:
            host = load_host(base_model, settings)
            host.model = wrap_with_lora(
                host.model, rank=rank, alpha=settings.lora_alpha, seed=settings.seed if seed is None else seed,
                train_attn=train_attn, train_mlp=train_mlp, train_unembed=train_unembed,
            )
            host.engine.model = host.model
            trainer = LoraTrainer(host.model, pad_token_id=host.pad_token_id,
                                  vocab_size=host.engine.vocab_size, grad_accum_chunks=settings.grad_accum_chunks)
            model_id = f"local-{uuid.uuid4().hex[:12]}"
            client = LocalTrainingClient(host, trainer, self._worker, model_id=model_id, rank=rank,
                                         storage_dir=settings.resolved_storage_dir(),
                                         sampling_client_factory=self._sampling_client)
            return client

        client = self._worker.run(build)
        self._training[client.model_id] = client
        return client

    async def create_lora_training_client_async(self, base_model: str, rank: int = 32, seed: int | None = None,
                                                **kwargs: object) -> LocalTrainingClient:
        return self.create_lora_training_client(base_model, rank, seed, **kwargs)

    # -- sampling ---------------------------------------------------------------------------
    def create_sampling_client(self, model_path: str | None = None, base_model: str | None = None,
                               retry_config: object = None, **_: object) -> LocalSamplingClient:
        """A SamplingClient on saved sampler weights (``model_path``) or on a base model."""
        if (model_path is None) == (base_model is None):
            raise ConfigError("pass exactly one of model_path (saved sampler weights) or base_model.")
        return self._sampling_client(None, None, model_path, None, base_model=base_model)

    async def create_sampling_client_async(self, model_path=None, base_model=None, retry_config=None, **_):
        return self.create_sampling_client(model_path, base_model, retry_config)

    def _sampling_client(self, host: ModelHost | None, weights: SamplerWeights | None, model_path: str | None,
                         live_version, *, base_model: str | None = None) -> LocalSamplingClient:
        if host is not None and weights is not None:
            return LocalSamplingClient(host, weights, self._worker, live_version, model_path)
        if base_model is not None:
            host = self._worker.run(self._base_host, base_model)
            return LocalSamplingClient(host, SamplerWeights.base(), self._worker, lambda: None, None)
        assert model_path is not None
        model_id, folder = self._parse_path(model_path)
        live = self._training.get(model_id)
        if live is not None:
            weights = self._worker.run(self._read_adapter, live._host, folder)
            return LocalSamplingClient(live._host, weights, self._worker, live._live_version, model_path)
        host = self._worker.run(self._host_from_adapter, folder)
        return LocalSamplingClient(host, SamplerWeights(adapter=clone_adapter(host.model), version=0),
                                   self._worker, lambda: 0, model_path)

    def _base_host(self, base_model: str) -> ModelHost:
        if base_model not in self._base_hosts:
            self._base_hosts[base_model] = load_host(base_model, self.settings)
        return self._base_hosts[base_model]

    def _parse_path(self, model_path: str) -> tuple[str, Path]:
        prefix = "tinker://"
        parts = model_path[len(prefix):].split("/") if model_path.startswith(prefix) else []
        if len(parts) != 3 or parts[1] != "sampler_weights":
            raise ConfigError(f"model_path {model_path!r} is not of the form tinker://<model_id>/sampler_weights/<name>.")
        folder = self.settings.resolved_storage_dir() / parts[0] / "sampler_weights" / parts[2]
        if not (folder / "adapter_config.json").is_file():
            raise ModelNotFoundError(
                f"no saved sampler weights at {model_path} (looked in {folder}); save them first with "
                "training_client.save_weights_for_sampler(name), or check TINKER_LOCAL_STORAGE."
            )
        return parts[0], folder

    @staticmethod
    def _read_adapter(host: ModelHost, folder: Path) -> SamplerWeights:
        live = clone_adapter(host.model)
        set_peft_model_state_dict(host.model, load_file(str(folder / "adapter_model.safetensors")))
        snapshot = clone_adapter(host.model)
        load_adapter(host.model, live)
        return SamplerWeights(adapter=snapshot, version=-1)

    def _host_from_adapter(self, folder: Path) -> ModelHost:
        meta = folder / _BASE_MODEL_FILE
        base_model = json.loads(meta.read_text())["base_model"] if meta.is_file() else None
        if base_model is None:
            raise ModelNotFoundError(f"{folder} does not name its base model ({_BASE_MODEL_FILE} missing).")
        host = load_host(base_model, self.settings)
        host.model = PeftModel.from_pretrained(host.model, str(folder))
        host.engine.model = host.model
        return host

    # -- information ------------------------------------------------------------------------
    def get_server_capabilities(self) -> types.GetServerCapabilitiesResponse:
        """The built-in models; any local folder or cached hub id works as well."""
        return types.GetServerCapabilitiesResponse(
            supported_models=[SupportedModel(model_name=name) for name in BUILTIN_MODELS]
        )

    def close(self) -> None:
        self._worker.shutdown()
