"""The server's futures: request ids the SDK polls (``/retrieve_future``), and per-model ordering by ``seq_id``.

Every queued call answers at once with a request id; the SDK then long-polls ``/retrieve_future`` until the
result is there. :class:`FutureRegistry` holds a ``concurrent.futures.Future`` per id (the local backend's
futures are those) with the function that turns its result into the response body. :class:`SeqOrder` runs
the calls of one training model in ``seq_id`` order, whatever order their HTTP requests arrive in: the SDK
sends the chunks of a large ``forward_backward`` concurrently, the first chunk last.
"""

from __future__ import annotations

import asyncio
import secrets
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from rlrunbook.errors import InputError

# How long a delivered result stays retrievable: the SDK polls again when a response was lost in transit.
KEEP_DELIVERED_S = 600.0


def request_id() -> str:
    """An unguessable request id (a future of one client is no business of another)."""
    return f"req-{secrets.token_urlsafe(18)}"


def chain(source: Future | Any, target: Future) -> None:
    """Resolve ``target`` as ``source`` resolves (a concurrent future, or an SDK future with ``.future()``)."""
    inner = source.future() if hasattr(source, "future") and not isinstance(source, Future) else source

    def copy(done: Future) -> None:
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
    future: Future
    encode: Callable[[Any], Any]
    delivered_at: float | None = None
    encoded: Any = None


@dataclass
class FutureRegistry:
    """Request id → future and encoder. ``add`` files one; ``wait`` long-polls it."""

    _entries: dict[str, _Entry] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, future: Future, encode: Callable[[Any], Any]) -> str:
        """File ``future``; the response body is ``encode(result)`` (bytes for protobuf, else a JSON dict)."""
        rid = request_id()
        with self._lock:
            self._sweep()
            self._entries[rid] = _Entry(future, encode)
        return rid

    def _sweep(self) -> None:
        horizon = time.monotonic() - KEEP_DELIVERED_S
        for rid in [rid for rid, entry in self._entries.items()
                    if entry.delivered_at is not None and entry.delivered_at < horizon]:
            del self._entries[rid]

    def known(self, rid: str) -> bool:
        with self._lock:
            return rid in self._entries

    async def wait(self, rid: str, timeout_s: float) -> tuple[bool, Any]:
        """``(True, body)`` once the future of ``rid`` is done (its encoded result; an exception it raised, or
        that encoding raised, is raised here), ``(False, None)`` after ``timeout_s`` without it."""
        with self._lock:
            entry = self._entries.get(rid)
        if entry is None:
            raise KeyError(rid)
        if not entry.future.done():
            try:
                await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(entry.future)), timeout_s)
            except asyncio.TimeoutError:
                return False, None
            except Exception:  # noqa: BLE001 - the future's own error, raised below from the future itself
                pass
        if entry.encoded is None:
            entry.encoded = entry.encode(entry.future.result())
        entry.delivered_at = time.monotonic()
        return True, entry.encoded


class SeqOrder:
    """Runs the calls of one training model in ``seq_id`` order (1, 2, 3, ... as the SDK numbers them).

    ``submit(seq_id, call)`` returns a future at once; ``call`` runs on this model's own thread once every
    lower ``seq_id`` has run, and its result (a value, or a future of the local backend, which is chained) is
    the future's. A ``seq_id`` seen before is refused: :class:`~rlrunbook.service.state.ServeState` answers a
    retried request with its first request id before it reaches here."""

    def __init__(self, name: str, first: int = 1):
        self._next = first
        self._waiting: dict[int, tuple[Callable[[], Any], Future]] = {}
        self._lock = threading.Lock()
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"rlrunbook-serve-{name}")

    def submit(self, seq_id: int, call: Callable[[], Any]) -> Future:
        outer: Future = Future()
        with self._lock:
            if seq_id < self._next or seq_id in self._waiting:
                return failed(InputError(f"seq_id {seq_id} of this model was already used (the next one is "
                                         f"{self._next}); each call of a training client takes the next seq_id."))
            self._waiting[seq_id] = (call, outer)
            while self._next in self._waiting:  # in order, onto the one thread (FIFO)
                ready = self._waiting.pop(self._next)
                self._thread.submit(self._run, *ready)
                self._next += 1
        return outer

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

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)
