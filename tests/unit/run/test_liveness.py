"""Telling a live run from a dead one: the process record, the heartbeat thread, the ``stale`` verdict."""

from __future__ import annotations

import json
import os
import socket
import time
from datetime import datetime, timedelta, timezone

import pytest

from rlrunbook.run import RunWriter
from rlrunbook.run import writer as writer_module
from rlrunbook.run.liveness import STALE_AFTER_S, liveness, process_record

NOW = datetime(2026, 11, 23, 12, 0, 0, tzinfo=timezone.utc)


def _meta(process: dict, beat: datetime, status: str = "running") -> dict:
    return {"status": status, "process": process, "heartbeat_at": beat.isoformat(timespec="seconds")}


def test_this_process_is_alive_and_a_dead_pid_is_stale():
    me = process_record()
    assert me["pid"] == os.getpid() and me["host"] == socket.gethostname()
    assert liveness(_meta(me, NOW), NOW) == ("running", None)
    # a pid reused by another process: same number, other start time
    reused = {**me, "start_ticks": (me["start_ticks"] or 0) + 1}
    status, why = liveness(_meta(reused, NOW), NOW)
    assert status == "stale" and f"process {me['pid']}" in why and "no longer exists" in why


def test_a_reboot_makes_every_run_of_before_stale():
    status, why = liveness(_meta({**process_record(), "boot_id": "another-boot"}, NOW), NOW)
    assert status == "stale" and "rebooted" in why


def test_on_another_host_the_heartbeat_decides():
    other = {"pid": 4242, "host": "elsewhere.example", "boot_id": "b", "start_ticks": 1}
    young = NOW - timedelta(seconds=STALE_AFTER_S - 1)
    old = NOW - timedelta(seconds=STALE_AFTER_S + 1)
    assert liveness(_meta(other, young), NOW) == ("running", None)
    status, why = liveness(_meta(other, old), NOW)
    assert status == "stale" and "no heartbeat for 601 s" in why and "elsewhere.example" in why


def test_final_statuses_and_old_records_are_left_alone():
    assert liveness(_meta(process_record(), NOW, "completed"), NOW) == ("completed", None)
    assert liveness(_meta(process_record(), NOW, "interrupted"), NOW) == ("interrupted", None)
    assert liveness({"status": "running"}, NOW) == ("running", None)  # written before process records existed


def test_the_heartbeat_beats_until_finish(tmp_path, monkeypatch):
    monkeypatch.setattr(writer_module, "HEARTBEAT_S", 0.05)
    stamps = iter(f"2026-11-23T12:00:{s:02d}+00:00" for s in range(60))
    monkeypatch.setattr(writer_module, "_utc_now", lambda: next(stamps))
    writer = RunWriter(tmp_path, environ={})
    writer.write_metadata({"mode": "single_turn"}, {}, [], {})
    path = tmp_path / "run_metadata.json"
    first = json.loads(path.read_text())["heartbeat_at"]
    deadline = time.monotonic() + 10
    while json.loads(path.read_text())["heartbeat_at"] == first and time.monotonic() < deadline:
        time.sleep(0.02)
    assert json.loads(path.read_text())["heartbeat_at"] > first  # it beat
    writer.finish("completed")
    final = json.loads(path.read_text())
    time.sleep(0.2)  # four beats' time: none may land after the final status
    assert json.loads(path.read_text()) == final and final["status"] == "completed"
    assert final["heartbeat_at"] == final["finished_at"]


@pytest.mark.parametrize("status", ["completed", "failed", "interrupted"])
def test_finish_accepts_the_final_statuses(tmp_path, status):
    writer = RunWriter(tmp_path, environ={})
    writer.write_metadata({"mode": "single_turn"}, {}, [], {})
    writer.finish(status)
    assert json.loads((tmp_path / "run_metadata.json").read_text())["status"] == status
