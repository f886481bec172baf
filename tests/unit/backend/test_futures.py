"""The worker's lanes: calls of one lane run in submission order, lanes take turns, batches stay in their lane."""

from __future__ import annotations

import threading

import pytest

from rlrunbook.backend.futures import OrderedWorker


def _record(ran: list[str], name: str) -> str:
    ran.append(name)
    return name


def test_lanes_take_turns_and_each_keeps_its_order():
    worker, ran = OrderedWorker(), []
    a, b, c = worker.lane("a"), worker.lane("b"), worker.lane("c")
    with worker.hold():  # everything below is queued before the worker takes any of it
        futures = [a.submit(_record, ran, f"a{i}") for i in range(4)]
        futures.append(b.submit(_record, ran, "b0"))
        futures += [c.submit(_record, ran, f"c{i}") for i in range(2)]
    for future in futures:
        future.result(timeout=30)
    worker.shutdown()
    # One call per lane per turn: b's only call waits for one of a's, not for all four.
    assert ran == ["a0", "b0", "c0", "a1", "c1", "a2", "a3"]


def test_the_default_lane_takes_turns_like_the_others():
    worker, ran = OrderedWorker(), []
    lane = worker.lane("only")
    with worker.hold():
        futures = [lane.submit(_record, ran, str(i)) for i in range(6)]
        futures.append(worker.submit(_record, ran, "default"))  # the default lane is a lane like the others
    [future.result(timeout=30) for future in futures]
    worker.shutdown()
    assert ran == ["0", "default", "1", "2", "3", "4", "5"]


def test_a_batch_takes_only_its_own_lanes_calls():
    worker, batches = OrderedWorker(), []

    def batch(items: list[str]) -> list[str]:
        batches.append(items)
        return items

    a, b = worker.lane("a"), worker.lane("b")
    with worker.hold():
        futures = [a.submit_batchable("k", f"a{i}", batch) for i in range(3)]
        futures += [b.submit_batchable("k", f"b{i}", batch) for i in range(2)]
    assert [future.result(timeout=30) for future in futures] == ["a0", "a1", "a2", "b0", "b1"]
    worker.shutdown()
    assert batches == [["a0", "a1", "a2"], ["b0", "b1"]]


def test_calls_that_merge_join_from_the_head_of_other_lanes_and_keep_each_lanes_order():
    """Lanes a and b queue calls of one merge key (different batch keys); c queues one of another merge key, and
    b's third call is a plain call: one merged batch takes a's calls and b's first two, grouped by batch key; b's
    last sample waits behind b's plain call, as its lane's order says."""
    worker, ran = OrderedWorker(), []

    def batch(items: list[str]) -> list[str]:
        ran.append(list(items))
        return [f"{item}!" for item in items]

    def merged(groups: list[list[str]]) -> list[list[str]]:
        ran.append([list(group) for group in groups])
        return [[f"{item}+" for item in group] for group in groups]

    a, b, c = worker.lane("a"), worker.lane("b"), worker.lane("c")
    with worker.hold():
        futures = [a.submit_batchable("ka", f"a{i}", batch, merge="m", merge_fn=merged) for i in range(2)]
        futures += [b.submit_batchable("kb", f"b{i}", batch, merge="m", merge_fn=merged) for i in range(2)]
        futures.append(b.submit(_record, ran, "b-plain"))
        futures.append(b.submit_batchable("kb", "b2", batch, merge="m", merge_fn=merged))
        futures.append(c.submit_batchable("kc", "c0", batch, merge="other", merge_fn=merged))
    results = [future.result(timeout=30) for future in futures]
    worker.shutdown()
    assert results == ["a0+", "a1+", "b0+", "b1+", "b-plain", "b2!", "c0!"]
    assert ran == [[["a0", "a1"], ["b0", "b1"]], "b-plain", ["c0"], ["b2"]]


def test_a_failed_merged_batch_runs_each_key_alone_so_each_caller_gets_its_own_outcome():
    """merge_fn fails (one key's items are bad): each key's calls run again as their own batch; the good key's
    callers get their results, the bad key's callers their own error."""
    worker, ran = OrderedWorker(), []

    def batch(items: list[str]) -> list[str]:
        ran.append(list(items))
        if any(item.startswith("bad") for item in items):
            raise ValueError(f"cannot run {items}")
        return [f"{item}!" for item in items]

    def merged(groups: list[list[str]]) -> list[list[str]]:
        raise RuntimeError("the merged call failed")

    good, bad = worker.lane("good"), worker.lane("bad")
    with worker.hold():
        futures = [good.submit_batchable("g", f"g{i}", batch, merge="m", merge_fn=merged) for i in range(2)]
        futures.append(bad.submit_batchable("b", "bad0", batch, merge="m", merge_fn=merged))
    assert [future.result(timeout=30) for future in futures[:2]] == ["g0!", "g1!"]
    with pytest.raises(ValueError, match="cannot run"):
        futures[2].result(timeout=30)
    worker.shutdown()
    assert ran == [["g0", "g1"], ["bad0"]]


def test_merge_and_its_function_go_together():
    worker = OrderedWorker()
    try:
        with pytest.raises(ValueError, match="go together"):
            worker.submit_batchable("k", 1, lambda items: items, merge="m")
    finally:
        worker.shutdown()


def test_a_lane_submitting_while_another_runs_is_served_next():
    """A long-running call of lane a does not let a's queued calls run before b's, which arrived later."""
    worker, ran = OrderedWorker(), []
    a, b = worker.lane("a"), worker.lane("b")
    started, release = threading.Event(), threading.Event()

    def long_call() -> None:
        started.set()
        release.wait(30)
        ran.append("a-long")

    first = a.submit(long_call)
    assert started.wait(30)
    queued = [a.submit(_record, ran, f"a{i}") for i in range(3)]
    other = b.submit(_record, ran, "b")
    release.set()
    for future in [first, *queued, other]:
        future.result(timeout=30)
    worker.shutdown()
    assert ran == ["a-long", "a0", "b", "a1", "a2"]


def test_cancel_pending_cancels_every_lane():
    worker = OrderedWorker()
    with worker.hold():
        futures = [worker.lane(name).submit(lambda: None) for name in ("a", "b", "a")]
        assert worker.cancel_pending() == 3
    assert all(future.cancelled() for future in (f.future() if hasattr(f, "future") else f for f in futures))
    worker.shutdown()
