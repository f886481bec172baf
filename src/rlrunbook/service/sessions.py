"""Sessions: created, kept alive by heartbeats (or any other request), finished by the client or expired.

A session that sends nothing for ``session_timeout_s`` expires. Ending a session, either way, releases what it
owns: its models' lanes are closed and their local clients freed, its samplers' clients dropped; their records
stay (an id of them answers why it ended) and so do its checkpoints. A heartbeat of an ended session is
:class:`~rlrunbook.service.records.SessionEndedError` (410), which stops the SDK's heartbeat loop.
"""

from __future__ import annotations

import gc
import secrets
import time

from tinker import types

from rlrunbook.backend import LocalServiceClient
from rlrunbook.service.holdings import Holdings
from rlrunbook.service.records import Session, SessionEndedError, dump, ended_message
from rlrunbook.service.store import ServeStore

DEFAULT_SESSION_TIMEOUT_S = 300.0  # the SDK heartbeats every 10 s; five minutes of silence ends a session


class Sessions:
    """The sessions of :class:`Holdings`, recorded in the store as they start and end."""

    def __init__(self, holdings: Holdings, service: LocalServiceClient, store: ServeStore):
        self.holdings = holdings
        self.service = service
        self.store = store

    def create_session(self, request: types.CreateSessionRequest, tenant: str) -> dict:
        session = Session(session_id=f"session-{secrets.token_urlsafe(16)}", tenant=tenant,
                          user_metadata=dict(request.user_metadata or {}))
        with self.holdings.lock:
            self.holdings.check_room(tenant, "sessions")
            self.store.add_session(session.session_id, tenant, session.user_metadata)
            self.holdings.sessions[session.session_id] = session
        return dump(types.CreateSessionResponse(session_id=session.session_id))

    def heartbeat(self, request: types.SessionHeartbeatRequest, tenant: str) -> dict:
        session = self.holdings.sessions.get(request.session_id)
        if session is not None and session.tenant == tenant and session.status != "active":
            raise SessionEndedError(ended_message(session, self.holdings.session_timeout_s))
        session = self.holdings.session(request.session_id, tenant)
        session.last_heartbeat = time.monotonic()
        return dump(types.SessionHeartbeatResponse())

    def finish(self, session_id: str, tenant: str) -> dict:
        """The SDK's ``ServiceClient`` closed: its models and samplers are released now (checkpoints stay)."""
        self._end(self.holdings.session(session_id, tenant), "finished")
        return {}

    def expire_idle(self, now: float | None = None) -> list[str]:
        """End every active session whose last heartbeat is older than the timeout; the ids ended."""
        now = time.monotonic() if now is None else now
        idle = [s for s in list(self.holdings.sessions.values())
                if s.status == "active" and now - s.last_heartbeat > self.holdings.session_timeout_s]
        for session in idle:
            self._end(session, "expired")
        return [session.session_id for session in idle]

    def _end(self, session: Session, status: str) -> None:
        holdings = self.holdings
        with holdings.lock:
            session.status = status
            models = [m for m in holdings.models.values()
                      if m.session_id == session.session_id and m.status != "released"]
            samplers = [s for s in holdings.samplers.values() if s.session_id == session.session_id]
            for model in models:
                model.status = "released"
            for sampler in samplers:
                sampler.client = None
        self.store.set_session_status(session.session_id, status)
        for model in models:
            self.store.model_update(model.model_id, status="released")
            model.order.close()
            client = model.client
            model.client = None
            if client is not None and client.done() and client.exception() is None:
                self.service.release_training_client(client.result().model_id)
        gc.collect()  # the peft model holds reference cycles: free its adapter and caches now
