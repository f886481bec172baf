"""Real data in the suite (``rlrunbook.testing.data``, wired in conftest.py): a test marked ``data`` reads the real
data sets where they are and skips without them, or fails when ``RLRUNBOOK_REQUIRE_DATA=1``; every other test
sees no real data, whether or not it lies beside the checkout; no test reaches the hub for data.

The marker's behaviour is run for real: a probe module with a ``data`` test and a plain one, under the project's
conftest.py in a pytest subprocess, against a generated data root standing in for the real one.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlrunbook.errors import ConfigError
from rlrunbook.rl.data import DATA_DIR_ENV, DatasetError, default_local_path, load_cnn_dailymail
from rlrunbook.rl.data.sources import LOCAL_FILES, data_roots_searched
from rlrunbook.testing.data import (
    REQUIRE_ENV,
    data_outcome,
    missing_data_reason,
    real_data_path,
    write_data_root,
)

pytestmark = pytest.mark.slow  # pytest processes of their own

ROOT = Path(__file__).resolve().parents[3]

PROBE = '''
from rlrunbook.rl.data import default_local_path
import pytest


@pytest.mark.data("gsm8k", "nq_open")
def test_reads_the_real_data():
    assert default_local_path("gsm8k") is not None and default_local_path("nq_open") is not None


def test_sees_no_real_data():
    assert default_local_path("gsm8k") is None
'''


def _run_probe(tmp_path: Path, data_dir: Path, require: bool = False) -> tuple[int, str]:
    suite = tmp_path / "suite"
    suite.mkdir(exist_ok=True)
    shutil.copy(ROOT / "conftest.py", suite / "conftest.py")
    (suite / "pytest.ini").write_text("[pytest]\naddopts = --strict-markers -p no:cacheprovider\n"
                                      "markers =\n    data: reads the real data sets\n")
    (suite / "test_probe.py").write_text(PROBE)
    env = {k: v for k, v in os.environ.items() if k not in (DATA_DIR_ENV, REQUIRE_ENV, "PYTEST_ADDOPTS")}
    env[DATA_DIR_ENV] = str(data_dir)
    if require:
        env[REQUIRE_ENV] = "1"
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs"], cwd=suite, env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    return done.returncode, done.stdout + done.stderr


def test_a_data_test_reads_the_data_where_it_is_and_no_other_test_does(tmp_path):
    write_data_root(tmp_path / "data", rows=3)
    code, output = _run_probe(tmp_path, tmp_path / "data")
    assert code == 0 and "2 passed" in output, output


def test_without_the_data_a_data_test_skips_with_one_line_or_fails_when_required(tmp_path):
    (tmp_path / "empty").mkdir()
    code, output = _run_probe(tmp_path, tmp_path / "empty")
    assert code == 0 and "1 passed, 1 skipped" in output, output
    (line,) = [line for line in output.splitlines() if line.startswith("SKIPPED")]
    assert f"no gsm8k/test.jsonl, nq_open/NQ-open.dev.jsonl in ${DATA_DIR_ENV} ({tmp_path / 'empty'})" in line
    assert f"set {DATA_DIR_ENV} to the folder that holds it, or {REQUIRE_ENV}=1 to make this a failure" in line
    code, output = _run_probe(tmp_path, tmp_path / "empty", require=True)
    assert code == 1 and "1 passed, 1 error" in output, output  # a failure in setup: an error
    assert f"{REQUIRE_ENV}=1 but the real data is missing: no gsm8k/test.jsonl" in output


def test_the_reason_names_where_the_data_is_looked_for(tmp_path, monkeypatch):
    monkeypatch.setenv(DATA_DIR_ENV, str(tmp_path))
    assert missing_data_reason(["cnn_dailymail"]) == f"no cnn_dailymail/cnndm_80.jsonl in ${DATA_DIR_ENV} ({tmp_path})"
    write_data_root(tmp_path, rows=2)
    assert missing_data_reason(LOCAL_FILES) is None
    monkeypatch.delenv(DATA_DIR_ENV)
    reason = missing_data_reason(["gsm8k"])
    if default_local_path("gsm8k") is None:  # no shared/data beside this checkout
        assert reason == (f"no gsm8k/test.jsonl in shared/data beside the checkout "
                          f"({' or '.join(map(str, data_roots_searched()))}; ${DATA_DIR_ENV} is unset)")
    else:
        assert reason is None


def test_outcomes_and_refused_marks():
    assert data_outcome(None, required=True) is None
    assert data_outcome("no x", required=False) == ("skip", (
        f"needs the project's real data: no x; set {DATA_DIR_ENV} to the folder that holds it, "
        f"or {REQUIRE_ENV}=1 to make this a failure"))
    assert data_outcome("no x", required=True) == ("fail", f"{REQUIRE_ENV}=1 but the real data is missing: no x")
    with pytest.raises(ValueError, match=r"@pytest.mark.data\('gsm8k'\)"):
        missing_data_reason([])
    with pytest.raises(ConfigError, match="unknown data set kind 'mnist'"):
        missing_data_reason(["mnist"])


def test_this_test_sees_no_real_data():
    # Not marked `data`: whatever lies beside the checkout or in the user's RLRUNBOOK_DATA_DIR is hidden.
    root = Path(os.environ[DATA_DIR_ENV])
    assert root.is_dir() and not any(root.iterdir())
    assert all(default_local_path(kind) is None for kind in LOCAL_FILES)
    with pytest.raises(FileNotFoundError, match=r"mark the test @pytest.mark.data\('gsm8k'\)"):
        real_data_path("gsm8k")


def test_a_hub_data_set_is_refused_at_once():
    assert os.environ["HF_DATASETS_OFFLINE"] == "1"
    started = time.monotonic()
    with pytest.raises(DatasetError, match="abisee/cnn_dailymail .*load_dataset failed"):
        load_cnn_dailymail("abisee/cnn_dailymail")
    assert time.monotonic() - started < 20, "a hub call retried instead of failing: is datasets offline?"
