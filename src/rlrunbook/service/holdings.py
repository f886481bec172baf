"""The index of what the server holds: its sessions, models and samplers by id, one lock over them, and the
lookups a call of the caller's starts with.

A lookup answers the caller's tenant only: an id of another tenant is as unknown as a made-up one
(:class:`~rlrunbook.service.records.UnknownIdError`, 404). An id of an ended session (or of its model or
sampler) is answered with why it ended. Any request of an active session, its models' and samplers' included,
counts as its heartbeat. The lock guards the maps and the changes that must happen together (a session ending
with its models and samplers, a model or sampler filed once).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from rlrunbook.errors import RlrunbookError
from rlrunbook.service.records import Model, Sampler, Session, UnknownIdError, ended_message


class TenantLimitError(RlrunbookError, RuntimeError):
    """A tenant holds as many sessions or models as the server allows (HTTP 429, which the SDK retries later)."""


class StorageLimitError(TenantLimitError):
    """A save that would take a tenant's checkpoints past ``--max-stored-bytes`` (HTTP 429, not retried: only
    deleting checkpoints makes room)."""


@dataclass(frozen=True)
class TenantLimits:
    """What one tenant may hold at once: active sessions and training models holding weights (the serve options
    ``--max-sessions`` and ``--max-models``; a session ends with its client's ``close`` or its expiry, and a
    model an earlier server made counts from its ``load_state`` on), and the bytes of the checkpoints of its runs
    on disk (``--max-stored-bytes``)."""

    sessions: int = 64
    models: int = 16
    stored_bytes: int = 50 * 2**30


DEFAULT_FORGET_AFTER_S = 3600.0  # an ended session's ids answer why it ended for an hour, then are unknown


class Holdings:
    """Sessions, models and samplers by id for every tenant; ``session_timeout_s`` is what an expiry names;
    an ended session and what it held are forgotten ``forget_after_s`` after it ended."""

    def __init__(self, session_timeout_s: float, limits: TenantLimits = TenantLimits(),
                 forget_after_s: float = DEFAULT_FORGET_AFTER_S):
        self.session_timeout_s = session_timeout_s
        self.forget_after_s = forget_after_s
        self.limits = limits
        self.sessions: dict[str, Session] = {}
        self.models: dict[str, Model] = {}
        self.samplers: dict[str, Sampler] = {}
        self.lock = threading.RLock()

    def session(self, session_id: str, tenant: str) -> Session:
        """The caller's active session ``session_id``, its heartbeat renewed."""
        session = self.sessions.get(session_id)
        if session is None or session.tenant != tenant:
            raise UnknownIdError(f"no session {session_id!r} on this server; create a new tinker.ServiceClient.")
        if session.status != "active":
            raise UnknownIdError(ended_message(session, self.session_timeout_s))
        session.last_heartbeat = time.monotonic()  # any request of a session shows its client is alive
        return session

    def check_room(self, tenant: str, kind: str) -> None:
        """``TenantLimitError`` when ``tenant`` already holds its limit of ``kind`` (``sessions`` or ``models``);
        the caller holds :attr:`lock`, so the count and the filing that follows are one step."""
        if kind == "sessions":
            held = sum(1 for s in self.sessions.values() if s.tenant == tenant and s.status == "active")
            limit, option, fix = self.limits.sessions, "--max-sessions", "close finished ServiceClients"
        else:
            held = sum(1 for m in self.models.values() if m.tenant == tenant and m.status == "live")
            limit, option, fix = self.limits.models, "--max-models", "close the ServiceClients of finished runs"
        if held >= limit:
            raise TenantLimitError(f"this key already holds {held} {kind}, the server's limit per key ({option} "
                                   f"{limit}); {fix} (their checkpoints stay), or ask the operator to raise it.")

    def touch(self, session_id: str) -> None:
        """Renew the heartbeat of ``session_id`` if it is active."""
        session = self.sessions.get(session_id)
        if session is not None and session.status == "active":
            session.last_heartbeat = time.monotonic()

    @contextmanager
    def polling(self, owner: str | None) -> Iterator[None]:
        """While a client long-polls a call of ``owner`` (a model or sampler id), its session counts as alive: an
        idle sweep does not end it, and its heartbeat is renewed when the poll ends."""
        model, sampler = self.models.get(owner or ""), self.samplers.get(owner or "")
        session = self.sessions.get(model.session_id if model else sampler.session_id if sampler else "")
        if session is None:
            yield
            return
        with self.lock:
            session.polls += 1
        try:
            yield
        finally:
            with self.lock:
                session.polls -= 1
            self.touch(session.session_id)

    def model(self, model_id: str, tenant: str) -> Model:
        """The caller's training model ``model_id`` unless its session ended; its session's heartbeat renewed."""
        model = self.models.get(model_id)
        if model is None or model.tenant != tenant:
            raise UnknownIdError(f"no training model {model_id!r} on this server; create one with "
                                 "ServiceClient.create_lora_training_client.")
        if model.status == "released":
            session = self.sessions.get(model.session_id)
            reason = ended_message(session, self.session_timeout_s) if session is not None else "its session ended"
            raise UnknownIdError(f"training model {model_id} was released: {reason}")
        self.touch(model.session_id)
        return model

    def sampler(self, sampler_id: str | None, tenant: str) -> Sampler:
        """The caller's sampling session ``sampler_id`` unless its session ended (its client possibly not made
        again yet after a restart); its session's heartbeat renewed."""
        sampler = self.samplers.get(sampler_id or "")
        if sampler is None or sampler.tenant != tenant:
            raise UnknownIdError(f"no sampling session {sampler_id!r} on this server; create one with "
                                 "ServiceClient.create_sampling_client or save_weights_and_get_sampling_client.")
        session = self.sessions.get(sampler.session_id)
        if session is not None and session.status != "active":
            raise UnknownIdError(f"sampling session {sampler_id} was released: "
                                 f"{ended_message(session, self.session_timeout_s)}")
        self.touch(sampler.session_id)
        return sampler
