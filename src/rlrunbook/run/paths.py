"""Where runs live: the log root and a fresh directory per run.

The root comes from the command line, else ``RLRUNBOOK_LOG_ROOT``, else the seeds'
``TINKER_DEBATE_LOG_ROOT`` (kept so old shell setups such as ``/dev/shm/logs`` still work),
else ``./logs``. A run never writes into an existing directory: two runs started in the same
second get ``..._name``, ``..._name-2``, ``..._name-3``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path

from rlrunbook.errors import ConfigError

LOG_ROOT_ENV_VARS = ("RLRUNBOOK_LOG_ROOT", "TINKER_DEBATE_LOG_ROOT")
DEFAULT_LOG_ROOT = "logs"
TIMESTAMP_FORMAT = "%Y%m%d-%H%M%S"
# Enough for any burst of runs started in one second; past it something is looping.
_MAX_SUFFIX = 1000


def log_root(cli_value: str | None, env: Mapping[str, str] = os.environ) -> Path:
    """The root of run directories: ``--log-root``, else the environment, else ``./logs``.

    Empty strings count as unset, so ``RLRUNBOOK_LOG_ROOT= cmd`` falls through to the next source.
    """
    if cli_value:
        return Path(cli_value).expanduser()
    for name in LOG_ROOT_ENV_VARS:
        if env.get(name):
            return Path(env[name]).expanduser()
    return Path(DEFAULT_LOG_ROOT)


def _check_component(kind: str, value: str) -> str:
    """``value`` if it can be one piece of a directory name; ConfigError naming it otherwise."""
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"run {kind} {value!r} is empty: give a short name such as 'smoke_qa'")
    separators = {"/", "\\", os.sep} | ({os.altsep} if os.altsep else set())
    bad = sorted(c for c in separators | {"\0"} if c in value)
    if bad or value in {".", ".."}:
        raise ConfigError(
            f"run {kind} {value!r} contains a path separator or is a relative path "
            f"({bad or value}): it becomes part of one directory name; use letters, digits, '-', '_'"
        )
    return value


def new_run_dir(
    root: str | os.PathLike[str], mode: str, env: str, name: str, now: datetime | None = None
) -> Path:
    """Create and return ``<root>/<YYYYmmdd-HHMMSS>_<mode>_<env>_<name>/``, never an existing directory.

    ``now`` (default: local time) fixes the timestamp, for tests. Creation uses ``mkdir`` without
    ``exist_ok``, so two processes racing for the same name still get different directories.
    """
    for kind, value in (("mode", mode), ("env", env), ("name", name)):
        _check_component(kind, value)
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    stamp = (now or datetime.now()).strftime(TIMESTAMP_FORMAT)
    base = f"{stamp}_{mode}_{env}_{name}"
    for attempt in range(1, _MAX_SUFFIX + 1):
        candidate = root / (base if attempt == 1 else f"{base}-{attempt}")
        try:
            candidate.mkdir()
        except FileExistsError:
            continue
        return candidate
    raise ConfigError(
        f"{root / base} and {_MAX_SUFFIX - 1} suffixed variants already exist: "
        "clean up the log root or pick another --name"
    )
