"""The local RestClient: the SDK's run and checkpoint queries, answered from the storage folder.

Every method returns a finished SDK future (``.result()`` or ``await``). Calls that only make
sense on the hosted service (publishing, TTLs, projects, billing, sessions) are not here: asking
for one raises an ``AttributeError`` that names it as a hosted-only feature.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from tinker import types

from rlrunbook.backend.futures import completed
from rlrunbook.backend.settings import LocalSettings
from rlrunbook.backend.storage import (
    CheckpointStore,
    RunRecord,
    TinkerPath,
    folder_size,
    modified_at,
    parse_tinker_path,
)
from rlrunbook.backend.unsupported import refuse_sdk_attribute
from rlrunbook.models import BUILTIN_MODELS


def _checkpoint(path: TinkerPath, folder) -> types.Checkpoint:
    return types.Checkpoint(checkpoint_id=f"{path.kind}/{path.name}", checkpoint_type=path.checkpoint_type,
                            time=modified_at(folder), tinker_path=path.path, size_bytes=folder_size(folder))


def capabilities() -> types.GetServerCapabilitiesResponse:
    """The built-in models; any local folder or cached hub id works as well."""
    from tinker.types.get_server_capabilities_response import SupportedModel

    return types.GetServerCapabilitiesResponse(
        supported_models=[SupportedModel(model_name=name, trainable=True, sampleable=True) for name in BUILTIN_MODELS]
    )


class LocalRestClient:
    """Runs and checkpoints of the local backend, read from ``store`` (default: ``TINKER_LOCAL_STORAGE``).

    Keyword arguments the SDK's RestClient takes (``base_url``, ``api_key``) are accepted and ignored.
    """

    def __init__(self, store: CheckpointStore | None = None, **_sdk_kwargs: object):
        self._store = store if store is not None else CheckpointStore(LocalSettings.from_env().resolved_storage_dir())

    def __getattr__(self, name: str) -> Any:
        from tinker.lib.public_interfaces.rest_client import RestClient

        raise refuse_sdk_attribute("RestClient", RestClient, name)

    def get_server_capabilities(self):
        return completed(capabilities())

    def _training_run(self, record: RunRecord) -> types.TrainingRun:
        saved = self._store.checkpoints(record.model_id)
        last = {kind: [(p, f) for p, f in saved if p.kind == kind] for kind in ("weights", "sampler_weights")}
        return types.TrainingRun(
            training_run_id=record.model_id, base_model=record.base_model, model_owner="local", is_lora=True,
            lora_rank=record.lora_rank,
            last_request_time=max([modified_at(f) for _, f in saved],
                                  default=datetime.fromtimestamp(record.created, tz=timezone.utc)),
            last_checkpoint=_checkpoint(*last["weights"][-1]) if last["weights"] else None,
            last_sampler_checkpoint=_checkpoint(*last["sampler_weights"][-1]) if last["sampler_weights"] else None,
            user_metadata=dict(record.user_metadata) or None,
        )

    def get_training_run(self, training_run_id: str, access_scope: str = "owned"):
        """Finished future of the run's TrainingRun (base model, rank, last checkpoints, user metadata)."""
        return completed(self._training_run(self._store.read_run(training_run_id)))

    def get_training_run_by_tinker_path(self, tinker_path: str, access_scope: str = "owned"):
        return self.get_training_run(parse_tinker_path(tinker_path).model_id)

    def get_weights_info_by_tinker_path(self, tinker_path: str):
        record = self._store.read_run(parse_tinker_path(tinker_path).model_id)
        return completed(types.WeightsInfoResponse(
            base_model=record.base_model, is_lora=True, lora_rank=record.lora_rank,
            train_unembed=record.train_unembed, train_mlp=record.train_mlp, train_attn=record.train_attn))

    def list_training_runs(self, limit: int = 20, offset: int = 0, access_scope: str = "owned",
                           project_id: str | None = None):
        ids = list(reversed(self._store.run_ids()))  # newest first
        runs = [self._training_run(self._store.read_run(i)) for i in ids[offset:offset + limit]]
        return completed(types.TrainingRunsResponse(
            training_runs=runs, cursor=types.Cursor(offset=offset, limit=limit, total_count=len(ids))))

    def list_checkpoints(self, training_run_id: str):
        self._store.read_run(training_run_id)  # a clear error for an unknown run
        return completed(types.CheckpointsListResponse(
            checkpoints=[_checkpoint(p, f) for p, f in self._store.checkpoints(training_run_id)]))

    def list_user_checkpoints(self, limit: int = 100, offset: int = 0, **_: object):
        everything = [_checkpoint(p, f) for i in self._store.run_ids() for p, f in self._store.checkpoints(i)]
        everything.sort(key=lambda c: c.time, reverse=True)
        return completed(types.CheckpointsListResponse(
            checkpoints=everything[offset:offset + limit],
            cursor=types.Cursor(offset=offset, limit=limit, total_count=len(everything))))

    def delete_checkpoint(self, training_run_id: str, checkpoint_id: str):
        return self.delete_checkpoint_from_tinker_path(f"tinker://{training_run_id}/{checkpoint_id}")

    def delete_checkpoint_from_tinker_path(self, tinker_path: str):
        self._store.delete(parse_tinker_path(tinker_path))
        return completed(None)
