"""``gpu-check.sh --part speed`` end to end at its toy size on CPU (``GPU_CHECK_SPEED_SIZE=tiny``): every step of
scripts/speed_check.py runs through the same code as on the card, writes its JSON, and the section's table is
computed from it (each figure n/a: not the targets' shapes). What a GPU run reports is the same files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


def test_the_speed_part_measures_every_step_at_a_toy_size(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path / "out"), "GPU_CHECK_SPEED_SIZE": "tiny",
           "TMPDIR": str(tmp_path)}
    done = subprocess.run(["bash", "scripts/gpu-check.sh", "--part", "speed"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900, check=False)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    with tarfile.open(tmp_path / "out" / "speed.tar.gz") as archive:
        # the "data" filter where this Python has it (3.11.4 on; Debian 12's 3.11.2 does not)
        safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        archive.extractall(tmp_path / "work", **safe)
    figures = {p.stem.removeprefix("speed-"): json.loads(p.read_text()) for p in (tmp_path / "work").glob("speed-*.json")}
    assert sorted(figures) == sorted(["decode-smollm2", "decode-1.5b", "mfu", "debate", "peer", "clients", "rlvr"])
    assert all(f["size"] == "tiny" and f["device"] == "cpu" for f in figures.values())
    for step in ("decode-smollm2", "decode-1.5b", "mfu", "debate", "clients", "rlvr"):
        assert isinstance(figures[step]["value"], float) and figures[step]["value"] > 0, step
    assert figures["debate"]["steps"] == 2 and figures["mfu"]["tokens"] == 2 * 23
    peer = figures["peer"]
    assert (peer["value"] is None and "trl" in peer["missing"]) or peer["value"] > 0
    section = (tmp_path / "out" / "speed.md").read_text()
    assert "targets met: 0 of 7" in section and section.count("n/a (tiny size, not the target's shape)") == 7
    assert "- h100-rlvr step: training: forward_backward" in section
