"""``scripts/soak_serve.py`` in short: 4 SDK clients for 75 s against ``rlrunbook serve`` on ``tiny``. The server's
RSS and storage must be flat after the warm-up (what the full 16-client, 10-minute soak of docs/serve.md checks),
every client life must succeed, and the verdict must catch a server whose memory does grow."""

from __future__ import annotations

import importlib.util
import io
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "soak_serve.py"


def _soak_module():
    if "soak_serve" not in sys.modules:
        spec = importlib.util.spec_from_file_location("soak_serve", SCRIPT)
        module = importlib.util.module_from_spec(spec)
        sys.modules["soak_serve"] = module  # its dataclasses look their module up
        spec.loader.exec_module(module)
    return sys.modules["soak_serve"]


def test_four_clients_for_75_seconds_leave_rss_and_storage_flat(tmp_path, monkeypatch):
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    soak_serve = _soak_module()
    table = io.StringIO()
    soak = soak_serve.run_soak(clients=4, minutes=1.25, model="tiny", every_s=3.0, storage=tmp_path / "storage",
                               out=table)
    assert not soak.errors, soak.errors
    last = soak.samples[-1]
    assert last.lives >= 8, table.getvalue()  # the clients did live and close, many times
    ok, lines = soak_serve.verdict(soak, warmup_s=30.0, rss_tolerance=0.10, storage_tolerance_mib=4.0)
    assert ok, "\n".join([table.getvalue(), *lines])


def test_the_verdict_catches_growth():
    soak_serve = _soak_module()
    flat = soak_serve.Soak(4, 1.0, "tiny", [soak_serve.Sample(t, 500 * 2**20 + (t % 2) * 2**20, 2**20, 0, 0)
                                            for t in range(0, 90, 3)])
    assert soak_serve.verdict(flat, 30.0, 0.10, 4.0)[0]
    growing = soak_serve.Soak(4, 1.0, "tiny", [soak_serve.Sample(t, (500 + 2 * t) * 2**20, 2**20, 0, 0)
                                               for t in range(0, 90, 3)])
    assert not soak_serve.verdict(growing, 30.0, 0.10, 4.0)[0]
    filling = soak_serve.Soak(4, 1.0, "tiny", [soak_serve.Sample(t, 500 * 2**20, t * 2**18, 0, 0)
                                               for t in range(0, 90, 3)])
    assert not soak_serve.verdict(filling, 30.0, 0.10, 4.0)[0]
