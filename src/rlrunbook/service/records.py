"""What the server holds, one record each: a session, a training model, a sampling session; and the errors an id
of them is answered with.

A record is the in-memory side of a row of the store (:mod:`rlrunbook.service.store`) and names the tenant
(API key) that created it. Ids are the SDK's: ``session-...``, ``"{session_id}:train:{model_seq_id}"``,
``"{session_id}:sample:{sampling_session_seq_id}"``. The messages here say why an id no longer answers and
what the client does next.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from rlrunbook.errors import InputError, RlrunbookError
from rlrunbook.service.futures import SeqOrder

DEFAULT_PROJECT = "default"  # the project of a session whose client names none
MAX_PROJECT_ID_CHARS = 128


def check_project_id(project_id: str) -> str:
    """``project_id`` if it is a name a session may be filed under (1 to 128 printable characters), else
    ``InputError`` (400) naming the rule."""
    if not 0 < len(project_id) <= MAX_PROJECT_ID_CHARS or not project_id.isprintable():
        raise InputError(f"project_id {project_id[:40]!r}: a project is named by 1 to {MAX_PROJECT_ID_CHARS} "
                         "printable characters.")
    return project_id


class UnknownIdError(RlrunbookError, LookupError):
    """A session, model, sampler or request id this server does not hold for the caller (HTTP 404)."""


class SessionEndedError(RlrunbookError, LookupError):
    """A heartbeat of a session that expired or finished (HTTP 410: the SDK stops its heartbeat loop)."""


class ModelRestartedError(RlrunbookError, RuntimeError):
    """A call of a model whose in-memory state a restart of the server lost."""


def dump(value: Any) -> dict:
    """The JSON body of an SDK response type."""
    return value.model_dump(mode="json")


@dataclass
class Session:
    """A ``tinker.ServiceClient`` of some process: ``create_session`` to ``sessions/{id}/finish`` or expiry."""

    session_id: str
    tenant: str
    user_metadata: dict[str, str]
    created: float = field(default_factory=time.time)
    last_heartbeat: float = field(default_factory=time.monotonic)
    status: str = "active"  # | "finished" | "expired"
    ended: float | None = None  # time.monotonic() when it ended (or when a restart found it ended)
    polls: int = 0  # its client's long polls open now (retrieve_future): it is alive while one waits
    display_name: str | None = None
    project_id: str = DEFAULT_PROJECT  # the project its client named, else the default one
    finish_reason: str | None = None  # what its client said on close: "success", "errored" or "interrupted"


@dataclass
class Model:
    """A training model: its record, the future of its local client, and the order its calls run in.

    ``status``: ``live`` (its client is, or is being, made), ``restarted`` (known from the store; its weights
    died with the previous server until ``load_state``), ``released`` (its session ended; memory freed)."""

    model_id: str
    session_id: str
    tenant: str
    base_model: str
    lora: dict[str, Any]
    order: SeqOrder
    client: Future | None = None  # of a LocalTrainingClient
    status: str = "live"
    last_saved: str | None = None
    last_seq: int = 0  # the highest seq_id accepted


@dataclass
class Sampler:
    """A sampling session: its local sampling client (made again after a restart where its weights are saved)."""

    sampler_id: str
    session_id: str
    tenant: str
    client: Any  # a LocalSamplingClient, or None until made again
    model_path: str | None
    base_model: str | None
    snapshot: bool = False  # weights held in memory only (save_weights_and_get_sampling_client)


def order_thread_name(model_id: str) -> str:
    """The name of the thread that runs a model's calls in ``seq_id`` order."""
    return "model-" + model_id.rsplit(":", 1)[-1]


def ended_message(session: Session, timeout_s: float) -> str:
    """Why ``session`` (expired or finished) no longer answers, and what the client does next."""
    if session.status == "expired":
        return (f"session {session.session_id} expired: no heartbeat for {timeout_s:.0f} s (rlrunbook serve "
                "--session-timeout), so its models and samplers were released; its saved checkpoints stay. Create "
                "a new ServiceClient and continue from a checkpoint (create_training_client_from_state).")
    return (f"session {session.session_id} finished (its ServiceClient was closed), so its models and samplers "
            "were released; its saved checkpoints stay.")


def restarted_message(model: Model) -> str:
    """Why a call of ``model`` is refused after a restart, naming its last saved state."""
    resume = (f"training_client.load_state({model.last_saved!r}) (or load_state_with_optimizer) restores its "
              "last saved state" if model.last_saved else "it saved no state (save_state), so create a new "
              "training client")
    return (f"rlrunbook serve restarted since training model {model.model_id} was last used; its adapter and "
            f"optimizer state in memory are gone: {resume}.")
