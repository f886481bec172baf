"""Under RLRUNBOOK_REQUIRE_GPU=1 a gpu test cannot skip, except as a stated optional part (rlrunbook.testing.gpu_plugin).

A tier with 8 of 39 tests skipped read green before: a missing package skipped its tests whether or not a GPU was
required. Here a scratch test file, run by pytest in a subprocess with only the plugin loaded (no GPU is asked of
it: the root conftest's check of the GPU itself is not in play), skips by ``importorskip`` of a module that does
not exist, by a plain ``pytest.skip``, and as the optional part ``bitsandbytes``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from rlrunbook.testing.gpu import (
    NOT_PROVEN,
    OPTIONAL_PARTS,
    REQUIRE_ENV,
    not_proven_part,
    not_proven_reason,
    required_skip_failure,
)

SCRATCH_TESTS = '''
import pytest
from rlrunbook.testing.gpu_plugin import skip_optional_part

pytestmark = pytest.mark.gpu


def test_needs_a_missing_module():
    pytest.importorskip("rlrunbook_no_such_module")


def test_skips_plainly():
    pytest.skip("the card has no tensor cores")


def test_optional_part():
    skip_optional_part("bitsandbytes", "bitsandbytes is not installed (pip install bitsandbytes)")


@pytest.mark.xfail(reason="a known failure, not a skip")
def test_expected_failure():
    assert False


def test_runs():
    assert True
'''

NOT_GPU = '''
import pytest


def test_not_a_gpu_test():
    pytest.importorskip("rlrunbook_no_such_module")
'''


def _run(tmp_path: Path, require: bool) -> dict[str, tuple[str, str]]:
    """{test name: (outcome, message)} from the JUnit XML of the scratch tests."""
    (tmp_path / "test_scratch_gpu.py").write_text(SCRATCH_TESTS)
    (tmp_path / "test_scratch_cpu.py").write_text(NOT_GPU)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: needs a GPU\n")
    env = {k: v for k, v in os.environ.items() if k not in (REQUIRE_ENV, "PYTEST_ADDOPTS")}
    if require:
        env[REQUIRE_ENV] = "1"
    xml = tmp_path / "out.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-p", "rlrunbook.testing.gpu_plugin", "-p", "no:cacheprovider",
                    "-q", f"--junitxml={xml}", str(tmp_path)], cwd=tmp_path, env=env, capture_output=True, text=True,
                   timeout=300, check=False)
    outcomes = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        found = [child for child in case if child.tag in ("failure", "error", "skipped")]
        outcomes[case.get("name")] = (found[0].tag, found[0].get("message", "")) if found else ("passed", "")
    return outcomes


def test_required_gpu_turns_every_skip_but_an_optional_parts_into_a_failure(tmp_path):
    outcomes = _run(tmp_path, require=True)
    outcome, message = outcomes["test_needs_a_missing_module"]
    assert outcome == "failure" and f"{REQUIRE_ENV}=1" in message and "rlrunbook_no_such_module" in message, message
    outcome, message = outcomes["test_skips_plainly"]
    assert outcome == "failure" and "the card has no tensor cores" in message, message
    outcome, message = outcomes["test_optional_part"]
    assert outcome == "skipped" and message.startswith(f"{NOT_PROVEN} bitsandbytes"), message
    assert outcomes["test_expected_failure"][0] == "skipped"  # an xfail is not a skip to refuse
    assert outcomes["test_runs"] == ("passed", "")
    assert outcomes["test_not_a_gpu_test"][0] == "skipped"  # other tiers keep their own switches


def test_without_the_requirement_skips_stay_skips(tmp_path):
    outcomes = _run(tmp_path, require=False)
    assert {name: outcome for name, (outcome, _) in outcomes.items()} == {
        "test_needs_a_missing_module": "skipped", "test_skips_plainly": "skipped", "test_optional_part": "skipped",
        "test_expected_failure": "skipped", "test_runs": "passed", "test_not_a_gpu_test": "skipped"}


def test_the_verdict_of_a_skip_reason():
    reason = not_proven_reason("vllm", "no server")
    assert reason == f"{NOT_PROVEN} vllm, {OPTIONAL_PARTS['vllm']}: no server"
    assert not_proven_part(reason) == "vllm" and required_skip_failure(reason, True) is None
    assert not_proven_part("needs a CUDA GPU (no device)") is None
    assert not_proven_part(f"{NOT_PROVEN} flash-attn, whatever: missing") is None  # not a stated part
    failure = required_skip_failure("could not import 'bitsandbytes'", True)
    assert failure is not None and failure.startswith(f"{REQUIRE_ENV}=1") and "'bitsandbytes'" in failure
    assert required_skip_failure("could not import 'bitsandbytes'", False) is None
    with pytest.raises(KeyError, match="not an optional part"):
        not_proven_reason("flash-attn", "missing")
