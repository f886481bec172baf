"""Ctrl-C or SIGTERM in a run: the run directory marked ``interrupted`` and the backend stopped cleanly."""

from __future__ import annotations

from pathlib import Path

from rlrunbook import distributed
from rlrunbook.errors import RunInterrupted
from rlrunbook.run import RunWriter


def interrupted(run_dir: Path, writer: RunWriter, service, interrupt: KeyboardInterrupt, log) -> RunInterrupted:
    """Ctrl-C (or SIGTERM) in a run: mark it ``interrupted`` at once, then stop the backend's worker thread
    (queued calls cancelled, the running one finished) so the process can exit without the C++ runtime
    aborting under a thread still inside torch. Checkpoints are written atomically, so the last complete
    one is intact whatever the interrupt cut short. A second Ctrl-C stops waiting for the running call."""
    from rlrunbook.run.checkpoint_format import checkpoint_dirs

    name = getattr(interrupt, "signal_name", "SIGINT")
    found = checkpoint_dirs(run_dir) if distributed.is_main() else []
    last = found[-1][1] if found else None
    writer.finish("interrupted", error=f"{name}: stopped by the user; last checkpoint: {last or 'none'}")
    stopped = True
    stop_now = getattr(service, "stop_now", None)
    if callable(stop_now):
        log("[interrupt] stopping: waiting for the backend's running call to end (Ctrl-C again to exit at once)")
        try:
            stopped = stop_now()
        except KeyboardInterrupt:
            stopped = False
    return RunInterrupted(run_dir, last, stopped, name)
