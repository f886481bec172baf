"""The backend's worker keeps OpenMP's spin-waiting after the caller ran parallel torch work itself.

Measured through voluntary context switches: a helper thread that spins between parallel regions
switches no context; one that libgomp puts to sleep (more pool threads than CPUs) switches at
almost every region. See rlrunbook/backend/openmp.py.
"""

from __future__ import annotations

import os
import resource

import pytest
import torch

from rlrunbook.backend import futures, openmp
from rlrunbook.backend.futures import OrderedWorker

REGIONS = 300

pytestmark = pytest.mark.skipif(
    torch.get_num_threads() < 2 or openmp._pause_function() is None,
    reason="needs torch on GNU OpenMP (libgomp with omp_pause_resource_all) and 2+ intra-op threads")


def _switches() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw


def _parallel_regions() -> int:
    """Voluntary context switches of the process across REGIONS parallel torch ops (each above the grain size)."""
    x = torch.ones(1 << 20)
    before = _switches()
    for _ in range(REGIONS):
        x.add_(1.0)
    return _switches() - before


def _worker_switches_after_caller_work(worker: OrderedWorker) -> int:
    worker.run(_parallel_regions)  # the worker has had a pool
    torch.ones(1 << 20).add_(1.0)  # now this (the caller's) thread has one too
    return min(worker.run(_parallel_regions) for _ in range(3))


def test_the_worker_keeps_spinning_after_the_caller_ran_parallel_work():
    worker = OrderedWorker()
    try:
        assert _worker_switches_after_caller_work(worker) < REGIONS // 10
    finally:
        worker.shutdown()


@pytest.mark.skipif(2 * (torch.get_num_threads() - 1) + 1 <= len(os.sched_getaffinity(0)),
                    reason="two pools fit this machine's CPUs: libgomp does not throttle here")
def test_without_releasing_pools_the_worker_is_throttled(monkeypatch):
    # The control: what the test above guards against happens on this machine when pools are kept
    # (libgomp throttles once its pools' threads outnumber the CPUs).
    monkeypatch.setattr(futures, "release_openmp_threads", lambda: False)
    worker = OrderedWorker()
    try:
        assert _worker_switches_after_caller_work(worker) > REGIONS // 2
    finally:
        worker.shutdown()


def test_release_is_a_no_op_without_libgomp(monkeypatch):
    monkeypatch.setattr(openmp, "_pause", None)
    assert openmp.release_openmp_threads() is False
