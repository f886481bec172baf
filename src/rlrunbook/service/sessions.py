"""Sessions: created, kept alive by heartbeats (or any other request), finished by the client or expired, and
forgotten a grace period after they end.

A session that sends nothing for ``session_timeout_s`` expires. Ending a session, either way, releases what it
owns: its models' lanes are closed and their local clients freed, its samplers' clients dropped; their records
stay (an id of them answers why it ended) and so do its checkpoints. A heartbeat of an ended session is
:class:`~rlrunbook.service.records.SessionEndedError` (410), which stops the SDK's heartbeat loop.

One sweep (:meth:`Sessions.sweep`) ends every idle session and then frees their models' memory with one
garbage collection (a peft model holds reference cycles), none when no model was released: a collection takes
about a second with a model resident, so one per session made a sweep of many idle sessions late by as many
seconds. ``forget_after_s`` after a session ended, it, its models and samplers, and their request ids leave
memory and the store; their ids then answer as unknown ones (404), and the runs its models made keep their
owner (:meth:`~rlrunbook.service.store.ServeStore.runs`), so their checkpoints stay the tenant's.
"""

from __future__ import annotations

import gc
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

from tinker import types

from rlrunbook.backend import LocalServiceClient
from rlrunbook.service.futures import FutureRegistry
from rlrunbook.service.holdings import Holdings
from rlrunbook.service.records import (
    DEFAULT_PROJECT,
    Session,
    SessionEndedError,
    check_project_id,
    dump,
    ended_message,
)
from rlrunbook.service.store import ServeStore

DEFAULT_SESSION_TIMEOUT_S = 300.0  # the SDK heartbeats every 10 s; five minutes of silence ends a session


@dataclass(frozen=True)
class Swept:
    """What one sweep did: the sessions it ended (expired), how many ended ones it forgot, and how many garbage
    collections it ran to free the released models' memory (0 or 1)."""

    expired: list[str]
    forgotten: int
    collections: int


