"""What counts as a secret, and the redaction every written config and command line goes through.

Secrets never reach an artifact: ``redact_config`` is applied wherever a config is written
(``run_metadata.json``, ``checkpoints/*/checkpoint.json``, the W&B config, ``eval --out``,
``show-config``), ``redact_argv`` wherever a command line is (``run_metadata.json``'s ``argv``), and
the writer also scrubs the secret values themselves out of every string it writes (a prompt or a log
line can echo them). A resumed run gets its secret values again from the command line or the
environment (:func:`secret_from_environment`); they are never read back from a checkpoint.

Two name lists: environment variables use the broad ``SECRET_NAME_PATTERNS`` (``*_KEY``, ``*_TOKEN``);
config keys and CLI flags use ``SECRET_KEY_PATTERNS``, narrower because ``stop_token`` and
``--pad-token`` are exactly what a reader of a run needs to see.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Mapping, Sequence
from typing import Any

from rlrunbook.run.jsonio import REDACTED, redact_text

SECRET_NAME_PATTERNS = ("*_KEY", "*_TOKEN", "*SECRET*", "*PASSWORD*", "*PASSWD*", "*CREDENTIAL*", "*APIKEY*",
                        "*BEARER*")
SECRET_KEY_PATTERNS = (
    "*API_KEY*",
    "*APIKEY*",
    "*ACCESS_KEY*",
    "*PRIVATE_KEY*",
    "*SESSION_KEY*",
    "*SECRET*",
    "*PASSWORD*",
    "*PASSWD*",
    "*CREDENTIAL*",
    "*ACCESS_TOKEN*",
    "*AUTH_TOKEN*",
    "*API_TOKEN*",
    "*BEARER*",
    "TOKEN",
    "HF_TOKEN",
    "*HUB_TOKEN",
)
# Values shorter than this are not scrubbed from free text: replacing every "1" or "abc" would
# mangle the record while protecting nothing a secret could be.
MIN_SCRUB_LENGTH = 6
ENV_PREFIX = "RLRUNBOOK_"  # extra.api_key on resume: RLRUNBOOK_EXTRA_API_KEY
_OVERRIDE = re.compile(r"([A-Za-z_][\w.]*)=(.*)", re.DOTALL)


def is_secret_name(name: str, patterns: tuple[str, ...] = SECRET_NAME_PATTERNS) -> bool:
    """Whether an environment variable name (with ``SECRET_KEY_PATTERNS``: a config key or flag) is secret."""
    upper = name.upper().replace("-", "_")
    return any(fnmatch.fnmatchcase(upper, pattern) for pattern in patterns)


def is_secret_key(name: str) -> bool:
    """Whether a config key or CLI flag name (``api_key``, ``--hf-token``) holds a secret."""
    return is_secret_name(name, SECRET_KEY_PATTERNS)


def is_secret_path(dotted: str) -> bool:
    """Whether any part of a dotted config key (``extra.judge.api_key``) is secret-named."""
    return any(is_secret_key(part) for part in dotted.split("."))


def secret_values(environ: Mapping[str, str]) -> list[str]:
    """Values of all secret-named variables (whatever their prefix), longest first, for scrubbing."""
    values = {v for k, v in environ.items() if is_secret_name(k) and len(v) >= MIN_SCRUB_LENGTH}
    return sorted(values, key=len, reverse=True)


def redact_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` with the value of every secret-named key replaced by ``REDACTED``, at any depth.

    A secret-named key holding a mapping or a list (``credentials: {user, token}``) is redacted whole.
    ``None`` stays ``None``: "not set" is no secret, and a reader needs to see it.
    """
    out: dict[str, Any] = {}
    for key, value in config.items():
        if value is not None and is_secret_key(str(key)):
            out[key] = REDACTED
        elif isinstance(value, Mapping):
            out[key] = redact_config(value)
        else:
            out[key] = value
    return out


def secret_config_values(config: Mapping[str, Any]) -> list[str]:
    """The string values under secret-named keys of ``config`` (any depth), for scrubbing free text."""
    found: list[str] = []

    def collect(value: Any) -> None:
        if isinstance(value, str):
            if len(value) >= MIN_SCRUB_LENGTH and value != REDACTED:
                found.append(value)
        elif isinstance(value, Mapping):
            for item in value.values():
                collect(item)
        elif isinstance(value, (list, tuple)):
            for item in value:
                collect(item)

    def walk(node: Mapping[str, Any]) -> None:
        for key, value in node.items():
            if is_secret_key(str(key)):
                collect(value)
            elif isinstance(value, Mapping):
                walk(value)

    walk(config)
    return found


def redact_argv(argv: Sequence[str], secrets: Sequence[str] = ()) -> list[str]:
    """``argv`` with secret values redacted: of secret-named flags (``--api-key X``, ``--hf-token=X``), of
    secret-named ``key.sub=value`` overrides and sweeps (``extra.api_key=sk-...``), and every occurrence of
    a string in ``secrets`` (values of secret environment variables and config keys)."""
    out: list[str] = []
    redact_next = False
    for arg in argv:
        flag, eq, _ = arg.partition("=")
        override = _OVERRIDE.fullmatch(arg)
        if redact_next:
            out.append(REDACTED)
            redact_next = False
        elif flag.startswith("-") and is_secret_key(flag.lstrip("-")):
            out.append(f"{flag}={REDACTED}" if eq else arg)
            redact_next = not eq
        elif override is not None and is_secret_path(override.group(1)):
            out.append(f"{override.group(1)}={REDACTED}")
        else:
            out.append(redact_text(arg, sorted(secrets, key=len, reverse=True)))
    return out


def secret_env_name(dotted: str) -> str:
    """The environment variable a resumed run reads a secret config value from: ``extra.api_key`` →
    ``RLRUNBOOK_EXTRA_API_KEY``."""
    return ENV_PREFIX + re.sub(r"[^A-Za-z0-9]", "_", dotted).upper()


def secret_from_environment(dotted: str, environ: Mapping[str, str]) -> str | None:
    """The value of :func:`secret_env_name` for ``dotted`` in ``environ``, or None when unset or empty."""
    return environ.get(secret_env_name(dotted)) or None


def redacted_paths(config: Mapping[str, Any], prefix: str = "") -> list[str]:
    """Dotted keys whose value in ``config`` is ``REDACTED`` (what a checkpoint's config left out)."""
    paths = []
    for key, value in config.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping):
            paths += redacted_paths(value, f"{dotted}.")
        elif value == REDACTED:
            paths.append(dotted)
    return paths
