"""Is a run that says "running" still running? The process record, the heartbeat and the verdict.

A run killed without warning (``kill -9``, the OOM killer, a lost machine) never writes its final status,
so its ``run_metadata.json`` says ``"running"`` forever. To tell such a run from a live one, the writer
records the process (``pid``, ``host``, the kernel's ``boot_id`` and the process start time) and a
``heartbeat_at`` it refreshes every ``HEARTBEAT_S`` seconds from a background thread. A reader then
judges (:func:`liveness`):

- on the same host and boot: the run is alive exactly when a process with that pid and that start time
  exists (the start time tells a reused pid apart);
- elsewhere (a shared file system seen from another machine): the run is alive while its heartbeat is
  younger than ``STALE_AFTER_S``.

A run that is not alive is ``stale``: ``summarize`` shows that status and ``check-run`` says why.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from datetime import datetime, timezone
from typing import Any

HEARTBEAT_S = 30.0
STALE_AFTER_S = 600.0  # 20 missed heartbeats: a busy machine may delay one, not twenty


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="ascii") as handle:
            return handle.read().strip()
    except OSError:
        return None


def _boot_id() -> str | None:
    return _read("/proc/sys/kernel/random/boot_id")


def _start_ticks(pid: int) -> int | None:
    """The process start time in clock ticks after boot (field 22 of /proc/<pid>/stat), None if gone."""
    stat = _read(f"/proc/{pid}/stat")
    if stat is None:
        return None
    fields = stat.rsplit(")", 1)[-1].split()  # the command name may hold spaces; it ends at the last ')'
    if fields and fields[0] == "Z":
        return None  # a zombie has exited
    return int(fields[19]) if len(fields) > 19 else None


def process_record() -> dict[str, Any]:
    """This process, as ``run_metadata.json`` records it under ``process``."""
    pid = os.getpid()
    return {"pid": pid, "host": socket.gethostname(), "boot_id": _boot_id(), "start_ticks": _start_ticks(pid)}


def utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _age_s(stamp: Any, now: datetime) -> float | None:
    try:
        return (now - datetime.fromisoformat(str(stamp))).total_seconds()
    except (TypeError, ValueError):
        return None


def liveness(metadata: Mapping[str, Any], now: datetime | None = None) -> tuple[str, str | None]:
    """``(status, why)``: the recorded status, or ``"stale"`` with the reason for a "running" run that is gone.

    Runs recorded before the process record existed stay "running" (nothing to judge them by).
    """
    status = metadata.get("status")
    process = metadata.get("process")
    if status != "running" or not isinstance(process, Mapping):
        return status, None
    now = now or datetime.now(timezone.utc)
    pid, host = process.get("pid"), process.get("host")
    beat = metadata.get("heartbeat_at") or metadata.get("started_at")
    age = _age_s(beat, now)
    last = f"last heartbeat {beat}" + (f", {age:.0f} s ago" if age is not None else "")
    if host == socket.gethostname() and process.get("boot_id") not in (None, _boot_id()):
        return "stale", f"{host} has rebooted since its process {pid} started; {last}"
    if host == socket.gethostname() and process.get("boot_id") == _boot_id() and isinstance(pid, int):
        ticks = _start_ticks(pid)
        if ticks is not None and ticks == process.get("start_ticks"):
            return "running", None
        return "stale", (f"its process {pid} on {host} no longer exists (killed, e.g. kill -9 or the OOM "
                         f"killer, or crashed); {last}")
    if age is not None and age > STALE_AFTER_S:
        return "stale", (f"no heartbeat for {age:.0f} s (it beats every {HEARTBEAT_S:.0f} s) from process {pid} "
                         f"on {host}; {last}")
    return "running", None
