"""scripts/gpu_report.py on hand-made result folders: what a part's section says is what its files say.

Every outcome is shown, failures first among equals: a failed or errored test or benchmark has its row, a skip of an
optional part of the gpu tier is counted as "not proven", a step's exit status is never read as success.
"""

from __future__ import annotations

import datetime
import importlib.util
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[3]
NOW = datetime.datetime(2026, 11, 25, 9, 30, tzinfo=datetime.timezone.utc)


def _report():
    spec = importlib.util.spec_from_file_location("gpu_report", REPO_ROOT / "scripts" / "gpu_report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _case(name: str, inner: str = "") -> str:
    return f'<testcase classname="tests.gpu" name="{name}">{inner}</testcase>'


def test_the_tier_counts_optional_parts_as_not_proven_and_other_skips_as_skips(tmp_path):
    cases = [
        _case("test_fp32_parity[tiny-T1-hf]"),
        _case("test_fp32_parity[tiny-T1-vllm]", '<skipped type="pytest.skip" message="not proven: optional part '
              'vllm, the vLLM sampler&apos;s parity cases: no server"/>'),
        _case("test_a_4bit_step[tiny]", '<skipped type="pytest.skip" message="not proven: optional part '
              'bitsandbytes, 4-bit base weights: bitsandbytes is not installed"/>'),
        _case("test_odd[tiny]", '<skipped type="pytest.skip" message="could not import &apos;flash_attn&apos;"/>'),
        _case("test_bf16_parity[smollm2-135m-T1-invariant]", '<failure message="assert 0.196 == 0.0"/>'),
        _case("test_stop[tiny]", '<error message="fixture &apos;host&apos; failed"/>'),
    ]
    (tmp_path / "gpu-tier.xml").write_text(f"<testsuites><testsuite>{''.join(cases)}</testsuite></testsuites>")
    lines = _report()._tier(tmp_path)
    assert lines[0] == "gpu tier: 1 passed, 1 failed, 1 error, 2 not proven, 1 skipped"
    assert lines[1] == "not proven (optional parts missing on this machine): bitsandbytes, vllm"
    assert "| test_fp32_parity[tiny-T1-vllm] | not proven (vllm) |  |  |  |" in lines
    assert "| test_odd[tiny] | skipped |  |  |  |" in lines
    assert "| test_bf16_parity[smollm2-135m-T1-invariant] | failed |  |  |  |" in lines
    assert "| test_stop[tiny] | error |  |  |  |" in lines
