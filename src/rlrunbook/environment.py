"""Numbers read from environment variables (``TINKER_LOCAL_*``), refused by name when they are not what the
setting takes: the one reader of the backend's and the vLLM sampler's numeric settings."""

from __future__ import annotations

import math
from collections.abc import Mapping

from rlrunbook.errors import ConfigError


def env_number(env: Mapping[str, str], name: str, default: float, minimum: float, kind: type = float):
    """``env[name]`` read as ``kind`` (int or float), ``default`` when unset or blank; ``ConfigError`` naming the
    variable for text that is not such a number, a number that is not finite, or one below ``minimum``."""
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = kind(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a{'n integer' if kind is int else ' number'}.") from None
    if not math.isfinite(value):
        raise ConfigError(f"{name}={raw!r} is not a finite number.")
    if value < minimum:
        raise ConfigError(f"{name}={value} must be >= {minimum}.")
    return value
