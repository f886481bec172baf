"""Keep one OpenMP thread pool alive at a time: the backend's worker and its caller take turns.

PyTorch's CPU kernels (and MKL and oneDNN inside them) run their parallel regions on GNU OpenMP
(libgomp). libgomp gives every thread that starts a parallel region its own pool of helper threads
and keeps the pool after the region ends. Once the pools hold more threads than the process has
CPUs, libgomp stops letting idle helpers spin and puts them to sleep after ~100 spins, so every
parallel region then pays futex wake-ups.

The local backend computes on its worker thread (:mod:`rlrunbook.backend.futures`) while the caller
waits. A caller that has run any parallel torch work itself (a training loop computing on its own
tensors, TRL in the peer benchmark) owns a second pool, and from then on the worker's kernels run
throttled, paying context switches in every parallel region (docs/performance.md gives the figures).

:func:`release_openmp_threads` frees the calling thread's pool (OpenMP 5.0
``omp_pause_resource_all(omp_pause_soft)``; the pool is re-created by its next parallel region, at
the cost of starting its threads). The worker calls it for the submitting thread on every submission
and for itself whenever its queue runs empty, so the thread that computes is the only one holding a
pool. Where torch does not use libgomp (another OpenMP runtime, or none) it does nothing.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable

_OMP_PAUSE_SOFT = 1


def _loaded_libgomp() -> str | None:
    """Path of the libgomp this process has loaded (torch's own copy), or None."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rsplit(None, 1)[-1]
                if "/libgomp" in path and ".so" in path:
                    return path
    except OSError:
        return None
    return None


_UNRESOLVED = object()
_pause: object = _UNRESOLVED  # omp_pause_resource_all, None where there is none, or not looked up yet


def _pause_function() -> Callable[[int], int] | None:
    global _pause
    if _pause is _UNRESOLVED:
        if "torch" not in sys.modules:  # no torch kernel has run, so no pool exists; look again next time
            return None
        _pause = None
        path = _loaded_libgomp()
        if path is not None:
            try:
                function = ctypes.CDLL(path).omp_pause_resource_all
            except (OSError, AttributeError):  # an older libgomp, without OpenMP 5.0's pause
                function = None
            if function is not None:
                function.argtypes = [ctypes.c_int]
                function.restype = ctypes.c_int
                _pause = function
    return _pause  # type: ignore[return-value]


def release_openmp_threads() -> bool:
    """Free the calling thread's OpenMP thread pool, if it has one; True if libgomp was asked to."""
    pause = _pause_function()
    return pause is not None and pause(_OMP_PAUSE_SOFT) == 0
