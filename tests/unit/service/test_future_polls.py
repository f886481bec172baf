"""The long poll of ``retrieve_future`` (service/futures.py): it waits for the call's outcome in whatever event
loop polls (each ``asyncio.run`` is a new one), and a stopping server ends every poll "not yet" at once."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future

from rlrunbook.service.futures import FutureRegistry
from rlrunbook.service.store import ServeStore


def _finish_later(future: Future, value: dict, after_s: float) -> None:
    threading.Timer(after_s, future.set_result, args=(value,)).start()


def test_polls_from_several_event_loops_each_wait_for_their_call(tmp_path):
    store = ServeStore(tmp_path)
    registry = FutureRegistry(store)
    try:
        calls = [Future() for _ in range(3)]
        rids = [registry.add(call, lambda result: result, tenant="t") for call in calls]
        for index, (call, rid) in enumerate(zip(calls, rids, strict=True)):  # a new event loop per poll
            _finish_later(call, {"index": index}, 0.2)
            assert asyncio.run(registry.wait(rid, "t", 10)) == (True, {"index": index})
    finally:
        registry.close()
        store.close()


def test_a_stopping_server_answers_every_poll_not_yet(tmp_path):
    store = ServeStore(tmp_path)
    registry = FutureRegistry(store)
    try:
        waiting, later = Future(), Future()
        first, second = registry.add(waiting, dict, tenant="t"), registry.add(later, dict, tenant="t")

        async def stop_while_polling():
            poll = asyncio.ensure_future(registry.wait(first, "t", 30))
            await asyncio.sleep(0.1)
            registry.end_polls()
            return await asyncio.wait_for(poll, 5), await asyncio.wait_for(registry.wait(second, "t", 30), 5)

        assert asyncio.run(stop_while_polling()) == ((False, None), (False, None))
        waiting.set_result({}), later.set_result({})
    finally:
        registry.close()
        store.close()
