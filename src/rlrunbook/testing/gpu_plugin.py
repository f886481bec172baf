"""The pytest plugin of the gpu tier's requirement: under ``RLRUNBOOK_REQUIRE_GPU=1`` a gpu test cannot skip.

A skip of a test marked ``gpu`` (``pytest.skip``, ``importorskip``, a marker's skip) is turned into a failure
naming what the skip said was missing, unless its reason names one of the stated optional parts
(``rlrunbook.testing.gpu.OPTIONAL_PARTS``, written by :func:`skip_optional_part`): those stay skipped, and the
report counts them as "not proven". The root conftest loads it (``pytest_plugins``); ``-p
rlrunbook.testing.gpu_plugin`` loads it anywhere else.
"""

from __future__ import annotations

import pytest

from rlrunbook.testing.gpu import gpu_required, not_proven_reason, required_skip_failure


def skip_optional_part(part: str, missing: str | None) -> None:
    """Skip the calling gpu test as "not proven" when its optional ``part`` is ``missing`` (``None``: run it)."""
    if missing is not None:
        pytest.skip(not_proven_reason(part, missing))


def _skip_reason(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return reason.removeprefix("Skipped: ")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    if not report.skipped or hasattr(report, "wasxfail") or item.get_closest_marker("gpu") is None:
        return
    failure = required_skip_failure(_skip_reason(report), gpu_required())
    if failure is not None:
        report.outcome = "failed"
        report.longrepr = failure
