"""The server's records in SQLite (``<storage>/serve.sqlite3``): what a restart must not lose.

Sessions, training models, sampling sessions and futures are written when the server acknowledges them, in
WAL mode, so a server killed at any moment (SIGKILL included) and started again on the same storage finds
every session it answered, every model with its base model, LoRA layout and last saved state, and every
request id it handed out: a future that was still running answers that the server restarted; one that had
finished answers its result, which is kept here until it has been delivered (and a while after, as the SDK
may poll again). Checkpoints themselves are folders under the storage root (:mod:`rlrunbook.backend.storage`),
written in one rename each.

API keys are never stored: a tenant is named by a digest of its key (:func:`tenant_of`).

Only the standard library's ``sqlite3``: a handful of tables with primary-key lookups, one writer (this
process, under a lock), no schema migrations yet, so an ORM would add a dependency and nothing else.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FILE_NAME = "serve.sqlite3"
SCHEMA_VERSION = 1
KEEP_DELIVERED_S = 600.0  # a delivered result stays retrievable this long: the SDK polls again if a reply was lost
KEEP_UNCLAIMED_S = 7 * 24 * 3600.0  # a result nobody asked for is dropped after a week
MAX_KEPT_BODY_BYTES = 64 * 2**20  # a larger result is kept in memory only (lost if the server restarts)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS sessions (
  session_id TEXT PRIMARY KEY, tenant TEXT NOT NULL, created REAL NOT NULL, last_heartbeat REAL NOT NULL,
  status TEXT NOT NULL, user_metadata TEXT NOT NULL, display_name TEXT, project_id TEXT,
  finish_reason TEXT);
CREATE TABLE IF NOT EXISTS models (
  model_id TEXT PRIMARY KEY, session_id TEXT NOT NULL, tenant TEXT NOT NULL, base_model TEXT NOT NULL,
  lora TEXT NOT NULL, run_id TEXT, last_saved TEXT, status TEXT NOT NULL, created REAL NOT NULL,
  last_seq INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS samplers (
  sampler_id TEXT PRIMARY KEY, session_id TEXT NOT NULL, tenant TEXT NOT NULL, base_model TEXT,
  model_path TEXT, snapshot INTEGER NOT NULL, created REAL NOT NULL);
CREATE TABLE IF NOT EXISTS futures (
  request_id TEXT PRIMARY KEY, tenant TEXT NOT NULL, owner TEXT, seq_id INTEGER, kind TEXT NOT NULL,
  status TEXT NOT NULL, body BLOB, media TEXT, error TEXT, category TEXT, created REAL NOT NULL,
  finished REAL, delivered REAL);
CREATE INDEX IF NOT EXISTS futures_by_call ON futures (owner, kind, seq_id);
CREATE TABLE IF NOT EXISTS runs (
  run_id TEXT PRIMARY KEY, tenant TEXT NOT NULL, model_id TEXT NOT NULL, created REAL NOT NULL);
"""


