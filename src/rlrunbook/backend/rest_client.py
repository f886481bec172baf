"""The local RestClient: the SDK's run, checkpoint and session queries, answered from the storage folder.

Every method returns a finished SDK future (``.result()`` or ``await``); each ``*_async`` twin is a
coroutine of the same result, as the SDK's. Calls that only make sense on the hosted service
(publishing, projects, billing, identity) are not here: asking for one raises an ``AttributeError``
that names it and the reason (:mod:`rlrunbook.backend.unsupported`).
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from typing import Any

from tinker import types

from rlrunbook.backend import sessions
from rlrunbook.backend.futures import completed
from rlrunbook.backend.settings import LocalSettings
from rlrunbook.backend.storage import (
    CHECKPOINT_FILE,
    CheckpointStore,
    RunRecord,
    TinkerPath,
    check_ttl,
    expires_at,
    folder_size,
    modified_at,
    parse_tinker_path,
    set_expiry,
)
from rlrunbook.backend.unsupported import refuse_sdk_attribute
from rlrunbook.errors import ConfigError, ModelNotFoundError
from rlrunbook.models import BUILTIN_MODELS

# How long get_external_weights_urls says its file:// URLs are good for. They never expire; a day ahead keeps
# code that re-signs URLs shortly before they expire (tinker_cookbook.weights.download) from doing it at once.
URL_LIFETIME = timedelta(days=1)


def _checkpoint(path: TinkerPath, folder) -> types.Checkpoint:
    return types.Checkpoint(checkpoint_id=f"{path.kind}/{path.name}", checkpoint_type=path.checkpoint_type,
                            time=modified_at(folder), tinker_path=path.path, size_bytes=folder_size(folder),
                            expires_at=expires_at(folder))


def _awaiting(name: str):
    """The SDK's ``<name>_async`` twin: a coroutine of what ``<name>``'s future resolves to."""
    async def twin(self, *args: Any, **kwargs: Any) -> Any:
        return await getattr(self, name)(*args, **kwargs)

    twin.__name__ = twin.__qualname__ = f"{name}_async"
    twin.__doc__ = f"``await rest_client.{name}(...)``: the SDK's (deprecated) coroutine twin of ``{name}``."
    return twin


def new_run_id() -> str:
    """A fresh run id of the local backend's form (``local-<12 hex digits>``)."""
    return f"local-{uuid.uuid4().hex[:12]}"


