"""The server's futures: request ids the SDK polls (``/retrieve_future``), and per-model ordering by ``seq_id``.

Every queued call answers at once with a request id; the SDK then long-polls ``/retrieve_future`` until the
result is there. :class:`FutureRegistry` holds a ``concurrent.futures.Future`` per id (the local backend's
futures are those) with the function that turns its result into the response body, and records the id, then
its outcome, in the server's SQLite store (:mod:`rlrunbook.service.store`): a result is delivered only once it
is recorded, so a server killed and started again answers every id it handed out (with the result, or with
the error that it restarted while the call was pending), never with a hang.

:class:`SeqOrder` runs the calls of one training model in ``seq_id`` order, whatever order their HTTP requests
arrive in: the SDK sends the chunks of a large ``forward_backward`` concurrently, the first chunk last.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import re
import secrets
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlrunbook.backend.storage import KINDS
from rlrunbook.errors import InputError, RlrunbookError
from rlrunbook.service.store import KEEP_DELIVERED_S, MAX_KEPT_BODY_BYTES, ServeStore

logger = logging.getLogger("rlrunbook.serve")

SEQ_GAP_TIMEOUT_S = 300.0  # a call whose lower seq_id never arrives fails after this long, never waits forever


def request_id() -> str:
    """An unguessable request id (a future of one client is no business of another)."""
    return f"req-{secrets.token_urlsafe(18)}"


def failure_category(error: BaseException) -> str:
    """``user`` for what the request got wrong (a refused value, an unknown name), ``server`` for the rest."""
    return "user" if isinstance(error, (RlrunbookError, ValueError, LookupError, TypeError)) else "server"


def without_folders(message: str, root: Path) -> str:
    """``message`` with the folders of the storage ``root`` named as a caller knows them: a checkpoint's by its
    ``tinker://`` path, any other as ``<storage>``. Answers name no folder of the server; some errors of the
    local backend name the checkpoint folder they read."""
    kinds = "|".join(KINDS)
    for folder in dict.fromkeys([str(root), str(root.resolve())]):
        message = re.sub(re.escape(folder) + rf"/([^/\s'\"]+)/({kinds})/([^/\s'\"]+)", r"tinker://\1/\2/\3", message)
        message = message.replace(folder, "<storage>")
    return message


class CallFailedError(Exception):
    """A call's failure as the SDK receives it (``{"error": message, "category": ...}``)."""

    def __init__(self, message: str, category: str):
        super().__init__(message)
        self.message = message
        self.category = category


def chain(source: Future | Any, target: Future) -> None:
    """Resolve ``target`` as ``source`` resolves (a concurrent future, or an SDK future with ``.future()``)."""
    inner = source.future() if hasattr(source, "future") and not isinstance(source, Future) else source

    def copy(done: Future) -> None:
        if done.cancelled():  # the server is stopping: the call never ran (see FutureRegistry.stop_recording)
            if not target.cancel():
                target.set_exception(RuntimeError("the call was cancelled: the server is stopping"))
            return
        error = done.exception()
        if error is not None:
            target.set_exception(error)
        else:
            target.set_result(done.result())

    inner.add_done_callback(copy)


def failed(error: BaseException) -> Future:
    """A future that already failed with ``error``: how a refused call reaches the SDK (RequestFailedError)."""
    future: Future = Future()
    future.set_exception(error)
    return future


@dataclass
class _Entry:
    tenant: str
    owner: str | None
    recorded: Future  # of (body, media): the outcome, once it is in the store
    delivered_at: float | None = None


def _never_ran(done: Future) -> bool:
    """Whether ``done`` ended without its call running: cancelled, or failed because what it waited on was."""
    return done.cancelled() or isinstance(done.exception(), concurrent.futures.CancelledError)


STOPPED_MESSAGE = ("rlrunbook serve stopped before this call ran; once it runs again on this storage, the request "
                   "answers that the server restarted while it was pending.")