def tenant_of(api_key: str | None) -> str:
    """The name a key's sessions are recorded under: a digest, never the key (``open`` without a key)."""
    if api_key is None:
        return "open"
    return "key-" + hashlib.sha256(api_key.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class FutureRow:
    """A request id as recorded: ``status`` is ``pending``, ``done`` (``body`` in ``media`` ``json`` or
    ``proto``) or ``failed`` (``error``, ``category``)."""

    request_id: str
    tenant: str
    owner: str | None
    seq_id: int | None
    kind: str
    status: str
    body: bytes | None
    media: str | None
    error: str | None
    category: str | None


class ServeStore:
    """The SQLite file of one storage root; every method is safe from any thread (one connection, one lock)."""

    def __init__(self, root: Path):
        root.mkdir(parents=True, exist_ok=True)
        self.path = root / FILE_NAME
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=30)
        self._lock = threading.Lock()
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")  # a committed row survives the process being killed
            self._db.executescript(_SCHEMA)
            found = self._db.execute("SELECT value FROM meta WHERE key='schema'").fetchone()
            if found is None:
                self._db.execute("INSERT INTO meta VALUES ('schema', ?)", (str(SCHEMA_VERSION),))
            elif int(found[0]) != SCHEMA_VERSION:
                raise RuntimeError(f"{self.path} has schema {found[0]}, this rlrunbook reads {SCHEMA_VERSION}; "
                                   "serve from another --storage folder.")
            # A store written before the sessions' names and projects: the columns are added (empty).
            columns = {row[1] for row in self._db.execute("PRAGMA table_info(sessions)")}
            for column in ("display_name", "project_id", "finish_reason"):
                if column not in columns:
                    self._db.execute(f"ALTER TABLE sessions ADD COLUMN {column} TEXT")
            # A store written before the runs table: its models' runs become rows of it (idempotent).
            self._db.execute("INSERT OR IGNORE INTO runs SELECT run_id, tenant, model_id, created FROM models "
                             "WHERE run_id IS NOT NULL")

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _write(self, sql: str, args: tuple = ()) -> int:
        with self._lock:
            return self._db.execute(sql, args).rowcount

    def _read(self, sql: str, args: tuple = ()) -> list[tuple]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    # -- sessions -------------------------------------------------------------------------------
    def add_session(self, session_id: str, tenant: str, user_metadata: dict[str, str], created: float,
                    display_name: str | None = None, project_id: str | None = None) -> None:
        self._write("INSERT INTO sessions (session_id, tenant, created, last_heartbeat, status, user_metadata, "
                    "display_name, project_id) VALUES (?, ?, ?, ?, 'active', ?, ?, ?)",
                    (session_id, tenant, created, created, json.dumps(user_metadata), display_name, project_id))

    def sessions(self) -> list[dict[str, Any]]:
        rows = self._read("SELECT session_id, tenant, created, last_heartbeat, status, user_metadata, display_name, "
                          "project_id, finish_reason FROM sessions")
        return [{"session_id": r[0], "tenant": r[1], "created": r[2], "last_heartbeat": r[3], "status": r[4],
                 "user_metadata": json.loads(r[5]), "display_name": r[6], "project_id": r[7],
                 "finish_reason": r[8]} for r in rows]

    def set_session_project(self, session_id: str, project_id: str) -> None:
        self._write("UPDATE sessions SET project_id=? WHERE session_id=?", (project_id, session_id))

    def heartbeat(self, session_id: str, when: float) -> None:
        self._write("UPDATE sessions SET last_heartbeat=? WHERE session_id=?", (when, session_id))

    def set_session_status(self, session_id: str, status: str, finish_reason: str | None = None) -> None:
        self._write("UPDATE sessions SET status=?, finish_reason=? WHERE session_id=?",
                    (status, finish_reason, session_id))

    # -- models ---------------------------------------------------------------------------------
    def add_model(self, model_id: str, session_id: str, tenant: str, base_model: str, lora: dict) -> None:
        self._write("INSERT INTO models VALUES (?, ?, ?, ?, ?, NULL, NULL, 'live', ?, 0)",
                    (model_id, session_id, tenant, base_model, json.dumps(lora), time.time()))

    def models(self) -> list[dict[str, Any]]:
        rows = self._read("SELECT model_id, session_id, tenant, base_model, lora, run_id, last_saved, status, "
                          "last_seq FROM models")
        return [{"model_id": r[0], "session_id": r[1], "tenant": r[2], "base_model": r[3], "lora": json.loads(r[4]),
                 "run_id": r[5], "last_saved": r[6], "status": r[7], "last_seq": r[8]} for r in rows]

    def model_update(self, model_id: str, **fields: Any) -> None:
        """Set ``run_id``, ``last_saved``, ``status``, ``last_seq`` or ``lora`` of a model; a ``run_id`` is also
        recorded in the runs table, under the model's tenant, for as long as the storage holds the run."""
        assert fields and set(fields) <= {"run_id", "last_saved", "status", "last_seq", "lora"}, fields
        if "lora" in fields:
            fields["lora"] = json.dumps(fields["lora"])
        columns = ", ".join(f"{name}=?" for name in fields)
        with self._lock:
            self._db.execute("BEGIN")
            try:
                self._db.execute(f"UPDATE models SET {columns} WHERE model_id=?", (*fields.values(), model_id))
                if fields.get("run_id"):
                    self._db.execute("INSERT OR IGNORE INTO runs SELECT run_id, tenant, model_id, ? FROM models "
                                     "WHERE model_id=?", (time.time(), model_id))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    # -- runs -----------------------------------------------------------------------------------
    def runs(self) -> list[dict[str, Any]]:
        """Every run a model of this server made, with the tenant that owns it and the SDK model id that made
        it, oldest first. Kept when the model's session is forgotten: ownership outlives sessions."""
        rows = self._read("SELECT run_id, tenant, model_id FROM runs ORDER BY created, rowid")
        return [{"run_id": r[0], "tenant": r[1], "model_id": r[2]} for r in rows]

    # -- forgetting -----------------------------------------------------------------------------
    def forget_session(self, session_id: str, model_ids: list[str], sampler_ids: list[str]) -> None:
        """Delete, in one transaction, the rows of an ended session: it, its models and samplers, and the
        request ids they were given (the runs its models made stay, see :meth:`runs`)."""
        owners = [*model_ids, *sampler_ids]
        with self._lock:
            self._db.execute("BEGIN")
            try:
                self._db.execute("DELETE FROM sessions WHERE session_id=?", (session_id,))
                self._db.executemany("DELETE FROM models WHERE model_id=?", [(m,) for m in model_ids])
                self._db.executemany("DELETE FROM samplers WHERE sampler_id=?", [(s,) for s in sampler_ids])
                self._db.executemany("DELETE FROM futures WHERE owner=?", [(o,) for o in owners])
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    # -- samplers -------------------------------------------------------------------------------
    def add_sampler(self, sampler_id: str, session_id: str, tenant: str, base_model: str | None,
                    model_path: str | None, snapshot: bool) -> None:
        self._write("INSERT OR IGNORE INTO samplers VALUES (?, ?, ?, ?, ?, ?, ?)",
                    (sampler_id, session_id, tenant, base_model, model_path, int(snapshot), time.time()))

    def samplers(self) -> list[dict[str, Any]]:
        rows = self._read("SELECT sampler_id, session_id, tenant, base_model, model_path, snapshot FROM samplers")
        return [{"sampler_id": r[0], "session_id": r[1], "tenant": r[2], "base_model": r[3], "model_path": r[4],
                 "snapshot": bool(r[5])} for r in rows]

    # -- futures --------------------------------------------------------------------------------
    def add_future(self, request_id: str, tenant: str, owner: str | None, seq_id: int | None, kind: str) -> None:
        self._write("INSERT INTO futures (request_id, tenant, owner, seq_id, kind, status, created) "
                    "VALUES (?, ?, ?, ?, ?, 'pending', ?)", (request_id, tenant, owner, seq_id, kind, time.time()))

    def future_done(self, request_id: str, body: bytes | None, media: str) -> None:
        """Record a result; ``body`` None (too large to keep) marks it done but not kept."""
        self._write("UPDATE futures SET status='done', body=?, media=?, finished=? WHERE request_id=?",
                    (body, media, time.time(), request_id))

    def future_failed(self, request_id: str, error: str, category: str) -> None:
        self._write("UPDATE futures SET status='failed', error=?, category=?, finished=? WHERE request_id=?",
                    (error, category, time.time(), request_id))

    def future_delivered(self, request_id: str) -> None:
        self._write("UPDATE futures SET delivered=? WHERE request_id=? AND delivered IS NULL",
                    (time.time(), request_id))

    def future(self, request_id: str) -> FutureRow | None:
        rows = self._read("SELECT request_id, tenant, owner, seq_id, kind, status, body, media, error, category "
                          "FROM futures WHERE request_id=?", (request_id,))
        return FutureRow(*rows[0]) if rows else None

    def call_future(self, owner: str, kind: str, seq_id: int | None) -> str | None:
        """The request id already given to the call ``(owner, kind, seq_id)``: a retried request gets it again."""
        rows = self._read("SELECT request_id FROM futures WHERE owner=? AND kind=? AND seq_id IS ?",
                          (owner, kind, seq_id))
        return rows[0][0] if rows else None

    def fail_pending(self, error: str) -> int:
        """At start-up: every future the previous server left pending fails with ``error``; how many."""
        return self._write("UPDATE futures SET status='failed', error=?, category='server', finished=? "
                           "WHERE status='pending'", (error, time.time()))

    def sweep(self, now: float | None = None) -> int:
        """Drop results delivered more than :data:`KEEP_DELIVERED_S` ago, and unclaimed ones past a week."""
        now = time.time() if now is None else now
        return self._write("DELETE FROM futures WHERE (delivered IS NOT NULL AND delivered < ?) OR "
                           "(status != 'pending' AND finished < ?)",
                           (now - KEEP_DELIVERED_S, now - KEEP_UNCLAIMED_S))
