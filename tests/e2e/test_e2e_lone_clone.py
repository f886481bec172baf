"""The main job in a lone clone: no ``../shared`` beside the repository and no route to the hub.

The two steps of ``scripts/run.sh`` (its train arguments read from the script, so the test follows it) run as
``bash scripts/run.sh --model tiny -s 1`` runs them, in a copy of the project whose parent folder holds nothing
else: the logprob check of what train runs (its arguments from ``show-config --check-logprobs-args``, so it
checks ``tiny`` too), then one training step. ``cnn_dailymail`` then resolves to the embedded synthetic set
with a one-line notice, every run names its data in one line, and the run passes its rubric (``train`` exits
0 only then). ``HF_ENDPOINT`` points at a closed local port, so the hub is unreachable on any machine.
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
    """The arguments ``scripts/run.sh`` gives ``rlrunbook train`` (its ``train_args=( ... )`` array, ``"$@"``
    dropped), after checking that both of its commands use them."""
    script = (ROOT / "scripts" / "run.sh").read_text()
    assert '"$bin/rlrunbook" train "${train_args[@]}"' in script
    assert 'show-config --check-logprobs-args "${train_args[@]}"' in script and '"${check[@]}"' in script
    (body,) = re.findall(r"^train_args=\((.*?)\)$", script, flags=re.MULTILINE | re.DOTALL)
    return ["train", *(arg for arg in shlex.split(body) if arg != "$@")]


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
    # As `bash scripts/run.sh --model tiny -s 1`: step 1 checks what step 2 trains (later flags win).
    extra = ["--model", "tiny", "-s", "1"]
    shown = subprocess.run([sys.executable, "-m", "rlrunbook", "show-config", "--check-logprobs-args",
                            *arguments[1:], *extra], cwd=clone, env=env, capture_output=True, text=True, check=False)
    assert shown.returncode == 0, shown.stderr[-2000:]
    check = shown.stdout.splitlines()
    assert check[:2] == ["--model", "tiny"]
    checked = subprocess.run([sys.executable, "-m", "rlrunbook", "check-logprobs", "--prompt", "What is 7 * 8?",
                              "--max-tokens", "8", *check], cwd=clone, env=env, capture_output=True, text=True,
                             timeout=600, check=False)
    assert checked.returncode == 0, (checked.stdout + checked.stderr)[-2000:]
    assert checked.stdout.startswith("[check-logprobs] loading tiny:") and "\nok\n" in checked.stdout
    # One step shows the data path.
    done = subprocess.run([sys.executable, "-m", "rlrunbook", *arguments, *extra], cwd=clone,
                          env=env, capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    (announced,) = [line for line in done.stdout.splitlines() if line.startswith("[data] summary data ")]
    assert "embedded:synthetic_news" in announced and ", 200 rows, fingerprint " in announced
    notices = [line for line in done.stdout.splitlines() if line.startswith("[data] notice: cnn_dailymail")]
    assert len(notices) == 1 and "embedded synthetic news set" in notices[0]
    assert "no connection to 127.0.0.1:9" in notices[0]
    assert "Traceback" not in done.stderr
