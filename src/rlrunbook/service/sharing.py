"""What a tenant shares and what it owns beyond its models: published checkpoints and copies of checkpoints.

A tenant publishes a checkpoint of its own run (``RestClient.publish_checkpoint_from_tinker_path``); every
other tenant may then read it by its ``tinker://`` path (``weights_info``, ``load_state``,
``create_training_client_from_state``, ``create_sampling_client(model_path=...)``) until it is unpublished or
deleted. Runs, listings and deletion stay the owner's. Publishing a published checkpoint, or unpublishing a
private one, changes nothing and answers as success: the SDK retries the hosted service's 409 for five minutes.
A run the server did not make (the operator's) is readable by every tenant already and is not published.

A copy (``RestClient.copy_weights``) is a byte copy of a checkpoint the caller may read, as a new run of the
local backend (:func:`rlrunbook.backend.rest_client.copy_checkpoint`) owned by the caller. The SDK sends one
``X-Idempotency-Key`` for a copy and its retries; a retry with the same key answers the first copy's path.

Both are tables of the server's SQLite file (``published``, ``copies``), written through the store's one
connection and lock, so a restart keeps them.
"""

from __future__ import annotations

import time

from tinker import types

from rlrunbook.backend.rest_client import copy_checkpoint, new_run_id
from rlrunbook.backend.storage import CheckpointStore, parse_tinker_path
from rlrunbook.errors import InputError, ModelNotFoundError
from rlrunbook.service.store import ServeStore

_SCHEMA = (
    ("CREATE TABLE IF NOT EXISTS published (tinker_path TEXT PRIMARY KEY, run_id TEXT NOT NULL, "
     "tenant TEXT NOT NULL, created REAL NOT NULL)"),
    ("CREATE TABLE IF NOT EXISTS copies (run_id TEXT PRIMARY KEY, tenant TEXT NOT NULL, "
     "source_path TEXT NOT NULL, tinker_path TEXT NOT NULL, idempotency_key TEXT, created REAL NOT NULL)"),
)


class Sharing:
    """Published checkpoints and copies, recorded in ``store``; checkpoints read from ``checkpoints``."""

    def __init__(self, store: ServeStore, checkpoints: CheckpointStore):
        self.store = store
        self.checkpoints = checkpoints
        for statement in _SCHEMA:
            store._write(statement)

    # -- publishing -----------------------------------------------------------------------------------
    def publish(self, run_id: str, checkpoint_id: str, tenant: str, owner: str | None) -> None:
        """Publish checkpoint ``checkpoint_id`` (``<kind>/<name>``) of storage run ``run_id``, which ``tenant``
        must own (``owner``); ``ModelNotFoundError`` for a checkpoint that is not saved, ``InputError`` for an
        operator's run."""
        path = self._saved(run_id, checkpoint_id, tenant, owner)
        self.store._write("INSERT OR IGNORE INTO published VALUES (?, ?, ?, ?)", (path, run_id, tenant, time.time()))

    def unpublish(self, run_id: str, checkpoint_id: str, tenant: str, owner: str | None) -> None:
        """Make a checkpoint of the caller's own run private again (as :meth:`publish` checks it)."""
        path = self._saved(run_id, checkpoint_id, tenant, owner)
        self.store._write("DELETE FROM published WHERE tinker_path=?", (path,))

    def forget(self, path: str) -> None:
        """A deleted checkpoint is no longer published (one saved again under its name starts private)."""
        self.store._write("DELETE FROM published WHERE tinker_path=?", (parse_tinker_path(path).path,))

    def is_published(self, path: str) -> bool:
        return bool(self.store._read("SELECT 1 FROM published WHERE tinker_path=?", (parse_tinker_path(path).path,)))

    def published_paths(self) -> set[str]:
        return {row[0] for row in self.store._read("SELECT tinker_path FROM published")}

    def _saved(self, run_id: str, checkpoint_id: str, tenant: str, owner: str | None) -> str:
        path = parse_tinker_path(f"tinker://{run_id}/{checkpoint_id}")
        if owner is None:
            raise InputError(f"{path.path} is of a run this server did not make (the operator's): every key reads "
                             "it already; publish checkpoints of your own runs.")
        if owner != tenant:  # another tenant's: as unknown as a made-up path
            raise ModelNotFoundError(f"no checkpoint at {path.path}.")
        self.checkpoints.existing_folder(path, encrypted_ok=True)
        return path.path

    # -- copies ---------------------------------------------------------------------------------------
    def copy(self, request: types.CopyWeightsRequest, tenant: str, idempotency_key: str | None) -> dict:
        """Copy ``request.source_path`` (which the caller may read: checked before) into a new run the caller
        owns; the body of ``CopyWeightsResponse``. The session-slot form of the request is refused: the SDK's
        ``copy_weights`` names a project, and the copy is always a run of its own here."""
        if request.session_id is not None or request.model_seq_id is not None:
            raise InputError("copy_weights into a session's model slot (session_id, model_seq_id) is not served: "
                             "rlrunbook serve makes each copy a run of its own; send destination_project_id "
                             "(RestClient.copy_weights or ServiceClient.copy_weights do).")
        if idempotency_key:
            known = self.store._read("SELECT tinker_path FROM copies WHERE tenant=? AND idempotency_key=?",
                                     (tenant, idempotency_key))
            if known:
                return {"tinker_path": known[0][0]}
        source = parse_tinker_path(request.source_path)
        run_id = new_run_id()
        target = f"tinker://{run_id}/{source.kind}/{source.name}"
        # Recorded first: the new run is never, even for a moment, a run without an owner (every tenant's).
        self.store._write("INSERT INTO copies VALUES (?, ?, ?, ?, ?, ?)",
                          (run_id, tenant, source.path, target, idempotency_key or None, time.time()))
        try:
            copied = copy_checkpoint(self.checkpoints, source.path, request.ttl_seconds, model_id=run_id)
        except BaseException:
            if not self.checkpoints.run_folder(run_id).exists():  # else a half-made run stays the caller's
                self.store._write("DELETE FROM copies WHERE run_id=?", (run_id,))
            raise
        return {"tinker_path": copied}

    def copy_owners(self) -> dict[str, str]:
        """Run id -> tenant of every copy made through this server."""
        return {row[0]: row[1] for row in self.store._read("SELECT run_id, tenant FROM copies")}
