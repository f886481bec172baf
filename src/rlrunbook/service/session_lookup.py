"""``RestClient.list_sessions``, ``get_session``, ``search_sessions`` and ``assign_session_project`` over the
server's sessions: the caller's own only.

A tenant sees the sessions its key created, active or ended (finished, expired, or from before a restart),
newest first; another tenant's session id answers 404, as a made-up one. A session's training runs are named
by the SDK's model ids (``<session>:train:<n>``), which every run route takes; its samplers by their
sampling session ids. ``access_scope`` (``owned`` or ``accessible``) selects the same sessions: nothing is
shared between tenants but published checkpoints.

Projects: a session is filed under the ``project_id`` its client names (else ``default``), and moves with
``assign_session_project``. A key's projects are its own: the names its sessions were filed under, and
``default``. A search naming another project is 404, as the hosted service answers a project the caller cannot
list. A session's status in a search: ``active``; ``client_finished`` with the reason its client gave on close
(``success``, ``errored``, ``interrupted``); none for one that expired (no client said it was done). Nothing
here is ever ``cancelled`` or ``failed``.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timezone

from tinker import types

from rlrunbook.service.holdings import Holdings
from rlrunbook.service.records import DEFAULT_PROJECT, Session, UnknownIdError, check_project_id, dump


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
        session = _own_session(holdings, session_id, tenant)
        models = sorted((m.model_id for m in holdings.models.values() if m.session_id == session_id), key=_seq)
        samplers = sorted((s.sampler_id for s in holdings.samplers.values() if s.session_id == session_id), key=_seq)
    return dump(types.GetSessionResponse(training_run_ids=models, sampler_ids=samplers,
                                         user_metadata=dict(session.user_metadata) or None))


def _own_session(holdings: Holdings, session_id: str, tenant: str) -> Session:
    """The caller's session ``session_id``, ended ones included (the caller holds ``holdings.lock``);
    ``UnknownIdError`` (404) for another tenant's or an unknown one."""
    session = holdings.sessions.get(session_id)
    if session is None or session.tenant != tenant:
        raise UnknownIdError(f"no session {session_id!r} on this server; rest_client.list_sessions() lists yours.")
    return session


def _seq(model_or_sampler_id: str) -> tuple[int, str]:
    """``<session>:train:<n>`` and ``<session>:sample:<n>`` in the order of ``n``."""
    tail = model_or_sampler_id.rsplit(":", 1)[-1]
    return (int(tail), "") if tail.isascii() and tail.isdigit() else (-1, model_or_sampler_id)


def owner_of(tenant: str) -> str:
    """The owner a search names for ``tenant``'s sessions (its key's digest, never the key)."""
    return f"rlrunbook:{tenant}"


def search_sessions(holdings: Holdings, request: types.SessionSearchRequest, tenant: str,
                    checkpoints_of: Callable[[str], tuple[int, int]]) -> dict:
    """The body of ``SessionSearchResponse``: ``tenant``'s sessions matching ``request``, newest first, one page
    of ``request.limit`` after ``request.cursor``; ``checkpoints_of(session_id)`` gives a session's checkpoint
    count and bytes on disk."""
    with holdings.lock:
        own = [s for s in holdings.sessions.values() if s.tenant == tenant]
    if request.project_ids is not None:
        listable = {s.project_id for s in own} | {DEFAULT_PROJECT}
        unknown = [project for project in request.project_ids if project not in listable]
        if unknown:
            raise UnknownIdError(f"no project {unknown[0]!r} for this key: its projects are "
                                 f"{', '.join(sorted(listable))}.")
    owner = request.owner
    if owner.type == "user" and owner_of(tenant) not in owner.owner_urns:
        own = []  # another key's sessions are never listed; "own" and "accessible" are this key's
    found = sorted((s for s in own if _matches(s, request)), key=_newest_first, reverse=True)
    if request.cursor is not None:
        after = (request.cursor.last_created_at, request.cursor.last_session_id)
        found = [s for s in found if _newest_first(s) < after]
    page = found[:request.limit]
    summaries = []
    for session in page:
        count, stored = checkpoints_of(session.session_id)
        summaries.append(types.SessionSummary(
            session_id=session.session_id, created_at=_created_at(session), owner=owner_of(tenant),
            project_id=session.project_id, status=_status(session), checkpoints_count=count,
            display_name=session.display_name, user_metadata=dict(session.user_metadata) or None,
            checkpoint_storage_bytes=stored))
    cursor = None
    if len(found) > len(page):
        cursor = types.SessionSearchCursor(last_created_at=_created_at(page[-1]),
                                           last_session_id=page[-1].session_id)
    return dump(types.SessionSearchResponse(sessions=summaries, next_cursor=cursor))


def assign_session_project(holdings: Holdings, session_id: str, project_id: str, store_update: Callable[[str, str], None],
                           tenant: str) -> None:
    """File the caller's session ``session_id`` (ended ones included) under ``project_id``."""
    project_id = check_project_id(project_id)
    with holdings.lock:
        session = _own_session(holdings, session_id, tenant)
        store_update(session_id, project_id)
        session.project_id = project_id


def _created_at(session: Session) -> datetime:
    return datetime.fromtimestamp(session.created, timezone.utc)


def _newest_first(session: Session) -> tuple[datetime, str]:
    return _created_at(session), session.session_id


def _status(session: Session) -> types.SessionStatus | None:
    if session.status == "active":
        return types.SessionActive()
    if session.status == "finished" and session.finish_reason is not None:
        reason = {"success": types.ClientSessionFinishSuccess, "errored": types.ClientSessionFinishErrored,
                  "interrupted": types.ClientSessionFinishInterrupted}[session.finish_reason]()
        return types.ClientSessionFinished(reason=reason)
    return None  # expired, or closed by a client that gave no reason


def _matches(session: Session, request: types.SessionSearchRequest) -> bool:
    if request.project_ids is not None and session.project_id not in request.project_ids:
        return False
    if any(session.user_metadata.get(key) != value for key, value in request.user_metadata.items()):
        return False
    named = [check for check in (_id_matches(session, request), _name_matches(session, request)) if check is not None]
    if named and not any(named):
        return False
    if request.statuses is not None:
        status = _status(session)
        return any(_status_matches(status, query) for query in request.statuses)
    return True


def _id_matches(session: Session, request: types.SessionSearchRequest) -> bool | None:
    return None if request.session_id is None else session.session_id == request.session_id


def _name_matches(session: Session, request: types.SessionSearchRequest) -> bool | None:
    """Every word of the searched name in the session's display name, case-insensitively (None: not searched)."""
    if request.display_name is None:
        return None
    name = (session.display_name or "").casefold()
    return bool(session.display_name) and all(word in name for word in request.display_name.casefold().split())


def _status_matches(status: types.SessionStatus | None, query) -> bool:
    if status is None or status.type != query.type:
        return False
    if query.type == "client_finished" and query.reasons is not None:
        return status.reason.type in query.reasons
    return True