class Sessions:
    """The sessions of :class:`Holdings`, recorded in the store as they start, end and are forgotten.

    ``collect`` frees the memory of released models (``gc.collect``); it runs once per ending that released a
    model, and once per sweep however many sessions the sweep ends."""

    def __init__(self, holdings: Holdings, service: LocalServiceClient, store: ServeStore, futures: FutureRegistry,
                 collect: Callable[[], object] = gc.collect):
        self.holdings = holdings
        self.service = service
        self.store = store
        self.futures = futures
        self.collect = collect

    def create_session(self, request: types.CreateSessionRequest, tenant: str) -> dict:
        session = Session(session_id=f"session-{secrets.token_urlsafe(16)}", tenant=tenant,
                          user_metadata=dict(request.user_metadata or {}), display_name=request.display_name,
                          project_id=check_project_id(request.project_id or DEFAULT_PROJECT))
        with self.holdings.lock:
            self.holdings.check_room(tenant, "sessions")
            self.store.add_session(session.session_id, tenant, session.user_metadata, session.created,
                                   session.display_name, session.project_id)
            self.holdings.sessions[session.session_id] = session
        return dump(types.CreateSessionResponse(session_id=session.session_id))

    def heartbeat(self, request: types.SessionHeartbeatRequest, tenant: str) -> dict:
        """Renew the caller's active session. 410 (which stops the SDK's heartbeat loop) for an ended one, and for an
        id the server does not hold for this key: forgotten after it ended, another key's (answered alike, so the
        answer tells nothing about another tenant), or never made here; none of them can ever answer 200."""
        session = self.holdings.sessions.get(request.session_id)
        if session is None or session.tenant != tenant:
            raise SessionEndedError(f"no session {request.session_id!r} on this server for this key (it ended and was "
                                    "forgotten, or was never made here): create a new tinker.ServiceClient.")
        if session.status != "active":
            raise SessionEndedError(ended_message(session, self.holdings.session_timeout_s))
        session = self.holdings.session(request.session_id, tenant)
        session.last_heartbeat = time.monotonic()
        return dump(types.SessionHeartbeatResponse())

    def finish(self, session_id: str, tenant: str, reason: str | None = None) -> dict:
        """The SDK's ``ServiceClient`` closed, saying why (``reason``: ``success``, ``errored``, ``interrupted``;
        None from clients that do not say): its models and samplers are released now (checkpoints stay)."""
        session = self.holdings.session(session_id, tenant)
        session.finish_reason = reason
        if self._end(session, "finished", time.monotonic()):
            self.collect()
        return {}

    def expire_idle(self, now: float | None = None) -> list[str]:
        """End every active session whose last heartbeat is older than the timeout, then free the memory of
        the models they held with one collection (none if they held none); the ids ended."""
        return self._expire(time.monotonic() if now is None else now)[0]

    def _expire(self, now: float) -> tuple[list[str], int]:
        """:meth:`expire_idle` at ``now``: the ids ended and the collections run (0 or 1)."""
        idle = [s for s in list(self.holdings.sessions.values())
                if s.status == "active" and not s.polls and now - s.last_heartbeat > self.holdings.session_timeout_s]
        released = [self._end(session, "expired", now) for session in idle]
        if not any(released):
            return [session.session_id for session in idle], 0
        self.collect()  # the peft models hold reference cycles: free their adapters and caches now, at once
        return [session.session_id for session in idle], 1

    def forget_ended(self, now: float | None = None) -> int:
        """Forget every session that ended more than ``forget_after_s`` before ``now`` (monotonic), with its
        models, samplers and request ids, in memory and in the store; how many sessions were forgotten."""
        now = time.monotonic() if now is None else now
        holdings = self.holdings
        with holdings.lock:
            old = [s for s in holdings.sessions.values()
                   if s.status != "active" and s.ended is not None and now - s.ended >= holdings.forget_after_s]
            gone = {s.session_id for s in old}
            models = {m.model_id: m.session_id for m in holdings.models.values() if m.session_id in gone}
            samplers = {s.sampler_id: s.session_id for s in holdings.samplers.values() if s.session_id in gone}
            for session in old:
                del holdings.sessions[session.session_id]
            for model_id in models:
                holdings.models.pop(model_id).order.close()
            for sampler_id in samplers:
                del holdings.samplers[sampler_id]
        for session in old:
            self.store.forget_session(session.session_id,
                                      [m for m, owner in models.items() if owner == session.session_id],
                                      [s for s, owner in samplers.items() if owner == session.session_id])
        self.futures.forget(set(models) | set(samplers))
        return len(old)

    def sweep(self, now: float | None = None) -> Swept:
        """:meth:`expire_idle`, then :meth:`forget_ended`, at one ``now`` (monotonic); what was done."""
        now = time.monotonic() if now is None else now
        expired, collections = self._expire(now)
        return Swept(expired, self.forget_ended(now), collections)

    def _end(self, session: Session, status: str, now: float) -> bool:
        """End ``session`` as ``status`` at ``now`` and release its models and samplers; whether a model's
        client was released (its memory is freed by the caller's collection)."""
        holdings = self.holdings
        with holdings.lock:
            session.status, session.ended = status, now
            models = [m for m in holdings.models.values()
                      if m.session_id == session.session_id and m.status != "released"]
            samplers = [s for s in holdings.samplers.values() if s.session_id == session.session_id]
            for model in models:
                model.status = "released"
            for sampler in samplers:
                sampler.client = None
        self.store.set_session_status(session.session_id, status, session.finish_reason)
        released = False
        for model in models:
            self.store.model_update(model.model_id, status="released")
            model.order.close()
            client, model.client = model.client, None
            if client is None:
                continue
            if client.done():
                released = self._release(client) or released
            else:  # still being created: released when it is made
                client.add_done_callback(self._release)
        return released

    def _release(self, client) -> bool:
        """Let the backend forget a made training client; whether there was one."""
        if client.cancelled() or client.exception() is not None:
            return False
        self.service.release_training_client(client.result().model_id)
        return True

