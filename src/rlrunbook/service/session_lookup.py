"""``RestClient.list_sessions`` and ``get_session`` over the server's sessions: the caller's own only.

A tenant sees the sessions its key created, active or ended (finished, expired, or from before a restart),
newest first; another tenant's session id answers 404, as a made-up one. A session's training runs are named
by the SDK's model ids (``<session>:train:<n>``), which every run route takes; its samplers by their
sampling session ids. ``access_scope`` (``owned`` or ``accessible``) selects the same sessions: nothing is
shared between tenants but published checkpoints.
"""

from __future__ import annotations

from tinker import types

from rlrunbook.service.holdings import Holdings
from rlrunbook.service.records import UnknownIdError, dump


def list_sessions(holdings: Holdings, limit: int, offset: int, tenant: str) -> dict:
    """The body of ``ListSessionsResponse``: ids of ``tenant``'s sessions, newest first, ``offset`` and
    ``limit`` applied."""
    with holdings.lock:
        own = [s for s in holdings.sessions.values() if s.tenant == tenant]
    own.sort(key=lambda s: (s.created, s.session_id), reverse=True)
    return dump(types.ListSessionsResponse(sessions=[s.session_id for s in own[offset:offset + limit]]))


def get_session(holdings: Holdings, session_id: str, tenant: str) -> dict:
    """The body of ``GetSessionResponse`` for the caller's session ``session_id`` (ended ones included);
    ``UnknownIdError`` (404) for another tenant's or an unknown one."""
    with holdings.lock:
        session = holdings.sessions.get(session_id)
        if session is None or session.tenant != tenant:
            raise UnknownIdError(f"no session {session_id!r} on this server; rest_client.list_sessions() lists "
                                 "yours.")
        models = sorted((m.model_id for m in holdings.models.values() if m.session_id == session_id), key=_seq)
        samplers = sorted((s.sampler_id for s in holdings.samplers.values() if s.session_id == session_id), key=_seq)
    return dump(types.GetSessionResponse(training_run_ids=models, sampler_ids=samplers,
                                         user_metadata=dict(session.user_metadata) or None))


def _seq(model_or_sampler_id: str) -> tuple[int, str]:
    """``<session>:train:<n>`` and ``<session>:sample:<n>`` in the order of ``n``."""
    tail = model_or_sampler_id.rsplit(":", 1)[-1]
    return (int(tail), "") if tail.isascii() and tail.isdigit() else (-1, model_or_sampler_id)
