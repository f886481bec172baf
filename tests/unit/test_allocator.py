"""rlrunbook.allocator: freed memory kept for the next step, as `rlrunbook train` and `rlrunbook serve` set it."""

from __future__ import annotations

import subprocess
import sys

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


def _retained_mib(mode: str, **env: str) -> tuple[str, int]:
    base = {k: v for k, v in ranks.child_env(**env).items() if not k.startswith("MALLOC_") or k in env}
    done = subprocess.run([sys.executable, "-c", RETAINED, mode], capture_output=True, text=True, env=base,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    *said, retained = done.stdout.split("\n")[:-1]
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
