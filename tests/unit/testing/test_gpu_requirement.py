"""The GPU tier cannot pass by skipping where a GPU was required (DESIGN §6, STYLE guideline 7).

Runs the preflight module of tests/gpu in a subprocess on this (GPU-less) machine: with
``RLRUNBOOK_REQUIRE_GPU=1`` it must fail and name the missing GPU; without, it must skip cleanly.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlrunbook.testing.gpu import REQUIRE_ENV, missing_gpu_reason

REPO_ROOT = Path(__file__).resolve().parents[3]
PREFLIGHT = "tests/gpu/test_gpu_0_preflight.py"

pytestmark = [pytest.mark.skipif(missing_gpu_reason() is None, reason="a CUDA GPU is usable here: nothing to refuse"),
              pytest.mark.slow]


def _run_preflight(require_gpu: bool) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in (REQUIRE_ENV, "PYTEST_ADDOPTS")}
    if require_gpu:
        env[REQUIRE_ENV] = "1"
    return subprocess.run(
        [sys.executable, "-m", "pytest", PREFLIGHT, "-m", "gpu", "-q", "-p", "no:cacheprovider"],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300,
    )


def test_required_gpu_missing_fails_naming_it():
    result = _run_preflight(require_gpu=True)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert f"{REQUIRE_ENV}=1 but no usable GPU" in output, output
    assert "passed" not in output.splitlines()[-1], output


def test_gpu_tier_skips_cleanly_without_the_requirement():
    result = _run_preflight(require_gpu=False)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "skipped" in output and "failed" not in output and "error" not in output.lower(), output
