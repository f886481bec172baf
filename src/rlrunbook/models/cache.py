"""Where built models live, and how a folder gets there without ever being seen half-written.

A cached folder is complete by construction: it is built under a temporary name in the same
parent folder and renamed into place in one step (``rename`` within one file system is atomic
on POSIX). A build that crashes leaves only a hidden ``.<name>.tmp-*`` folder, which no lookup
mistakes for a model; two processes building at once both succeed and the first rename wins.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

CACHE_ENV_VAR = "RLRUNBOOK_CACHE_DIR"


def default_cache_dir() -> Path:
    """Return the cache root: ``$RLRUNBOOK_CACHE_DIR`` if set and non-empty, else ``~/.cache/rlrunbook``."""
    override = os.environ.get(CACHE_ENV_VAR)
    if override:
        return Path(override).expanduser()
    return Path.home() / ".cache" / "rlrunbook"


def build_atomically(target: Path, build: Callable[[Path], object]) -> Path:
    """Return ``target``, first calling ``build(tmp_dir)`` and renaming ``tmp_dir`` to it if it is absent.

    ``build`` writes the whole folder into the empty directory it is given. If it raises, the
    temporary directory is removed and the error propagates; ``target`` is never created.
    If another process renamed its own build into place first, ours is discarded and theirs kept
    (both came from the same deterministic builder).
    """
    target = Path(target)
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Same parent folder, so the final rename never crosses a file system boundary.
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        build(tmp_dir)
        # mkdtemp makes the folder private (0700); a model cache is meant to be readable like ~/.cache files.
        tmp_dir.chmod(0o755)
        try:
            os.rename(tmp_dir, target)
        except OSError:
            # rename(2) refuses to replace a non-empty directory: a concurrent build won the race.
            if not target.is_dir():
                raise
    finally:
        if tmp_dir.exists():
            shutil.rmtree(tmp_dir, ignore_errors=True)
    return target
