"""What every tier's requirement shares: a ``RLRUNBOOK_REQUIRE_*`` variable that turns a skip into a failure.

A tier (gpu, vllm, data, the peer benchmark) skips its tests where what they need is missing, naming it; with
its variable set to ``1`` (``true``, ``yes``) the same tests fail instead, so a runner that should have the
requirement cannot pass by skipping.
"""

from __future__ import annotations

import os
from collections.abc import Mapping


def required(variable: str, env: Mapping[str, str] | None = None) -> bool:
    """Whether ``variable`` asks for the requirement (``1``, ``true`` or ``yes``, any case)."""
    env = os.environ if env is None else env
    return env.get(variable, "").strip().lower() in ("1", "true", "yes")


def outcome(missing: str | None, is_required: bool, variable: str, *, fails_with: str, skips_with: str,
            fix: str = "") -> tuple[str, str] | None:
    """What a test of the tier does: ``None`` (run: nothing is ``missing``), ``("fail", reason)`` when required,
    else ``("skip", reason)``; each reason one line, naming ``missing``, the ``fix`` where one is given, and the
    variable."""
    if missing is None:
        return None
    if is_required:
        return "fail", f"{variable}=1 but {fails_with}: {missing}"
    return "skip", f"{skips_with}: {missing}; {fix + ', or ' if fix else 'set '}{variable}=1 to make this a failure"
