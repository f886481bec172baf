"""The TRL requirement of the peer benchmark: skip without TRL, fail when TRL was required.

The peer benchmark (``tests/benchmarks/test_bench_peer.py``) times rlrunbook's RL step against TRL's
``GRPOTrainer``; the other benchmarks (decode, RL step, training) need no TRL and report their figures
without it. ``RLRUNBOOK_REQUIRE_TRL=1`` turns the skip into a failure that names what is missing, so a
benchmark run that was meant to compare against TRL cannot pass by skipping the comparison.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Mapping

from rlrunbook.testing.requirement import outcome, required

REQUIRE_ENV = "RLRUNBOOK_REQUIRE_TRL"
PACKAGES = ("trl", "datasets")  # the ``bench`` extra of pyproject.toml


def trl_required(env: Mapping[str, str] | None = None) -> bool:
    """Whether ``RLRUNBOOK_REQUIRE_TRL`` turns the skip into a failure."""
    return required(REQUIRE_ENV, env)


def missing_trl_reason(find_spec: Callable[[str], object] = importlib.util.find_spec) -> str | None:
    """Why the peer benchmark cannot run here, naming the fix; ``None`` when TRL and its data sets package import."""
    missing = [name for name in PACKAGES if find_spec(name) is None]
    if not missing:
        return None
    return f"{' and '.join(missing)} not installed (pip install -e '.[bench]')"


def trl_outcome(missing: str | None, required: bool) -> tuple[str, str] | None:
    """What a test that needs TRL does: ``None`` (run), ``("skip", reason)`` or ``("fail", reason)``; one line each."""
    return outcome(missing, required, REQUIRE_ENV, fails_with="the peer benchmark cannot run",
                   skips_with="needs TRL for the peer benchmark")
