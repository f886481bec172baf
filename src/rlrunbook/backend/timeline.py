"""What each worker of a local backend ran, and when: one JSON line per call (``TINKER_LOCAL_TIMELINE``).

A line is ``{"worker": "rlrunbook-local" | "rlrunbook-sampler", "call": "LocalSamplingClient._sample_batch",
"start": s, "end": s, "items": n}``, with times in seconds on the process's monotonic clock
(``time.perf_counter``), written when the call ends. It shows whether sampling overlapped training
(``scripts/async_timeline.py`` draws it); nothing in the backend reads it back.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path


def call_name(fn: object) -> str:
    """``LoraTrainer.optim_step`` for a method, the enclosing method for a closure defined in one."""
    name = getattr(fn, "__qualname__", None) or type(fn).__name__
    return name.split(".<locals>")[0]


class Timeline:
    """Appends call records to ``path`` (created with its folder), from any thread."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()

    def record(self, worker: str, call: str, start: float, end: float, items: int = 1) -> None:
        line = json.dumps({"worker": worker, "call": call, "start": round(start, 6), "end": round(end, 6),
                           "items": items})
        with self._lock, self.path.open("a", encoding="utf-8") as out:
            out.write(line + "\n")


def read_timeline(path: Path) -> list[dict]:
    """The records of a timeline file, in the order they were written."""
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]


def overlap_seconds(records: list[dict], first: str, second: str) -> float:
    """Seconds during which a call of worker ``first`` and one of worker ``second`` both ran."""
    a = [(r["start"], r["end"]) for r in records if r["worker"] == first]
    b = [(r["start"], r["end"]) for r in records if r["worker"] == second]
    return sum(max(0.0, min(e1, e2) - max(s1, s2)) for s1, e1 in a for s2, e2 in b)
