"""What the routes call: :class:`ServeState`, one object over the server's sessions, models and samplers.

One :class:`~rlrunbook.backend.LocalServiceClient` serves every client: each training model the SDK creates is
a ``LocalTrainingClient`` of its own (:mod:`~rlrunbook.service.models`) and each sampling session a
``LocalSamplingClient`` (:mod:`~rlrunbook.service.samplers`); sessions and their expiry are
:mod:`~rlrunbook.service.sessions`, what a restart finds :mod:`~rlrunbook.service.recovery`. Nothing here
computes: every call is the local client's, so over the wire and in process the same seed gives the same bits.

Each session, model and sampler belongs to the tenant (API key) that created it; an id of another tenant is
answered as unknown (404). Everything acknowledged is recorded in the store (:mod:`rlrunbook.service.store`).
Each method takes the SDK's own request type (``tinker.types``) and the caller's tenant, and returns the JSON
body of the response; a queued call's body carries the request id the SDK then polls
(:mod:`rlrunbook.service.futures`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import datetime

from tinker import types

from rlrunbook.backend import LocalRestClient, LocalServiceClient
from rlrunbook.backend.storage import folder_size
from rlrunbook.service.base_models import BaseModels
from rlrunbook.service.futures import FutureRegistry
from rlrunbook.service.holdings import DEFAULT_FORGET_AFTER_S, Holdings, StorageLimitError, TenantLimits
from rlrunbook.service.models import Models
from rlrunbook.service.ownership import Ownership
from rlrunbook.service.records import DEFAULT_PROJECT, dump
from rlrunbook.service.recovery import restore
from rlrunbook.service.samplers import Samplers
from rlrunbook.service.session_lookup import (
    assign_session_project,
    get_session,
    list_sessions,
    owner_of,
    search_sessions,
)
from rlrunbook.service.sessions import DEFAULT_SESSION_TIMEOUT_S, Sessions, Swept
from rlrunbook.service.sharing import Sharing
from rlrunbook.service.store import ServeStore
from rlrunbook.service.wire import ForwardBackwardCall


class ServeState:
    """The server's sessions, models and samplers over one local ServiceClient (see the module docstring)."""

    def __init__(self, service: LocalServiceClient, store: ServeStore,
                 session_timeout_s: float = DEFAULT_SESSION_TIMEOUT_S, limits: TenantLimits = TenantLimits(),
                 forget_after_s: float = DEFAULT_FORGET_AFTER_S,
                 base_models: BaseModels | None = None):
        self.service = service
        self.store = store
        self.futures = FutureRegistry(store)
        self.rest = LocalRestClient(service._store)
        self.holdings = Holdings(session_timeout_s, limits, forget_after_s)
        self.sessions = Sessions(self.holdings, service, store, self.futures)
        self.samplers = Samplers(self.holdings, service, store, self.futures)
        self.models = Models(self.holdings, service, store, self.futures, self.rest, self.samplers)
        self.restored = restore(self.holdings, store)
        self.sharing = Sharing(store, service._store)
        self.base_models = base_models if base_models is not None else BaseModels.from_option(None)
        self.ownership = Ownership(store, self.sharing)
        self._queued_save_bytes: dict[str, int] = {}  # by tenant: what its admitted saves not yet done will write

    @property
    def session_timeout_s(self) -> float:
        return self.holdings.session_timeout_s

    def close(self, timeout_s: float | None = None) -> int:
        """Stop, once no request comes in any more, in the order that loses nothing acknowledged: calls that have
        not started are cancelled and stay ``pending`` in the store (a restart reports them); those running
        finish (the backend's running call: up to ``timeout_s``) and their outcomes are recorded; then the local
        backend, the recorder and the store close. How many calls were left pending."""
        self.futures.stop_recording()
        self.service.cancel_queued()  # what the models' running calls wait for runs next
        self.models.close()
        self.service.stop_now(timeout_s)
        left = self.futures.close()
        self.store.close()
        return left

    # -- sessions -----------------------------------------------------------------------------------------
    def create_session(self, request: types.CreateSessionRequest, tenant: str) -> dict:
        return self.sessions.create_session(request, tenant)

    def heartbeat(self, request: types.SessionHeartbeatRequest, tenant: str) -> dict:
        return self.sessions.heartbeat(request, tenant)

    def finish(self, session_id: str, tenant: str, reason: str | None = None) -> dict:
        """The SDK's ``ServiceClient`` closed (``reason``: what it said): its models and samplers are released now
        (checkpoints stay)."""
        return self.sessions.finish(session_id, tenant, reason)

    def expire_idle(self, now: float | None = None) -> list[str]:
        """End every active session whose last heartbeat is older than the timeout; the ids ended."""
        return self.sessions.expire_idle(now)

    def sweep(self, now: float | None = None) -> Swept:
        """End the idle sessions (one collection for all of them) and forget those ended longer than the grace
        period (:meth:`Sessions.sweep`); ``now`` is ``time.monotonic()``'s clock."""
        return self.sessions.sweep(now)

    def drop_old_results(self) -> int:
        """Drop from the store the results delivered more than 10 minutes ago and those unclaimed for a week, as
        a start does; how many."""
        return self.store.sweep()

    def list_sessions(self, limit: int, offset: int, tenant: str) -> dict:
        """The caller's sessions, newest first (:mod:`rlrunbook.service.session_lookup`)."""
        return list_sessions(self.holdings, limit, offset, tenant)

    def get_session(self, session_id: str, tenant: str) -> dict:
        """The caller's session: its models' and samplers' ids and its user metadata."""
        return get_session(self.holdings, session_id, tenant)

    def search_sessions(self, request: types.SessionSearchRequest, tenant: str) -> dict:
        """The caller's sessions matching ``request``, one page (:func:`~rlrunbook.service.session_lookup.search_sessions`)."""
        runs = self._runs_by_session(tenant)
        return search_sessions(self.holdings, request, tenant,
                               lambda session_id: self._checkpoint_usage(runs.get(session_id, [])))

    def assign_session_project(self, session_id: str, project_id: str, tenant: str) -> None:
        assign_session_project(self.holdings, session_id, project_id, self.store.set_session_project, tenant)

    def checkpoint_storage_usage(self, project_id: str | None, tenant: str) -> dict:
        """``CurrentCheckpointStorageUsageResponse``: the caller's checkpoints on disk, one item per project (the
        project of the session whose run saved them), or of ``project_id`` only."""
        runs = self._runs_by_session(tenant)
        projects: dict[str, list[str]] = {}
        with self.holdings.lock:
            for session_id, run_ids in runs.items():
                session = self.holdings.sessions.get(session_id)
                project = session.project_id if session is not None else DEFAULT_PROJECT  # a forgotten session's
                projects.setdefault(project, []).extend(run_ids)
        if project_id is not None:
            projects = {project_id: projects.get(project_id, [])}
        items = []
        for project, run_ids in sorted(projects.items()):
            count, stored = self._checkpoint_usage(run_ids)
            items.append(types.CurrentCheckpointStorageUsageItem(
                project_id=project, org_user_urn=owner_of(tenant), checkpoint_count=count, size_bytes=stored,
                size_gigabytes=stored / 1e9))
        return dump(types.CurrentCheckpointStorageUsageResponse(data=items))

    def _runs_by_session(self, tenant: str) -> dict[str, list[str]]:
        """The run ids of ``tenant``'s training models by the session that made them (``<session>:train:<n>``)."""
        runs: dict[str, list[str]] = {}
        for row in self.store.runs():
            if row["tenant"] == tenant:
                runs.setdefault(row["model_id"].rsplit(":train:", 1)[0], []).append(row["run_id"])
        return runs

    def _checkpoint_usage(self, run_ids: list[str]) -> tuple[int, int]:
        """How many checkpoints the runs hold on disk, and their bytes."""
        folders = [folder for run in run_ids for _, folder in self.service._store.checkpoints(run)]
        return len(folders), sum(folder_size(folder) for folder in folders)

    # -- training models ----------------------------------------------------------------------------------
    def create_model(self, request: types.CreateModelRequest, tenant: str) -> dict:
        self.base_models.check(request.base_model)  # only the base models this server offers
        return self.models.create_model(request, tenant)

    def get_info(self, request: types.GetInfoRequest, tenant: str) -> dict:
        return self.models.get_info(request, tenant)

    def forward_backward(self, request: ForwardBackwardCall, tenant: str) -> dict:
        return self.models.forward_backward(request, tenant)

    def optim_step(self, request: types.OptimStepRequest, tenant: str) -> dict:
        return self.models.optim_step(request, tenant)

    def save_weights(self, request: types.SaveWeightsRequest, tenant: str) -> dict:
        return self.models.save_weights(request, tenant, lambda kind: self._admit_save(request.model_id, kind, tenant))

    def save_weights_for_sampler(self, request: types.SaveWeightsForSamplerRequest, tenant: str) -> dict:
        return self.models.save_weights_for_sampler(
            request, tenant, lambda kind: self._admit_save(request.model_id, kind, tenant))

    def stored_bytes(self, tenant: str) -> int:
        """The bytes on disk of every checkpoint of ``tenant``'s runs (what ``--max-stored-bytes`` bounds)."""
        return self._checkpoint_usage([row["run_id"] for row in self.store.runs() if row["tenant"] == tenant])[1]

    def _admit_save(self, model_id: str, kind: str, tenant: str) -> Callable[[], None]:
        """Admit a save of ``model_id``'s ``kind`` checkpoint, or ``StorageLimitError`` (429) when ``tenant``'s
        checkpoints on disk, plus what its admitted saves not yet done will write, plus this save would exceed the
        limit. A save is expected to write as much as the run's last checkpoint of ``kind`` (nothing known before
        its first). The admitted bytes count until the save is done: call the function returned then."""
        limit = self.holdings.limits.stored_bytes
        with self.holdings.lock:
            used, queued = self.stored_bytes(tenant), self._queued_save_bytes.get(tenant, 0)
            runs = [row["run_id"] for row in self.store.runs()
                    if row["model_id"] == model_id and row["tenant"] == tenant]
            same_kind = [folder for _, folder in self.service._store.checkpoints(runs[-1])
                         if folder.parent.name == kind] if runs else []
            expected = folder_size(same_kind[-1]) if same_kind else 0
            if used + queued + expected > limit:
                waiting = f" and its saves still queued about {queued:,} more" if queued else ""
                raise StorageLimitError(
                    f"this key's checkpoints hold {used:,} bytes{waiting}; this save (about {expected:,} more) would "
                    f"pass the server's limit per key (--max-stored-bytes {limit:,}). Delete checkpoints you no "
                    "longer need (RestClient.delete_checkpoint_from_tinker_path), or ask the operator to raise it.")
            self._queued_save_bytes[tenant] = queued + expected

        def done() -> None:
            with self.holdings.lock:
                self._queued_save_bytes[tenant] -= expected

        return done

    def save_weights_external(self, request: types.SaveWeightsExternalRequest, tenant: str) -> dict:
        return self.models.save_weights_external(
            request, tenant, lambda kind: self._admit_save(request.model_id, kind, tenant))

    def load_weights(self, request: types.LoadWeightsRequest, tenant: str) -> dict:
        """``load_state`` of a model, or a new model made from a checkpoint (:meth:`Models.load_weights`); a
        checkpoint of another tenant's run is unknown; a base model named besides it must be one offered."""
        self.base_models.check(request.base_model)
        return self.models.load_weights(request, tenant, lambda path: self.ownership.check_path(path, tenant))

    # -- sampling -----------------------------------------------------------------------------------------
    def create_sampling_session(self, request: types.CreateSamplingSessionRequest, tenant: str) -> dict:
        self.ownership.check_path(request.model_path, tenant)  # another tenant's weights are unknown
        if request.model_path is None:
            self.base_models.check(request.base_model)
        return self.samplers.create_sampling_session(request, tenant)

    def sampler_info(self, sampler_id: str, tenant: str) -> dict:
        return self.samplers.sampler_info(sampler_id, tenant)

    def sample(self, request: types.SampleRequest, tenant: str) -> dict:
        return self.samplers.sample(request, tenant)

    # -- what the server holds ----------------------------------------------------------------------------
    def status(self, tenant: str) -> dict:
        """The caller's sessions and models with the memory each model holds, and the resident base models."""
        models, pending = [], self.futures.pending()
        for model in [m for m in list(self.holdings.models.values()) if m.tenant == tenant]:
            entry = {"model_id": model.model_id, "session_id": model.session_id, "status": model.status,
                     "base_model": model.base_model, "last_saved": model.last_saved, "last_seq_id": model.last_seq,
                     "pending_calls": pending.get(model.model_id, 0)}
            client = model.client
            if model.status == "live" and client is not None and client.done() and client.exception() is None:
                entry["memory_bytes"] = client.result().memory_bytes()
            models.append(entry)
        now = time.monotonic()
        sessions = [{"session_id": s.session_id, "status": s.status, "idle_s": round(now - s.last_heartbeat, 1)}
                    for s in list(self.holdings.sessions.values()) if s.tenant == tenant]
        return {"sessions": sessions, "models": models, "resident": self.service.resident_models(),
                "session_timeout_s": self.session_timeout_s}

    # -- runs and checkpoints (the REST routes), each the tenant's own (see rlrunbook.service.ownership) --------
    def training_run(self, run_id: str, tenant: str) -> dict:
        return dump(self.rest.get_training_run(self.ownership.run_id(run_id, tenant)).result())

    def run_checkpoints(self, run_id: str, tenant: str) -> dict:
        return self._marked(dump(self.rest.list_checkpoints(self.ownership.run_id(run_id, tenant)).result()))

    def training_runs(self, limit: int, offset: int, tenant: str) -> dict:
        return dump(self.rest.list_training_runs(limit, offset, visible=self.ownership.visible_to(tenant)).result())

    def user_checkpoints(self, limit: int, offset: int, tenant: str) -> dict:
        return self._marked(dump(self.rest.list_user_checkpoints(limit, offset,
                                                                 visible=self.ownership.visible_to(tenant)).result()))

    def _marked(self, listing: dict) -> dict:
        """``listing``'s checkpoints with ``public`` set where they are published."""
        published = self.sharing.published_paths()
        for checkpoint in listing["checkpoints"]:
            checkpoint["public"] = checkpoint["tinker_path"] in published
        return listing

    def weights_info(self, path: str, tenant: str) -> dict:
        self.ownership.check_path(path, tenant)
        return dump(self.rest.get_weights_info_by_tinker_path(path).result())

    def delete_checkpoint(self, run_id: str, checkpoint_id: str, tenant: str) -> None:
        """``DELETE .../training_runs/{run}/checkpoints/{kind}/{name}``: the checkpoint's folder removed, no model
        names it as its last saved state any more, and its publication ends (one saved again under its name starts
        private)."""
        run = self.ownership.run_id(run_id, tenant)
        self.rest.delete_checkpoint(run, checkpoint_id).result()
        self._gone([f"tinker://{run}/{checkpoint_id}"])

    def remove_expired_checkpoints(self, now: datetime | None = None) -> list[str]:
        """Remove every checkpoint of the storage whose TTL (set at save or by ``PUT .../ttl``) has passed at
        ``now`` (UTC; default the current time): its folder, adapter and optimizer state included, so listings
        and loads no longer find it, and a model's record of it as its last saved state. The paths removed."""
        removed = [path.path for path in self.service._store.remove_expired(now)]
        self._gone(removed)
        return removed

    def _gone(self, paths: list[str]) -> None:
        """Checkpoints ``paths`` no longer exist: a model that last saved one of them has no saved state now, and
        none of them is published any more."""
        gone = set(paths)
        for path in gone:
            self.sharing.forget(path)
        for model in [m for m in list(self.holdings.models.values()) if m.last_saved in gone]:
            model.last_saved = None
            self.store.model_update(model.model_id, last_saved=None)

    # -- sharing: published checkpoints and copies (see rlrunbook.service.sharing) ---------------------------
    def publish(self, run_id: str, checkpoint_id: str, tenant: str) -> None:
        """Make a checkpoint of the caller's run readable by every tenant (by its path)."""
        run = self.ownership.run_id(run_id, tenant)
        self.sharing.publish(run, checkpoint_id, tenant, self.ownership.owner(run))

    def unpublish(self, run_id: str, checkpoint_id: str, tenant: str) -> None:
        """Make a published checkpoint of the caller's run its own again."""
        run = self.ownership.run_id(run_id, tenant)
        self.sharing.unpublish(run, checkpoint_id, tenant, self.ownership.owner(run))

    def copy_weights(self, request: types.CopyWeightsRequest, tenant: str, idempotency_key: str | None) -> dict:
        """A copy of a checkpoint the caller may read (its own, the operator's, or a published one), as a new
        run of the caller's; the body of ``CopyWeightsResponse``."""
        self.ownership.check_path(request.source_path, tenant)
        return self.sharing.copy(request, tenant, idempotency_key)

    def set_checkpoint_ttl(self, run_id: str, checkpoint_id: str, ttl_seconds: int | None, tenant: str) -> None:
        path = f"tinker://{self.ownership.run_id(run_id, tenant)}/{checkpoint_id}"
        self.rest.set_checkpoint_ttl_from_tinker_path(path, ttl_seconds).result()