def copy_checkpoint(store: CheckpointStore, path: str, ttl_seconds: int | None, model_id: str | None = None) -> str:
    """Copy the checkpoint at ``path`` into a new training run of a new session (the SDK's ``copy_weights``):
    the same kind and name, a byte copy, the source's expiry not inherited. Returns the copy's tinker path.
    ``model_id`` names the new run (default: a fresh :func:`new_run_id`), so a caller can record it first."""
    check_ttl(ttl_seconds)
    source = parse_tinker_path(path)
    store.existing_folder(source, encrypted_ok=True)
    record = dataclasses.replace(store.read_run(source.model_id), model_id=model_id or new_run_id(),
                                 session_id=sessions.new_session_id(), created=time.time())
    store.write_run(record)
    target = store.copy(source, record.model_id)
    set_expiry(store.folder(target), ttl_seconds)
    return target.path


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

    def get_telemetry(self) -> None:
        """None: the local backend collects no telemetry (the SDK returns None when it has none)."""
        return None

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
        """The run's LoRA layout of the checkpoint at ``tinker_path``; ``ModelNotFoundError`` when the run has no
        checkpoint of that name (an encrypted export counts: its layout is the run's)."""
        path = parse_tinker_path(tinker_path)
        record = self._store.read_run(path.model_id)
        self._store.existing_folder(path, encrypted_ok=True)
        return completed(types.WeightsInfoResponse(
            base_model=record.base_model, is_lora=True, lora_rank=record.lora_rank,
            train_unembed=record.train_unembed, train_mlp=record.train_mlp, train_attn=record.train_attn))

    def list_training_runs(self, limit: int = 20, offset: int = 0, access_scope: str = "owned",
                           project_id: str | None = None, *, visible: Callable[[str], bool] | None = None):
        """Future of a TrainingRunsResponse, newest first; ``visible`` (a server's tenant check) filters the runs
        before ``offset`` and ``limit`` apply."""
        ids = [i for i in reversed(self._store.run_ids()) if visible is None or visible(i)]  # newest first
        runs = [self._training_run(self._store.read_run(i)) for i in ids[offset:offset + limit]]
        return completed(types.TrainingRunsResponse(
            training_runs=runs, cursor=types.Cursor(offset=offset, limit=limit, total_count=len(ids))))

    def list_checkpoints(self, training_run_id: str):
        self._store.read_run(training_run_id)  # a clear error for an unknown run
        return completed(types.CheckpointsListResponse(
            checkpoints=[_checkpoint(p, f) for p, f in self._store.checkpoints(training_run_id)]))

    def list_user_checkpoints(self, limit: int = 100, offset: int = 0, *,
                              visible: Callable[[str], bool] | None = None, **_: object):
        """Future of a CheckpointsListResponse of every run's checkpoints, newest first (``visible``: as for
        :meth:`list_training_runs`)."""
        everything = [_checkpoint(p, f) for i in self._store.run_ids() if visible is None or visible(i)
                      for p, f in self._store.checkpoints(i)]
        everything.sort(key=lambda c: c.time, reverse=True)
        return completed(types.CheckpointsListResponse(
            checkpoints=everything[offset:offset + limit],
            cursor=types.Cursor(offset=offset, limit=limit, total_count=len(everything))))

    def delete_checkpoint(self, training_run_id: str, checkpoint_id: str):
        return self.delete_checkpoint_from_tinker_path(f"tinker://{training_run_id}/{checkpoint_id}")

    def delete_checkpoint_from_tinker_path(self, tinker_path: str):
        self._store.delete(parse_tinker_path(tinker_path))
        return completed(None)

    # -- checkpoints: copies, expiry, external weights ----------------------------------------
    def copy_weights(self, path: str, destination_project_id: str | None = None, *,
                     ttl_seconds: int | None = None, weights_access_token: str | None = None):
        """Future of the tinker path of a copy of ``path`` (either kind), in a new run of a new session.

        Locally the bytes are copied (the service shares them); there are no projects, so
        ``destination_project_id`` (and ``TINKER_PROJECT_ID``) is not needed and is ignored."""
        return completed(copy_checkpoint(self._store, path, ttl_seconds))

    def set_checkpoint_ttl_from_tinker_path(self, tinker_path: str, ttl_seconds: int | None):
        """Record that the checkpoint expires ``ttl_seconds`` from now (None: never), shown as its
        ``expires_at`` in listings. Once it passes, the checkpoint is gone for every use but deletion; in process
        nothing deletes its files, ``rlrunbook serve`` removes them
        (:meth:`~rlrunbook.backend.storage.CheckpointStore.remove_expired`)."""
        parsed = parse_tinker_path(tinker_path)
        set_expiry(self._store.existing_folder(parsed, encrypted_ok=True), ttl_seconds)
        return completed(None)

    def get_external_weights_urls(self, tinker_path: str):
        """Future of an ExternalWeightsUrlsResponse: a ``file://`` URL per file of a ``save_weights_external``
        checkpoint (keyed by its path in the checkpoint), which ``urllib`` reads as it reads signed URLs."""
        parsed = parse_tinker_path(tinker_path)
        if parsed.kind != "external_weights":
            raise ConfigError(f"get_external_weights_urls only accepts external weights checkpoints "
                              f"(tinker://<training_run_id>/external_weights/<name>), got {tinker_path!r}; "
                              "make one with training_client.save_weights_external(name).")
        folder = self._store.existing_folder(parsed, encrypted_ok=True)
        urls = {f.relative_to(folder).as_posix(): f.resolve().as_uri() for f in sorted(folder.rglob("*"))
                if f.is_file() and f.name != CHECKPOINT_FILE}
        return completed(types.ExternalWeightsUrlsResponse(urls=urls,
                                                           expires=datetime.now(timezone.utc) + URL_LIFETIME))

    # -- sessions and samplers --------------------------------------------------------------
    def _session_runs(self) -> dict[str, list[RunRecord]]:
        """Runs in storage by the session that created them (records older than sessions left out)."""
        by_session: dict[str, list[RunRecord]] = {}
        for model_id in self._store.run_ids():
            record = self._store.read_run(model_id)
            if record.session_id:
                by_session.setdefault(record.session_id, []).append(record)
        return by_session

    def list_sessions(self, limit: int = 20, offset: int = 0, access_scope: str = "owned"):
        """Future of a ListSessionsResponse, newest first: the sessions (ServiceClients) whose runs are in
        this storage, and the sessions of this process on it that made no run yet."""
        started = {s.session_id: s.created for s in sessions.sessions_on(self._store.root)}
        for session_id, runs in self._session_runs().items():
            started[session_id] = min([r.created for r in runs] + [started.get(session_id, float("inf"))])
        newest_first = sorted(started, key=lambda i: started[i], reverse=True)
        return completed(types.ListSessionsResponse(sessions=newest_first[offset:offset + limit]))

    def get_session(self, session_id: str, access_scope: str = "owned"):
        """Future of a GetSessionResponse: the session's training runs (from storage) and samplers (of this
        process: samplers are not stored); its user metadata where the session is of this process."""
        live = sessions.session(session_id)
        runs = self._session_runs().get(session_id, [])
        if live is None and not runs:
            raise ModelNotFoundError(f"no session {session_id!r} in this storage: list them with "
                                     "rest_client.list_sessions().")
        return completed(types.GetSessionResponse(
            training_run_ids=[r.model_id for r in runs], sampler_ids=list(live.sampler_ids) if live else [],
            user_metadata=live.user_metadata if live else None))

    def get_sampler(self, sampler_id: str):
        """Future of a GetSamplerResponse (base model, saved path if any) of a sampler of this process."""
        record = sessions.sampler_record(sampler_id)
        return completed(types.GetSamplerResponse(sampler_id=record.sampler_id, base_model=record.base_model,
                                                  model_path=record.model_path))

    # The SDK's coroutine twins (deprecated there in favour of awaiting the future).
    get_training_run_async = _awaiting("get_training_run")
    get_training_run_by_tinker_path_async = _awaiting("get_training_run_by_tinker_path")
    list_training_runs_async = _awaiting("list_training_runs")
    list_checkpoints_async = _awaiting("list_checkpoints")
    list_user_checkpoints_async = _awaiting("list_user_checkpoints")
    delete_checkpoint_async = _awaiting("delete_checkpoint")
    delete_checkpoint_from_tinker_path_async = _awaiting("delete_checkpoint_from_tinker_path")
    copy_weights_async = _awaiting("copy_weights")
    set_checkpoint_ttl_from_tinker_path_async = _awaiting("set_checkpoint_ttl_from_tinker_path")
    get_external_weights_urls_async = _awaiting("get_external_weights_urls")
    list_sessions_async = _awaiting("list_sessions")
    get_session_async = _awaiting("get_session")
    get_sampler_async = _awaiting("get_sampler")
