"""What ``test_hostile_http.py`` watches besides the answers: the files beside the server's storage.

:func:`plant_canary` lays a valid-looking run beside the storage (and where ``..`` from the storage leads) and
links inside the storage that lead to it; :class:`OutsideWatch` records, through a Python audit hook, every file
opened, listed, created, renamed or removed by any thread of this process whose real path lies under the
storage's parent folder but outside the storage; :func:`files_outside` fingerprints every file there, so a test
can assert that nothing was read, written or changed outside the storage. (Reads by native code, such as the
safetensors loader, raise no audit event: the canary's run record and adapter config are read by Python first.)
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import threading
from pathlib import Path

CANARY_SECRET = "canary-7f3a-never-served"  # in the canary's run record: no answer may carry it
# Audit events whose path arguments are files touched (read, listed, written, moved, removed).
WATCHED_EVENTS = frozenset({
    "open", "os.listdir", "os.scandir", "os.mkdir", "os.remove", "os.rmdir", "os.rename", "os.replace",
    "os.truncate", "os.chmod", "os.chown", "os.utime", "os.symlink", "os.link", "shutil.rmtree",
    "shutil.copytree", "shutil.copyfile", "shutil.move", "shutil.chown", "os.walk", "glob.glob",
})


def _paths(args: tuple) -> list[str]:
    found = []
    for arg in args:
        if isinstance(arg, (str, bytes, os.PathLike)):
            try:
                found.append(os.fsdecode(arg))
            except (TypeError, ValueError):
                continue
    return found


class OutsideWatch:
    """Records the audit events that touch ``root`` outside ``storage`` (real paths, links followed) while on.

    An audit hook cannot be removed: :meth:`stop` turns this one into a no-op."""

    def __init__(self, root: Path, storage: Path):
        self.root = os.path.realpath(root)
        self.storage = os.path.realpath(storage)
        self.events: list[tuple[str, str]] = []
        self.on = False
        self._busy = threading.local()
        sys.addaudithook(self._hook)

    def _outside(self, path: str) -> bool:
        real = os.path.realpath(path)
        inside = lambda folder: real == folder or real.startswith(folder + os.sep)
        return inside(self.root) and not inside(self.storage)

    def _hook(self, event: str, args: tuple) -> None:
        if not self.on or event not in WATCHED_EVENTS or getattr(self._busy, "flag", False):
            return
        self._busy.flag = True
        try:
            for path in _paths(args):
                if self._outside(path):
                    self.events.append((event, path))
        finally:
            self._busy.flag = False

    def take(self) -> list[tuple[str, str]]:
        """The events recorded since the last call (then forgotten)."""
        taken, self.events = self.events, []
        return taken

    def stop(self) -> None:
        self.on = False


def files_outside(root: Path, storage: Path) -> dict[str, tuple]:
    """Every entry under ``root`` but not under ``storage``: its kind, and for a file its size and digest."""
    found: dict[str, tuple] = {}
    for folder, dirs, files in os.walk(root, followlinks=False):
        here = Path(folder)
        if here == storage or storage in here.parents:
            dirs[:] = []
            continue
        dirs[:] = [d for d in dirs if here / d != storage]
        for name in dirs + files:
            path = here / name
            rel = str(path.relative_to(root))
            if path.is_symlink():
                found[rel] = ("link", os.readlink(path))
            elif path.is_dir():
                found[rel] = ("dir",)
            else:
                data = path.read_bytes()
                found[rel] = ("file", len(data), path.stat().st_mtime_ns, hashlib.sha256(data).hexdigest())
    return found


def plant_canary(root: Path, storage: Path, checkpoint: Path, run_id: str) -> Path:
    """A valid-looking run beside the storage (``<root>/canary-run``: run record, a training and a sampler
    checkpoint, byte copies of ``checkpoint``), the same as ``<root>`` itself (where a run id ``..`` leads), and
    links inside the storage that lead to it: ``<storage>/linked`` (a run), ``<storage>/linkrecord`` (a real
    folder whose run record is a link), ``<storage>/op-run`` (an operator's run whose ``sampler_weights`` is a
    link), ``<storage>/<run_id>/weights/escape`` (a checkpoint), ``<storage>/<run_id>/weights/linkfiles`` (a real
    folder whose files are links out); and a hidden copy ``<storage>/<run_id>/weights/.hidden`` (a save in
    progress: never listed or loaded). Returns the canary run's folder."""
    canary = root / "canary-run"
    record = json.loads((storage / run_id / "training_run.json").read_text())
    for run, name in ((canary, "canary-run"), (root, "..")):
        for kind in ("weights", "sampler_weights"):
            shutil.copytree(checkpoint, run / kind / "first", dirs_exist_ok=True)
            (run / kind / "first" / "rlrunbook_checkpoint.json").write_text(json.dumps({"expires_at": None}))
        (run / "training_run.json").write_text(json.dumps(
            {**record, "model_id": name, "user_metadata": {"canary": CANARY_SECRET}}))
    (storage / "linked").symlink_to(canary, target_is_directory=True)
    (storage / "linkrecord" / "weights").mkdir(parents=True)
    (storage / "linkrecord" / "training_run.json").symlink_to(canary / "training_run.json")
    (storage / "op-run").mkdir()
    (storage / "op-run" / "training_run.json").write_text(json.dumps(
        {**record, "model_id": "op-run", "session_id": "", "user_metadata": {}}))
    (storage / "op-run" / "sampler_weights").symlink_to(canary / "sampler_weights", target_is_directory=True)
    weights = storage / run_id / "weights"
    (weights / "escape").symlink_to(canary / "weights" / "first", target_is_directory=True)
    (weights / "linkfiles").mkdir()
    for file in (canary / "weights" / "first").iterdir():
        (weights / "linkfiles" / file.name).symlink_to(file)
    shutil.copytree(checkpoint, weights / ".hidden")
    return canary