@dataclass
class FutureRegistry:
    """Request id → outcome. ``add`` files a future; ``wait`` long-polls one, for its tenant only.

    Stopping (SIGTERM) takes three steps, in this order: :meth:`end_polls` (in the event loop, as the HTTP server
    starts shutting down) answers every long poll "try again" at once, so no connection holds the shutdown;
    :meth:`stop_recording` makes a call cancelled by the stop (it never ran) stay ``pending`` in the store, where
    a restart reports it; :meth:`close` records the outcomes still queued and ignores any that come later."""

    store: ServeStore
    _entries: dict[str, _Entry] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _recorder: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlrunbook-serve-record"))
    _stopping: bool = False
    _closed: bool = False
    _left_pending: int = 0
    _polls_ended: bool = False
    _poll_stops: set = field(default_factory=set)  # the events of the long polls waiting now

    def add(self, future: Future, encode: Callable[[Any], Any], *, tenant: str, owner: str | None = None,
            seq_id: int | None = None, kind: str = "call") -> str:
        """File ``future`` (recorded as pending at once); its response body is ``encode(result)``: bytes for
        protobuf, else a JSON dict. ``(owner, kind, seq_id)`` names the call, so a retried request finds it."""
        rid = request_id()
        self.store.add_future(rid, tenant, owner, seq_id, kind)
        recorded: Future = Future()
        with self._lock:
            self._sweep()
            self._entries[rid] = _Entry(tenant, owner, recorded)
        future.add_done_callback(lambda done: self._on_done(rid, done, encode, recorded))
        return rid

    def _on_done(self, rid: str, done: Future, encode: Callable[[Any], Any], recorded: Future) -> None:
        with self._lock:  # against close(): nothing is handed to a recorder that was shut down
            if not self._closed:
                self._recorder.submit(self._record, rid, done, encode, recorded)
                return
            # The server has stopped: the store stays as it is (this call "pending"), the answer is lost with it.
            self._left_pending += 1
        recorded.set_exception(CallFailedError(STOPPED_MESSAGE, "server"))

    def _record(self, rid: str, done: Future, encode: Callable[[Any], Any], recorded: Future) -> None:
        if self._stopping and _never_ran(done):  # left pending: a restart reports it as such
            with self._lock:
                self._left_pending += 1
            recorded.set_exception(CallFailedError(STOPPED_MESSAGE, "server"))
            return
        try:
            if done.cancelled():
                raise RuntimeError("the call was cancelled: the server is stopping")
            body = encode(done.result())
        except BaseException as error:
            category = failure_category(error)
            message = without_folders(f"{type(error).__name__}: {error}", self.store.path.parent)
            if category == "server":
                logger.error("request %s failed", rid, exc_info=error)
            self._try_store(self.store.future_failed, rid, message, category)
            recorded.set_exception(CallFailedError(message, category))
            return
        media = "proto" if isinstance(body, bytes) else "json"
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        self._try_store(self.store.future_done, rid, raw if len(raw) <= MAX_KEPT_BODY_BYTES else None, media)
        recorded.set_result((body, media))

    @staticmethod
    def _try_store(write: Callable[..., Any], *args: Any) -> None:
        try:
            write(*args)
        except Exception:
            logger.exception("could not record request %s in the server's store", args[0])

    def _sweep(self) -> None:
        horizon = time.monotonic() - KEEP_DELIVERED_S
        for rid in [rid for rid, entry in self._entries.items()
                    if entry.delivered_at is not None and entry.delivered_at < horizon]:
            del self._entries[rid]

    def forget(self, owners: set[str]) -> None:
        """Drop the request ids of ``owners`` (models and samplers of a forgotten session) from memory; their
        rows go with the session's (:meth:`ServeStore.forget_session`), so they answer as unknown (404)."""
        with self._lock:
            for rid in [rid for rid, entry in self._entries.items() if entry.owner in owners]:
                del self._entries[rid]

    def pending(self) -> dict[str | None, int]:
        """How many calls of each owner (a model or sampler id) have not finished yet."""
        counts: dict[str | None, int] = {}
        with self._lock:
            for entry in self._entries.values():
                if not entry.recorded.done():
                    counts[entry.owner] = counts.get(entry.owner, 0) + 1
        return counts

    def owner(self, rid: str) -> str | None:
        """The model or sampler id whose call ``rid`` is (None: unknown here, or a call of no model)."""
        with self._lock:
            entry = self._entries.get(rid)
        return None if entry is None else entry.owner

    async def wait(self, rid: str, tenant: str, timeout_s: float) -> tuple[bool, Any]:
        """``(True, body)`` once the call of ``rid`` is done and recorded (a dict, or protobuf bytes); its failure
        raises :class:`CallFailedError`; ``(False, None)`` after ``timeout_s`` without it. ``KeyError`` for an id
        this tenant does not own."""
        with self._lock:
            entry = self._entries.get(rid)
        if entry is None:
            return True, self._from_store(rid, tenant)
        if entry.tenant != tenant:
            raise KeyError(rid)
        # One event per poll, made in the poll's own event loop (an event is bound to the loop that first waits on
        # it). Neither waiter is cancelled by a timeout (asyncio.wait), so a poll that ends never cancels the call.
        stop = asyncio.Event()
        if self._polls_ended:
            stop.set()
        self._poll_stops.add(stop)
        outcome = asyncio.wrap_future(entry.recorded)
        ended = asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait({outcome, ended}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            ended.cancel()
            self._poll_stops.discard(stop)
            if entry.recorded.done():
                self._delivered(rid, entry)
        if not outcome.done():
            return False, None
        body, _ = outcome.result()
        return True, body

    def end_polls(self) -> None:
        """In the event loop, as the server stops: every long poll, running or to come, answers "not yet" now."""
        self._polls_ended = True
        for stop in list(self._poll_stops):
            stop.set()

    def _delivered(self, rid: str, entry: _Entry) -> None:
        if entry.delivered_at is None:
            entry.delivered_at = time.monotonic()
            self._try_store(self.store.future_delivered, rid)

    def _from_store(self, rid: str, tenant: str) -> Any:
        """The outcome of a call of an earlier server on this storage (or one swept from memory)."""
        row = self.store.future(rid)
        if row is None or row.tenant != tenant:
            raise KeyError(rid)
        self._try_store(self.store.future_delivered, rid)
        if row.status == "failed":
            raise CallFailedError(row.error or "the call failed", row.category or "server")
        if row.status != "done":
            raise CallFailedError("this request is pending in no running server (its store was changed outside "
                                  "rlrunbook serve); send the call again.", "server")
        if row.body is None:
            raise CallFailedError("the call finished, but its result was too large to keep across a restart of "
                                  "the server; send the call again.", "server")
        return row.body if row.media == "proto" else json.loads(row.body)

    def stop_recording(self) -> None:
        """From now on a call that is cancelled (the server is stopping) stays ``pending`` in the store."""
        self._stopping = True

    def close(self) -> int:
        """Record every outcome already handed over, then no more; how many calls were left pending (unrun)."""
        with self._lock:
            self._closed = True
        self._recorder.shutdown(wait=True)
        with self._lock:
            return self._left_pending + sum(not entry.recorded.done() for entry in self._entries.values())


class SeqOrder:
    """Runs the calls of one training model in ``seq_id`` order (1, 2, 3, ... as the SDK numbers them).

    ``submit(seq_id, call)`` returns a future at once; ``call`` runs on this model's own thread once every
    lower ``seq_id`` has run, and its result (a value, or a future of the local backend, which is chained) is
    the future's. A ``seq_id`` seen before is refused: :class:`~rlrunbook.service.models.Models` answers a
    retried request with its first request id before it reaches here. A call whose lower ``seq_id`` has not
    arrived after ``gap_timeout_s`` fails naming it, and the order goes on past the gap: the SDK sends every
    ``seq_id``, so a gap means a request was lost (a server restarted while it was in flight)."""

    def __init__(self, name: str, first: int = 1, gap_timeout_s: float = SEQ_GAP_TIMEOUT_S):
        self._next = first
        self._waiting: dict[int, tuple[Callable[[], Any], Future]] = {}
        self._lock = threading.Lock()
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"rlrunbook-serve-{name}")
        self.gap_timeout_s = gap_timeout_s
        self._timer: threading.Timer | None = None

    @property
    def last(self) -> int:
        """The highest ``seq_id`` released to run so far (``first - 1`` before any)."""
        return self._next - 1

    def submit(self, seq_id: int, call: Callable[[], Any]) -> Future:
        outer: Future = Future()
        with self._lock:
            if seq_id < self._next or seq_id in self._waiting:
                return failed(InputError(f"seq_id {seq_id} of this model was already used (the next one is "
                                         f"{self._next}); each call of a training client takes the next seq_id."))
            self._waiting[seq_id] = (call, outer)
            self._release()
            if self._waiting and self._timer is None:
                self._timer = threading.Timer(self.gap_timeout_s, self._skip_gap)
                self._timer.daemon = True
                self._timer.start()
        return outer

    def _release(self) -> None:
        """Hand the calls that are next in order to the thread (under the lock)."""
        while self._next in self._waiting:  # in order, onto the one thread (FIFO)
            ready = self._waiting.pop(self._next)
            self._thread.submit(self._run, *ready)
            self._next += 1
        if not self._waiting and self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _skip_gap(self) -> None:
        with self._lock:
            self._timer = None
            if not self._waiting:
                return
            missing = self._next
            self._next = min(self._waiting)
            for seq_id in sorted(self._waiting):
                if seq_id > self._next:
                    break
                _, outer = self._waiting.pop(seq_id)
                outer.set_exception(InputError(
                    f"seq_id {missing} of this model never arrived within {self.gap_timeout_s:.0f} s, so the call "
                    f"with seq_id {seq_id} was not run (calls of a training client run in seq_id order); "
                    "send it again."))
                self._next = seq_id + 1
            self._release()
            if self._waiting:
                self._timer = threading.Timer(self.gap_timeout_s, self._skip_gap)
                self._timer.daemon = True
                self._timer.start()

    @staticmethod
    def _run(call: Callable[[], Any], outer: Future) -> None:
        try:
            result = call()
        except BaseException as error:  # noqa: BLE001 - the call's error is the future's
            outer.set_exception(error)
            return
        if isinstance(result, Future) or hasattr(result, "future") and callable(result.future):
            chain(result, outer)
        else:
            outer.set_result(result)

    def close(self, wait: bool = False) -> None:
        """Run nothing more; the call running goes on (``wait``: until it has finished)."""
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
        self._thread.shutdown(wait=wait, cancel_futures=True)
