"""Worker threads of a ServiceClient: calls run in submission order; results are SDK futures.

Every training call of every client made by one ServiceClient goes through the same worker, so
``forward_backward`` then ``optim_step`` then a snapshot for a sampler take effect in that order even
when the caller does not wait in between. By default sampling calls go through it too, so the device
is never used by two calls at once. With ``concurrent_sampling`` (backend/settings.py) the sampling
clients of the in-process engine have a second worker: each samples its own snapshot, copied into the
engine's pinned adapter (engines/pinned_adapter.py), so nothing the trainer does can change what it
returns, and its calls need not wait behind ``forward_backward``/``optim_step``. Calls on one client
still run in submission order (one worker per side, FIFO). On CPU the two workers split the intra-op
threads (``threads``) instead of each taking all of them.

Batchable calls (``sample``) that sit next to each other in the queue with the same batch key
run as one engine call: a loop that submits a whole round of sample requests before waiting
gets one batched generate, without any change to what each request returns (rows are seeded
per request, see engines/noise.py). A short collection window lets a burst of submissions
from another thread arrive before the batch starts.

Calls are queued per lane (:meth:`OrderedWorker.lane`: one per model host, so a training client and the
samplers of its weights share one) and the worker takes lanes in turn, one call (or one batch) at a time:
within a lane calls run in submission order, and a client that queued many calls does not hold back
another client's one call behind all of them. With one lane (one training client) that is plain FIFO.

A batchable call may also name a ``merge`` key and function: calls at the head of other lanes with the same
``merge`` key join its batch (the samplers of several training clients of one base model, decoded as one batch
with an adapter per row), and ``merge_fn`` gets them grouped by batch key. Each lane still runs its calls in
submission order: a call joins only from the front of its lane.

The futures are the SDK's own ``AwaitableConcurrentFuture``: ``.result()`` blocks, ``await`` works
in any event loop (also one already running), because the work never runs on the caller's thread.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

from tinker.lib.public_interfaces.api_future import AwaitableConcurrentFuture

from rlrunbook.backend.openmp import release_openmp_threads
from rlrunbook.backend.timeline import Timeline, call_name

T = TypeVar("T")
logger = logging.getLogger(__name__)


@dataclass
class _Task:
    future: Future
    run: Callable[[], Any] | None = None  # a plain call
    key: Hashable | None = None  # batchable: same key → one batch
    item: Any = None
    batch_fn: Callable[[list[Any]], list[Any]] | None = None
    rows: int = 1
    name: str = ""  # what the call is, for the timeline
    merge: Hashable | None = None  # batchable across lanes: same merge key → one call of merge_fn
    merge_fn: Callable[[list[list[Any]]], list[list[Any]]] | None = None


def _current_cuda_device() -> int | None:
    """The creating thread's CUDA device if it already uses CUDA, else None (CUDA left uninitialised).

    Looked up in ``sys.modules`` so that this module still does not import torch itself.
    """
    import sys

    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return torch.cuda.current_device()


class OrderedWorker:
    """A single worker thread with a FIFO queue; ``submit`` returns an awaitable SDK future."""

    def __init__(self, name: str = "rlrunbook-local", batch_window_s: float = 0.002, max_batch_rows: int = 256,
                 threads: int | None = None, timeline: Timeline | None = None):
        self._lanes: dict[Hashable, deque[_Task]] = {}  # queued calls per lane, each in submission order
        self._turns: deque[Hashable] = deque()  # lanes with queued calls, in the order they are served
        self._cv = threading.Condition()
        self._closed = False
        self.batch_window_s = batch_window_s
        self.max_batch_rows = max_batch_rows
        self.batches_run = 0  # engine calls made for batchable tasks (for tests and benchmarks)
        self._holds = 0
        self.threads = threads  # intra-op threads of this worker (None: torch's default)
        self.name = name
        self.timeline = timeline  # where each call's start and end are recorded (None: nowhere)
        # The current CUDA device is per thread; a process that picked its GPU (torchrun: cuda:LOCAL_RANK,
        # see rlrunbook.distributed.init) must not have its model land on cuda:0 from this thread.
        self._cuda_device = _current_cuda_device()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _queued(self) -> int:
        return sum(len(queue) for queue in self._lanes.values())

    def _enqueue(self, task: _Task, lane: Hashable = None) -> AwaitableConcurrentFuture:
        if threading.current_thread() is not self._thread:
            release_openmp_threads()  # the caller's pool would throttle the worker's (see backend/openmp.py)
        with self._cv:
            if self._closed:
                raise RuntimeError("this ServiceClient was closed; create a new one.")
            queue = self._lanes.setdefault(lane, deque())
            queue.append(task)
            if lane not in self._turns:
                self._turns.append(lane)
            self._cv.notify()
        return AwaitableConcurrentFuture(task.future)

    def lane(self, key: Hashable) -> WorkerLane:
        """This worker seen from one lane: what a client submits through (see the module docstring)."""
        return WorkerLane(self, key)

    def submit(self, fn: Callable[..., T], *args: object, **kwargs: object) -> AwaitableConcurrentFuture[T]:
        """Queue ``fn(*args, **kwargs)`` on the default lane."""
        return self._submit(None, fn, *args, **kwargs)

    def _submit(self, lane: Hashable, fn: Callable[..., T], *args: object, **kwargs: object
                ) -> AwaitableConcurrentFuture[T]:
        return self._enqueue(_Task(Future(), run=lambda: fn(*args, **kwargs), name=call_name(fn)), lane)

    def submit_batchable(self, key: Hashable, item: Any, batch_fn: Callable[[list[Any]], list[Any]],
                         rows: int = 1, *, lane: Hashable = None, merge: Hashable | None = None,
                         merge_fn: Callable[[list[list[Any]]], list[list[Any]]] | None = None
                         ) -> AwaitableConcurrentFuture:
        """Queue ``item``; consecutive items of one lane with the same ``key`` are handed to ``batch_fn`` together.

        ``merge`` (with ``merge_fn``): items at the head of other lanes with the same ``merge`` key join the batch,
        whatever their ``key``; a batch of several keys goes to ``merge_fn`` as one list of items per key (in the
        order the keys joined), which returns one list of results per key."""
        if (merge is None) != (merge_fn is None):
            raise ValueError("submit_batchable: merge and merge_fn go together")
        return self._enqueue(_Task(Future(), key=key, item=item, batch_fn=batch_fn, rows=rows,
                                   name=call_name(batch_fn), merge=merge, merge_fn=merge_fn), lane)

    @contextmanager
    def hold(self) -> Iterator[None]:
        """Within the block the worker starts nothing new, so everything submitted in it queues up and
        consecutive batchable requests become one batch whatever the timing. Submit only: waiting on a
        future inside the block would wait forever."""
        with self._cv:
            self._holds += 1
        try:
            yield
        finally:
            with self._cv:
                self._holds -= 1
                self._cv.notify_all()

    def run(self, fn: Callable[..., T], *args: object, **kwargs: object) -> T:
        """Submit and wait: for calls that the SDK makes synchronous."""
        return self.submit(fn, *args, **kwargs).result()

    def _next(self) -> tuple[Hashable, _Task]:
        """The next lane's first call (under ``_cv``, with ``_turns`` not empty); the lane goes to the back."""
        lane = self._turns.popleft()
        queue = self._lanes[lane]
        task = queue.popleft()
        if queue:
            self._turns.append(lane)
        else:
            del self._lanes[lane]
        return lane, task

    def _drop_if_empty(self, lane: Hashable) -> None:
        """Forget ``lane`` once a batch took its last queued call (under ``_cv``)."""
        queue = self._lanes.get(lane)
        if queue is not None and not queue:
            del self._lanes[lane]
            self._turns.remove(lane)

    def _joins(self, task: _Task, first: _Task) -> bool:
        return task.key == first.key or (first.merge is not None and task.merge == first.merge)

    def _take_batch(self, first: _Task, lane: Hashable) -> list[_Task]:
        batch, rows = [first], first.rows
        deadline = time.monotonic() + self.batch_window_s
        with self._cv:
            while True:
                queue = self._lanes.get(lane)
                while queue and self._joins(queue[0], first) and rows + queue[0].rows <= self.max_batch_rows:
                    task = queue.popleft()
                    batch.append(task)
                    rows += task.rows
                self._drop_if_empty(lane)
                if first.merge is not None:  # the heads of the other lanes that merge with it
                    for other in list(self._turns):
                        waiting = self._lanes[other]
                        while waiting and waiting[0].merge == first.merge and rows + waiting[0].rows <= self.max_batch_rows:
                            task = waiting.popleft()
                            batch.append(task)
                            rows += task.rows
                        self._drop_if_empty(other)
                if queue or rows >= self.max_batch_rows:
                    return batch  # the lane's next task is different: order must be kept
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return batch
                self._cv.wait(remaining)

    def _loop(self) -> None:
        if self.threads is not None:  # per thread in OpenMP: this worker's parallel regions use this many
            import torch

            torch.get_num_threads()  # torch's lazy per-thread init first: it would reset the count on first use
            torch.set_num_threads(self.threads)
        if self._cuda_device is not None:
            import torch

            torch.cuda.set_device(self._cuda_device)
        while True:
            with self._cv:
                while (not self._turns or self._holds) and not self._closed:
                    self._cv.wait()
                if not self._turns:
                    return
                lane, task = self._next()
            batch = [task] if task.key is None else self._take_batch(task, lane)
            start = time.perf_counter()
            if task.key is None:
                self._resolve(batch, lambda: [task.run()])
            else:
                self.batches_run += 1
                groups = [[t for t in batch if t.key == key] for key in dict.fromkeys(t.key for t in batch)]
                if len(groups) == 1:
                    self._resolve(batch, functools.partial(task.batch_fn, [t.item for t in batch]))
                else:
                    self._resolve_merged(groups)
            if self.timeline is not None:
                self.timeline.record(self.name, task.name, start, time.perf_counter(), len(batch))

    @staticmethod
    def _run_alone(group: list[_Task]) -> tuple[list[_Task], list[Any] | None, BaseException | None]:
        """One batch key's tasks as a batch of their own: (tasks, results, None) or (tasks, None, the error)."""
        try:
            return group, group[0].batch_fn([t.item for t in group]), None
        except BaseException as error:  # noqa: BLE001 - every waiter of this key must hear about it
            return group, None, error

    def _resolve_merged(self, groups: list[list[_Task]]) -> None:
        """One ``merge_fn`` call for several batch keys' tasks. Where it fails, each key's tasks run again as a batch
        of their own (``batch_fn``), so that each caller gets its own result or its own error, never another's."""
        tasks = [t for group in groups for t in group]
        live = {id(t) for t in tasks if t.future.set_running_or_notify_cancel()}
        if not live:
            return
        try:
            answers = groups[0][0].merge_fn([[t.item for t in group] for group in groups])
            outcomes = []
            for group, results in zip(groups, answers, strict=True):
                results = list(results)
                if len(results) != len(group):
                    raise ValueError(f"merge_fn gave {len(results)} results for {len(group)} items")
                outcomes.append((group, results, None))
        except BaseException as merged_error:  # noqa: BLE001 - retried per key below, or told to every waiter
            retry = isinstance(merged_error, Exception)  # an interrupt is not retried
            if retry:
                logger.warning("a merged batch of %d batch keys failed (%s: %s); each runs on its own", len(groups),
                               type(merged_error).__name__, merged_error)
            outcomes = [self._run_alone(group) if retry else (group, None, merged_error) for group in groups]
        self._release_if_idle()
        for group, results, error in outcomes:
            for index, t in enumerate(group):
                if id(t) not in live:
                    continue
                if error is not None:
                    t.future.set_exception(error)
                else:
                    t.future.set_result(results[index])

    def _resolve(self, tasks: list[_Task], compute: Callable[[], list[Any]]) -> None:
        live = [t for t in tasks if t.future.set_running_or_notify_cancel()]
        if not live:
            return
        try:
            results = compute()
        except BaseException as error:  # noqa: BLE001 - every waiter must hear about the failure
            self._release_if_idle()
            for t in live:
                t.future.set_exception(error)
            return
        self._release_if_idle()
        for t, result in zip(tasks, results, strict=True):
            if t in live:
                t.future.set_result(result)

    def _release_if_idle(self) -> None:
        """Nothing queued: free this thread's OpenMP pool before the waiter resumes its own work
        (see :mod:`rlrunbook.backend.openmp`)."""
        if not self._queued():
            release_openmp_threads()

    def shutdown(self, cancel_pending: bool = False, timeout: float | None = None) -> bool:
        """Stop the worker: after the queued calls, or (``cancel_pending``) cancelling them, so only the
        call already running finishes. Waits up to ``timeout`` seconds (None: until done); True if the
        thread ended. A process must not exit while this thread is inside a torch call: the interpreter
        tears down under it, and libstdc++ aborts with "terminate called without an active exception"."""
        if cancel_pending:
            self.cancel_pending()
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def cancel_pending(self) -> int:
        """Cancel every queued call that has not started (its future raises ``CancelledError``); how many."""
        with self._cv:
            cancelled = sum(task.future.cancel() for queue in self._lanes.values() for task in queue)
            self._lanes.clear()
            self._turns.clear()
            return cancelled


