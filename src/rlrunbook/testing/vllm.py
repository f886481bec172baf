"""The vLLM requirement of the ``vllm`` tier: skip without a vLLM server, fail when one was required.

A server is available when ``TINKER_LOCAL_VLLM_URL`` names one, or when a managed one can be
started: ``TINKER_LOCAL_VLLM_COMMAND``, ``RLRUNBOOK_VLLM_VENV`` or ``.venv-vllm`` (made by
``bash scripts/setup-vllm.sh``). ``RLRUNBOOK_REQUIRE_VLLM=1`` turns the skip into a failure, so CI
cannot pass the tier by skipping it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from rlrunbook.errors import ConfigError
from rlrunbook.testing.requirement import required
from rlrunbook.vllm.settings import VllmSettings

REQUIRE_ENV = "RLRUNBOOK_REQUIRE_VLLM"
CHECKOUT = Path(__file__).resolve().parents[3]


def vllm_required(env: Mapping[str, str] | None = None) -> bool:
    """Whether ``RLRUNBOOK_REQUIRE_VLLM`` turns the skip into a failure."""
    return required(REQUIRE_ENV, env)


def missing_vllm_reason(env: dict[str, str] | None = None) -> str | None:
    """Why no vLLM server can be had here, naming the fix; ``None`` when one can."""
    settings = VllmSettings.from_env(dict(os.environ if env is None else env))
    if settings.url:
        return None
    try:
        command = settings.server_command(CHECKOUT if (CHECKOUT / "pyproject.toml").is_file() else None)
    except ConfigError as error:
        return str(error)
    if not os.access(command[0], os.X_OK) and not settings.command:
        return f"{command[0]} is not executable; run `bash scripts/setup-vllm.sh` again"
    return None
