"""Sessions and samplers of the local backend, as the SDK's RestClient reports them.

A session is one ``LocalServiceClient``: its id names the training runs it creates (recorded in each run's
``training_run.json``, so another process lists them too) and the samplers it hands out. Samplers live in
memory only, so a sampler id is known to the process that made it: ``get_sampler`` and
``SamplingClient.from_sampler_handle`` on an in-memory snapshot work in that process, and a sampler of saved
weights is rebuilt from its ``tinker://`` path elsewhere.
"""

from __future__ import annotations

import itertools
import threading
import time
import uuid
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlrunbook.errors import ModelNotFoundError


@dataclass
class SessionRecord:
    """One ServiceClient of this process: what ``RestClient.get_session`` reports of it."""

    session_id: str
    storage_root: Path
    user_metadata: dict[str, str] | None = None
    created: float = field(default_factory=time.time)
    sampler_ids: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class SamplerRecord:
    """What ``RestClient.get_sampler`` reports: the base model, and the path the sampler was made from."""

    sampler_id: str
    session_id: str
    base_model: str
    model_path: str | None


_LOCK = threading.Lock()
_SESSIONS: dict[str, SessionRecord] = {}
_SAMPLERS: dict[str, SamplerRecord] = {}
_LIVE_SAMPLERS: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()
_COUNTER = itertools.count()


def new_session_id() -> str:
    return f"local-session-{uuid.uuid4().hex[:12]}"


def open_session(storage_root: Path, user_metadata: dict[str, str] | None = None) -> SessionRecord:
    """Register a new session of this process on ``storage_root``."""
    record = SessionRecord(new_session_id(), Path(storage_root).resolve(),
                           dict(user_metadata) if user_metadata else None)
    with _LOCK:
        _SESSIONS[record.session_id] = record
    return record


def register_sampler(session_id: str, client: Any, base_model: str, model_path: str | None) -> str:
    """A new sampler id (``<session_id>:sample:<n>``) for ``client``, held weakly: a collected client's
    id stays listed (as the SDK lists a session's samplers), but no longer resolves to a client."""
    sampler_id = f"{session_id}:sample:{next(_COUNTER)}"
    with _LOCK:
        _SAMPLERS[sampler_id] = SamplerRecord(sampler_id, session_id, base_model, model_path)
        _LIVE_SAMPLERS[sampler_id] = client
        if session_id in _SESSIONS:
            _SESSIONS[session_id].sampler_ids.append(sampler_id)
    return sampler_id


def sampler_record(sampler_id: str) -> SamplerRecord:
    """The sampler of this process named ``sampler_id``; ``ModelNotFoundError`` naming the fix otherwise."""
    with _LOCK:
        record = _SAMPLERS.get(sampler_id)
    if record is None:
        raise ModelNotFoundError(
            f"no sampler {sampler_id!r} in this process: local samplers live in the process that made them. "
            "Ask the process that created it, or make a sampler of saved weights with "
            "service.create_sampling_client(model_path=...)."
        )
    return record


def live_sampler(sampler_id: str) -> Any | None:
    """The sampling client of ``sampler_id`` if it is still alive in this process."""
    with _LOCK:
        return _LIVE_SAMPLERS.get(sampler_id)


def sessions_on(storage_root: Path) -> list[SessionRecord]:
    """The sessions of this process that store under ``storage_root``, oldest first."""
    root = Path(storage_root).resolve()
    with _LOCK:
        return sorted((s for s in _SESSIONS.values() if s.storage_root == root), key=lambda s: s.created)


def session(session_id: str) -> SessionRecord | None:
    with _LOCK:
        return _SESSIONS.get(session_id)