class WorkerLane:
    """One lane of an :class:`OrderedWorker`: the worker's ``submit``/``submit_batchable``/``run``/``hold`` for the
    calls of one client, which run in the order submitted, taking turns with the other lanes."""

    def __init__(self, worker: OrderedWorker, key: Hashable):
        self.worker = worker
        self.key = key

    def submit(self, fn: Callable[..., T], *args: object, **kwargs: object) -> AwaitableConcurrentFuture[T]:
        return self.worker._submit(self.key, fn, *args, **kwargs)

    def submit_batchable(self, key: Hashable, item: Any, batch_fn: Callable[[list[Any]], list[Any]],
                         rows: int = 1, *, merge: Hashable | None = None,
                         merge_fn: Callable[[list[list[Any]]], list[list[Any]]] | None = None
                         ) -> AwaitableConcurrentFuture:
        return self.worker.submit_batchable(key, item, batch_fn, rows, lane=self.key, merge=merge, merge_fn=merge_fn)

    def run(self, fn: Callable[..., T], *args: object, **kwargs: object) -> T:
        return self.submit(fn, *args, **kwargs).result()

    def hold(self):
        return self.worker.hold()

    @property
    def timeline(self) -> Timeline | None:
        return self.worker.timeline


def completed(value: T) -> AwaitableConcurrentFuture[T]:
    """An already-resolved SDK future."""
    future: Future[T] = Future()
    future.set_result(value)
    return AwaitableConcurrentFuture(future)


class ResolvedClient:
    """A client that is also its own finished future.

    The SDK's ``create_*`` methods return a future of the client, which code either awaits
    (``await service.create_lora_training_client(...)``) or resolves (``.result()``). The local
    backend creates clients eagerly, so each client stands in for that finished future too:
    ``.result()``, ``await client``, ``.result_async()`` and ``.future()`` all give the client.
    """

    def result(self, timeout: float | None = None):
        return self

    async def result_async(self, timeout: float | None = None):
        return self

    def future(self) -> Future:
        future: Future = Future()
        future.set_result(self)
        return future

    async def coroutine(self):
        return self

    def __await__(self):
        return self.result_async().__await__()
