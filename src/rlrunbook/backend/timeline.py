"""What each worker of a local backend ran, and when: one JSON line per call (``TINKER_LOCAL_TIMELINE``).

A line is ``{"worker": "rlrunbook-local" | "rlrunbook-sampler", "call": "LocalSamplingClient._sample_batch",
"start": s, "end": s, "items": n}``, with times in seconds on the process's monotonic clock
(``time.perf_counter``), written when the call ends. It shows whether sampling overlapped training
(``scripts/async_timeline.py`` draws it); nothing in the backend reads it back.
"""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

from rlrunbook.errors import ConfigError


def call_name(fn: object) -> str:
    """``Trainer.optim_step`` for a method, the enclosing method for a closure defined in one."""
    name = getattr(fn, "__qualname__", None) or type(fn).__name__
    return name.split(".<locals>")[0]


class JsonLines:
    """Appends JSON lines to ``path`` (created with its folder), from any thread: a record the backend keeps
    for the user, set by the environment variable ``variable``.

    A path that cannot be written is refused when the file is opened (``ConfigError`` naming the variable);
    a write that fails later (a full disk) turns the record off with one warning: a record must never stop
    the worker that computes.
    """

    def __init__(self, path: Path, variable: str):
        self.path = Path(path)
        self.variable = variable
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("a", encoding="utf-8"):
                pass
        except OSError as error:
            raise ConfigError(f"{variable}={str(path)!r} cannot be written ({error.strerror or error}). "
                              "Name a file in a writable folder, or unset it.") from None
        self._lock = threading.Lock()
        self._failed = False

    def append(self, *records: dict) -> None:
        text = "".join(json.dumps(record) + "\n" for record in records)
        with self._lock:
            if self._failed:
                return
            try:
                with self.path.open("a", encoding="utf-8") as out:
                    out.write(text)
            except OSError as error:
                self._failed = True
                print(f"warning: {self.variable} {self.path}: {error.strerror or error}; nothing more is "
                      "recorded", file=sys.stderr, flush=True)


class Timeline:
    """The calls of a backend's workers, appended to ``path`` (``TINKER_LOCAL_TIMELINE``)."""

    def __init__(self, path: Path):
        self._file = JsonLines(path, "TINKER_LOCAL_TIMELINE")
        self.path = self._file.path

    def record(self, worker: str, call: str, start: float, end: float, items: int = 1) -> None:
        self._file.append({"worker": worker, "call": call, "start": round(start, 6), "end": round(end, 6),
                           "items": items})


def read_timeline(path: Path) -> list[dict]:
    """The records of a timeline file, in the order they were written."""
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]


def overlap_seconds(records: list[dict], first: str, second: str) -> float:
    """Seconds during which a call of worker ``first`` and one of worker ``second`` both ran."""
    a = [(r["start"], r["end"]) for r in records if r["worker"] == first]
    b = [(r["start"], r["end"]) for r in records if r["worker"] == second]
    return sum(max(0.0, min(e1, e2) - max(s1, s2)) for s1, e1 in a for s2, e2 in b)
