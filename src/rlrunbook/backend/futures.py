"""One worker thread per ServiceClient: calls run in submission order; results are SDK futures.

Every operation of every client made by one ServiceClient goes through the same worker, so
``forward_backward`` then ``optim_step`` then ``sample`` take effect in that order even when
the caller does not wait in between, and the device is never used by two calls at once.
The futures are the SDK's own ``AwaitableConcurrentFuture``: ``.result()`` blocks, ``await``
works in any event loop (also one already running), because the work never runs on the
caller's thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

from tinker.lib.public_interfaces.api_future import AwaitableConcurrentFuture

T = TypeVar("T")


class OrderedWorker:
    """A single-thread executor; ``submit`` returns an awaitable SDK future."""

    def __init__(self, name: str = "rlrunbook-local"):
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._lock = threading.Lock()

    def submit(self, fn: Callable[..., T], *args: object, **kwargs: object) -> AwaitableConcurrentFuture[T]:
        with self._lock:  # submission order is queue order, also across caller threads
            future: Future[T] = self._executor.submit(fn, *args, **kwargs)
        return AwaitableConcurrentFuture(future)

    def run(self, fn: Callable[..., T], *args: object, **kwargs: object) -> T:
        """Submit and wait: for calls that the SDK makes synchronous."""
        return self.submit(fn, *args, **kwargs).result()

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True)


def completed(value: T) -> AwaitableConcurrentFuture[T]:
    """An already-resolved SDK future."""
    future: Future[T] = Future()
    future.set_result(value)
    return AwaitableConcurrentFuture(future)
