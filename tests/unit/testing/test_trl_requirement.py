"""The peer benchmark skips without TRL (one reason line) and fails under RLRUNBOOK_REQUIRE_TRL=1.

The logic is tested as pure functions, and the benchmark itself is run in a subprocess in which TRL cannot be
imported (``sys.modules["trl"] = None``), whether or not this machine has it.
"""

from __future__ import annotations

import pytest

import os
import subprocess
import sys
from pathlib import Path

from rlrunbook.testing.trl import REQUIRE_ENV, missing_trl_reason, trl_outcome, trl_required

REPO_ROOT = Path(__file__).resolve().parents[3]
PEER = "tests/benchmarks/test_bench_peer.py"


def test_the_requirement_is_read_from_the_environment():
    assert not trl_required({})
    assert not trl_required({REQUIRE_ENV: "0"})
    assert all(trl_required({REQUIRE_ENV: value}) for value in ("1", "true", "YES"))


def test_the_missing_packages_are_named_with_the_fix():
    assert missing_trl_reason(lambda name: object()) is None
    assert missing_trl_reason(lambda name: None) == "trl and datasets not installed (pip install -e '.[bench]')"
    assert missing_trl_reason(lambda name: None if name == "trl" else object()).startswith("trl not installed")


def test_missing_trl_skips_unless_required_then_fails():
    assert trl_outcome(None, required=True) is None
    action, reason = trl_outcome("trl not installed (pip install -e '.[bench]')", required=False)
    assert action == "skip" and "pip install -e '.[bench]'" in reason and REQUIRE_ENV in reason
    action, reason = trl_outcome("trl not installed (pip install -e '.[bench]')", required=True)
    assert action == "fail" and reason.startswith(f"{REQUIRE_ENV}=1 but")
    assert "\n" not in reason


def _run_peer_without_trl(require: bool) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in (REQUIRE_ENV, "PYTEST_ADDOPTS")}
    if require:
        env[REQUIRE_ENV] = "1"
    script = ("import sys; sys.modules['trl'] = None; import pytest; "
              f"sys.exit(pytest.main(['{PEER}', '-m', 'benchmark', '-q', '-rs', '-p', 'no:cacheprovider']))")
    return subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=300, check=False)


@pytest.mark.slow
def test_the_peer_benchmark_skips_with_one_reason_line_without_trl():
    result = _run_peer_without_trl(require=False)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    reasons = [line for line in output.splitlines() if line.startswith("SKIPPED")]
    assert len(reasons) == 1 and "needs TRL for the peer benchmark: trl not installed" in reasons[0], output
    assert "1 skipped" in output and "failed" not in output, output


@pytest.mark.slow
def test_the_peer_benchmark_fails_without_trl_when_required():
    result = _run_peer_without_trl(require=True)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert f"{REQUIRE_ENV}=1 but the peer benchmark cannot run: trl not installed" in output, output
