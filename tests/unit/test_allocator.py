"""rlrunbook.allocator: freed memory kept for the next step, as `rlrunbook train` and `rlrunbook serve` set it."""

from __future__ import annotations

import subprocess
import sys

from rlrunbook.allocator import TOP_PAD_BYTES
from rlrunbook.testing import ranks

RETAINED = """
import ctypes, os, sys
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
if sys.argv[1] == "keep":
    from rlrunbook.allocator import keep_freed_memory
    print(keep_freed_memory())
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
before = rss()
block = libc.malloc(256 << 20)
ctypes.memset(block, 1, 256 << 20)
libc.free(ctypes.c_void_p(block))
print((rss() - before) >> 20)
"""


def _child(script: str, *argv: str, **env: str) -> list[str]:
    """The lines ``script`` prints in a child process whose allocator settings are only those of ``env``."""
    base = {k: v for k, v in ranks.child_env(**env).items()
            if not (k.startswith("MALLOC_") or k == "THP_MEM_ALLOC_ENABLE") or k in env}
    done = subprocess.run([sys.executable, "-c", script, *argv], capture_output=True, text=True, env=base,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.splitlines()


def _retained_mib(mode: str, **env: str) -> tuple[str, int]:
    *said, retained = _child(RETAINED, mode, **env)
    return (said[0] if said else ""), int(retained)


def test_a_freed_block_stays_for_reuse_only_when_set():
    said, kept = _retained_mib("keep")
    assert said.startswith("freed memory kept for reuse") and kept >= 250, (said, kept)
    assert _retained_mib("plain")[1] <= 8  # glibc's default: a block this large is mapped and unmapped


def test_the_environments_choice_is_left_alone():
    said, kept = _retained_mib("keep", MALLOC_MMAP_MAX_="65536")
    assert said == "None" and kept <= 8


def test_train_sets_it_before_the_run(monkeypatch, tmp_path):
    from rlrunbook import cli
    from rlrunbook.cli import train

    calls = []
    monkeypatch.setattr(train, "keep_freed_memory", lambda: calls.append(1))
    code = cli.main(["train", "--model", "tiny", "--resume-from", str(tmp_path / "missing"), "-s", "1"])
    assert code == 2 and calls == [1]


PADDED = """
import ctypes, sys
if sys.argv[1] == "keep":
    from rlrunbook.allocator import keep_freed_memory
    print(keep_freed_memory())
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
size = 256 << 20  # more than the heap has free: placed at its top, the heap grows
block = libc.malloc(size)
end = max(int(line.split()[0].split("-")[1], 16) for line in open("/proc/self/maps") if line.rstrip().endswith("[heap]"))
print((end - block - size) >> 20)  # the room glibc left above it: the top pad
"""


def test_kept_memory_keeps_a_threads_heaps_with_a_top_pad_larger_than_a_heap():
    """glibc unmaps a wholly free heap of a thread's arena unless the top pad exceeds what that would leave free in
    the heap before it (at most a heap, 64 MiB): kept memory sets a pad of 128 MiB, which the main heap shows as the
    room it leaves above a block that made it grow; the environment's own pad is left alone."""
    kept = _child(PADDED, "keep", MALLOC_MMAP_MAX_="0", MALLOC_TRIM_THRESHOLD_="100000000000")
    assert kept[0].startswith("threads' heaps kept too") and int(kept[1]) == TOP_PAD_BYTES >> 20 > 64
    assert _child(PADDED, "plain", MALLOC_MMAP_MAX_="0")[-1] == "0"  # glibc's 128 KiB
    chosen = _child(PADDED, "keep", MALLOC_MMAP_MAX_="0", MALLOC_TOP_PAD_="0")
    assert "threads' heaps" not in chosen[0] and chosen[1] == "0"
    assert _child(PADDED, "keep", MALLOC_MMAP_MAX_="65536")[0] == "None"  # nothing kept: nothing padded


ALIGNED = """
import os
import torch
from rlrunbook.allocator import keep_freed_memory
print(keep_freed_memory())
def advised(address):  # the mapping holding address is advised as huge pages (VmFlags "hg")
    found = False
    for line in open("/proc/self/smaps"):
        if "-" in line.split()[0] and not line.startswith("VmFlags"):
            low, high = (int(x, 16) for x in line.split()[0].split("-"))
            found = low <= address < high
        elif found and line.startswith("VmFlags"):
            return " hg" in line
    return False
blocks = [torch.ones(512, 4096 + 7 * i) for i in range(3)]  # 8 MiB and a little more each
print(all(b.data_ptr() % os.sysconf("SC_PAGE_SIZE") == 0 and advised(b.data_ptr()) for b in blocks))
"""


def _aligned(**env: str) -> tuple[str, bool]:
    said, aligned = _child(ALIGNED, **env)
    return said, aligned == "True"


def test_kept_memory_gets_page_aligned_huge_page_blocks():
    said, aligned = _aligned()
    assert "page-aligned" in said and aligned, said
    assert _aligned(MALLOC_MMAP_MAX_="0", MALLOC_TRIM_THRESHOLD_="100000000000") == (
        ("threads' heaps kept too (glibc: a top pad larger than a heap); "
         "large tensors page-aligned as huge pages, so freed blocks fit later ones"), True)  # as scripts/run.sh sets


def test_page_alignment_is_left_to_the_environment_or_to_mapped_blocks():
    said, aligned = _aligned(THP_MEM_ALLOC_ENABLE="0")  # PyTorch's own 64-byte alignment, chosen
    assert "page-aligned" not in said and not aligned
    assert _aligned(MALLOC_MMAP_MAX_="65536") == ("None", False)  # glibc maps large blocks: nothing kept to reuse


PREPARED = """
import sys
from rlrunbook import allocator
allocator.prepare(sys.argv[1:])
import peft  # allocates a CPU tensor as it loads: PyTorch has read its setting by then
import torch
blocks = [torch.empty(1 << 19) for _ in range(3)]
print(all(block.data_ptr() % 4096 == 0 for block in blocks))
"""


def _prepared(*argv: str) -> bool:
    return _child(PREPARED, *argv) == ["True"]


def test_the_console_script_sets_a_training_commands_allocator_before_its_modules_load(monkeypatch):
    assert _prepared("train", "--model", "tiny") and _prepared("serve")
    assert not _prepared("show-config") and not _prepared("train", "--help")
    from rlrunbook import allocator
    from rlrunbook.cli import launch

    seen = []
    monkeypatch.setattr(allocator, "prepare", seen.append)
    monkeypatch.setattr(sys, "argv", ["rlrunbook", "check-run", "/nonexistent/run"])
    launch.launch()
    assert seen == [["check-run", "/nonexistent/run"]]
