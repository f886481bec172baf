"""The README's main job, end to end: `rlrunbook check-logprobs` on the default model in a fresh process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", "rlrunbook", *args], capture_output=True, text=True,
                          env=env, timeout=600)


def test_check_logprobs_main_job_passes():
    result = run_cli("check-logprobs", "--prompt", "What is 7 * 8?", "--max-tokens", "32")
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.strip().splitlines()
    assert lines[-1] == "ok"
    max_abs = float(next(line for line in lines if line.startswith("max_abs_diff:")).split()[1])
    assert max_abs <= 1e-4
    assert "smollm2-135m" in result.stdout  # the default model is the real one


def test_check_logprobs_with_filters_on_tiny():
    result = run_cli("check-logprobs", "--model", "tiny", "--temperature", "0.7", "--top-p", "0.9",
                     "--max-tokens", "32", "--num-samples", "8")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "in 8 completion(s)" in result.stdout  # EOS may end some early


def test_bad_option_exits_non_zero_with_the_reason():
    result = run_cli("check-logprobs", "--model", "tiny", "--max-tokens", "0")
    assert result.returncode == 2
    assert "argument --max-tokens: 0 is outside 1..1,048,576" in result.stderr
