"""The main job in a lone clone: no ``../shared`` beside the repository and no route to the hub.

The train command of ``scripts/run.sh`` (read from the script, so the test follows it) runs on ``tiny`` for
one step (``bash scripts/run.sh --model tiny -s 1`` passes them the same way) in a copy of the project whose
parent folder holds nothing else. ``cnn_dailymail`` then resolves to the embedded synthetic set with a
one-line notice, and the run passes its rubric (``train`` exits 0 only then). ``HF_ENDPOINT`` points at a
closed local port, so the hub is unreachable on any machine, with or without network.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


def run_sh_train_arguments() -> list[str]:
    """The arguments ``scripts/run.sh`` gives ``rlrunbook train`` (its continuation lines joined, ``"$@"`` dropped)."""
    script = (ROOT / "scripts" / "run.sh").read_text()
    joined = re.sub(r"\\\n\s*", " ", script)
    (line,) = [raw for raw in joined.splitlines() if raw.strip().startswith('"$bin/rlrunbook" train')]
    return [arg for arg in shlex.split(line)[1:] if arg != "$@"]


def test_the_main_job_runs_without_shared_data_or_network(tmp_path):
    clone = tmp_path / "lone" / "rlrunbook"
    for folder in ("src", "configs", "scripts"):
        shutil.copytree(ROOT / folder, clone / folder, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", clone)
    env = {key: value for key, value in os.environ.items()
           if key not in ("RLRUNBOOK_DATA_DIR", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}
    env.update(PYTHONPATH=str(clone / "src"), HF_ENDPOINT="http://127.0.0.1:9", PYTHONUNBUFFERED="1",
               RLRUNBOOK_LOG_ROOT=str(tmp_path / "logs"))
    arguments = run_sh_train_arguments()
    assert arguments[:1] == ["train"] and "cnn_dailymail" in arguments
    # As `bash scripts/run.sh --model tiny -s 1`: one step shows the data path (later flags win).
    done = subprocess.run([sys.executable, "-m", "rlrunbook", *arguments, "--model", "tiny", "-s", "1"], cwd=clone,
                          env=env, capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    notices = [line for line in done.stdout.splitlines() if line.startswith("[data] notice: cnn_dailymail")]
    assert len(notices) == 1 and "embedded synthetic news set" in notices[0]
    assert "no connection to 127.0.0.1:9" in notices[0]
    assert "Traceback" not in done.stderr
