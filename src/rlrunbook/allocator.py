"""Process-wide allocator setting for commands that train: keep freed memory for reuse.

glibc serves large blocks (above 128 KiB by default) with ``mmap`` and returns them to the OS when freed, so the
buffers every step allocates anew (activations, per-call kernel scratch, KV caches) are faulted in again page by
page each time. Set once at the start of ``rlrunbook train`` and ``rlrunbook serve`` (as ``scripts/run.sh`` and
``scripts/test.sh`` set ``MALLOC_MMAP_MAX_=0`` and a high ``MALLOC_TRIM_THRESHOLD_``): the mini debate's steps took
23-26 s with it and 32-39 s without on the project's 2-core CPU (docs/performance.md). The cost: resident memory
stays at its peak instead of shrinking between steps.
"""

from __future__ import annotations

import os

_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # glibc's mallopt parameters


def keep_freed_memory() -> str | None:
    """Make glibc keep the memory a step frees for the next step (no ``mmap`` for large blocks, no trimming)
    unless the environment chose (``MALLOC_MMAP_MAX_`` or ``MALLOC_TRIM_THRESHOLD_`` set). What was set, in words,
    or None (not glibc, or already chosen)."""
    import ctypes

    if os.environ.get("MALLOC_MMAP_MAX_") or os.environ.get("MALLOC_TRIM_THRESHOLD_"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        done = libc.mallopt(_M_MMAP_MAX, 0) == 1 and libc.mallopt(_M_TRIM_THRESHOLD, -1) == 1  # -1: never trim
    except (OSError, AttributeError):
        return None
    return "freed memory kept for reuse (glibc: no mmap for large blocks, no trimming)" if done else None
