"""Process-wide allocator settings for commands that train: keep freed memory for reuse, and let it be reused.

glibc serves large blocks (above 128 KiB by default) with ``mmap`` and returns them to the OS when freed, so the
buffers every step allocates anew (activations, per-call kernel scratch, KV caches) are faulted in again page by
page each time. Set once at the start of ``rlrunbook train`` and ``rlrunbook serve`` (as ``scripts/run.sh`` and
``scripts/test.sh`` set ``MALLOC_MMAP_MAX_=0`` and a high ``MALLOC_TRIM_THRESHOLD_``): the mini debate's steps took
23-26 s with it and 32-39 s without on the project's 2-core CPU (docs/performance.md). The cost: resident memory
stays at its peak instead of shrinking between steps.

Kept is not yet reused: PyTorch asks glibc for 64-byte aligned blocks, for which glibc takes a free block only if it
is 96 bytes larger than the request, so a freed tensor's block fits no later tensor of its size unless a free
neighbour joined it, and the heap grows onto untouched pages instead. PyTorch's ``THP_MEM_ALLOC_ENABLE`` aligns blocks
of 2 MiB and more to the page (their free leading gaps join them when freed) and advises them as huge pages; where
freed memory is kept, :func:`keep_freed_memory` sets it too. Whether a given block fits again still depends on what
was allocated beside it, but a warm step of the mini debate took 25-335 page faults with it where it took 21,000-
131,000 without (docs/performance.md).

Nor is it kept in a thread's own heaps: glibc gives a thread other than the main one an arena of its own, made of
64 MiB heaps, and unmaps such a heap once it is wholly free unless the free space it would leave at the top of the
heap before it is less than the top pad (128 KiB by default), whatever the trim threshold. The service samples and
trains on its worker thread, so between steps of the mini debate 320-350 MB went back to the OS and were faulted in
again. Where freed memory is kept, :func:`keep_freed_memory` sets a top pad larger than a heap
(:data:`TOP_PAD_BYTES`), so no heap is unmapped (its cost: the main heap grows by that much address space, not
memory, at a time).
"""

from __future__ import annotations

import os

_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_MAX = -1, -2, -4  # glibc's mallopt parameters
TOP_PAD_BYTES = 128 << 20  # more than a thread heap's 64 MiB: glibc then unmaps none
KEEPING_COMMANDS = ("train", "serve")  # the console script's commands that keep freed memory
HUGE_PAGE_BLOCKS = "THP_MEM_ALLOC_ENABLE"  # read by PyTorch once, at its first CPU allocation


def keep_freed_memory() -> str | None:
    """Make glibc keep the memory a step frees for the next step (no ``mmap`` for large blocks, no trimming)
    unless the environment chose (``MALLOC_MMAP_MAX_`` or ``MALLOC_TRIM_THRESHOLD_`` set), and where glibc keeps
    it (set here, or ``MALLOC_MMAP_MAX_=0``), threads' heaps kept too unless the environment chose
    ``MALLOC_TOP_PAD_``, and large tensors page-aligned so that it is reused (see the module docstring) unless the
    environment chose ``THP_MEM_ALLOC_ENABLE``. What was set, in words, or None (nothing)."""
    said = []
    if not (os.environ.get("MALLOC_MMAP_MAX_") or os.environ.get("MALLOC_TRIM_THRESHOLD_")) and _mallopt_keep():
        said.append("freed memory kept for reuse (glibc: no mmap for large blocks, no trimming)")
    kept = bool(said) or os.environ.get("MALLOC_MMAP_MAX_", "").strip() == "0"
    if kept and "MALLOC_TOP_PAD_" not in os.environ and _mallopt(_M_TOP_PAD, TOP_PAD_BYTES):
        said.append("threads' heaps kept too (glibc: a top pad larger than a heap)")
    if kept and HUGE_PAGE_BLOCKS not in os.environ:
        said.append("large tensors page-aligned as huge pages, so freed blocks fit later ones" if _page_aligned() else
                    f"not {HUGE_PAGE_BLOCKS}=1: PyTorch had allocated already (set it before the command)")
    return "; ".join(said) or None


def prepare(argv: list[str]) -> None:
    """Before the console script imports its modules: :func:`keep_freed_memory` for a command that keeps freed
    memory (not for its ``--help``). Its own later call then finds everything set; set only there, PyTorch's
    setting can come too late (importing peft allocates a tensor)."""
    if argv[:1] and argv[0] in KEEPING_COMMANDS and not {"-h", "--help"} & set(argv):
        keep_freed_memory()


def _mallopt_keep() -> bool:
    return _mallopt(_M_MMAP_MAX, 0) and _mallopt(_M_TRIM_THRESHOLD, -1)  # -1: never trim


def _mallopt(parameter: int, value: int) -> bool:
    """glibc's ``mallopt(parameter, value)``; whether it was applied (False off glibc)."""
    import ctypes

    try:
        return ctypes.CDLL("libc.so.6").mallopt(parameter, value) == 1
    except (OSError, AttributeError):
        return False


def _page_aligned() -> bool:
    """Set ``THP_MEM_ALLOC_ENABLE=1`` for this process's PyTorch, which reads it at its first CPU allocation, and say
    whether its large blocks are page-aligned now. The variable is removed again, so that child processes, which do
    not keep freed memory unless they set it themselves, allocate as PyTorch does by default."""
    os.environ[HUGE_PAGE_BLOCKS] = "1"
    try:
        import torch

        page = os.sysconf("SC_PAGE_SIZE")
        blocks = [torch.empty(1 << 19) for _ in range(2)]  # 2 MiB each, never touched
        return all(block.data_ptr() % page == 0 for block in blocks)
    finally:
        del os.environ[HUGE_PAGE_BLOCKS]
