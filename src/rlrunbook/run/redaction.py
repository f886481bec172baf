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

A name is not the only sign: a value that holds a credential (a token shape such as ``sk-...``, ``hf_...``,
``AKIA...``, a JWT, a private-key block, or a URL with ``user:password@``; the list is
``run.secret_scan.PATTERNS``) is a secret under any key (``extra.openai_key``, ``extra.passphrase``).
Such a config value is withheld whole, like a secret-named one, and :func:`withheld_paths` names it, so
that a resume asks for it again (``checkpoint.json`` records the list as ``withheld``). In command lines
and environment values only the credential itself is cut out (``https://<redacted>@host``).
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Mapping, Sequence
from typing import Any

from rlrunbook.run.jsonio import REDACTED, redact_text
from rlrunbook.run.secret_scan import URL_CREDENTIALS, matches

SECRET_NAME_PATTERNS = ("*_KEY", "*_TOKEN", "*SECRET*", "*PASSWORD*", "*PASSWD*", "*PASSPHRASE*", "*CREDENTIAL*",
                        "*APIKEY*", "*BEARER*")
SECRET_KEY_PATTERNS = (
    "*API_KEY*",
    "*APIKEY*",
    "*ACCESS_KEY*",
    "*PRIVATE_KEY*",
    "*SESSION_KEY*",
    "*SECRET*",
    "*PASSWORD*",
    "*PASSWD*",
    "*PASSPHRASE*",
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


def _credentials(text: str) -> list[tuple[int, int, str]]:
    """``(start, end, kind)`` byte spans of the credentials in ``text`` (UTF-8; of a URL, its userinfo)."""
    data = text.encode("utf-8", "surrogatepass")  # a lone surrogate is no reason to skip a string
    spans = [(*match.span(1), kind) if kind == URL_CREDENTIALS else (*match.span(), kind)
             for match, kind in matches(data)]
    return sorted(spans)


def credential_kind(value: str) -> str | None:
    """The kind of credential ``value`` holds anywhere in it (``"GitHub token"``, ``"URL with credentials"``),
    or None: the test that makes a value secret whatever its key or variable is called."""
    spans = _credentials(value)
    return spans[0][2] if spans else None


def credential_strings(text: str) -> list[str]:
    """The credentials in ``text`` themselves (of a URL, its ``user:password``), for scrubbing other text."""
    data = text.encode("utf-8", "surrogatepass")
    return [data[start:end].decode("utf-8", "surrogatepass") for start, end, _ in _credentials(text)]


def scrub_credentials(text: str) -> str:
    """``text`` with each credential in it replaced by ``REDACTED``: ``https://<redacted>@host/path``."""
    spans = _credentials(text)
    if not spans:
        return text
    data, out, at = text.encode("utf-8", "surrogatepass"), [], 0
    for start, end, _ in spans:
        if start >= at:  # overlapping matches (a JWT in a URL's password) are cut once
            out += [data[at:start], REDACTED.encode()]
        at = max(at, end)
    return b"".join([*out, data[at:]]).decode("utf-8", "surrogatepass")


def holds_secret(value: Any) -> bool:
    """Whether ``value`` is or contains a credential: a string with one, a mapping with a secret-named key
    or such a value, a list with such an item. ``None`` holds none."""
    if isinstance(value, str):
        return credential_kind(value) is not None
    if isinstance(value, Mapping):
        return any((item is not None and is_secret_key(str(key))) or holds_secret(item)
                   for key, item in value.items())
    if isinstance(value, (list, tuple)):
        return any(holds_secret(item) for item in value)
    return False


def secret_values(environ: Mapping[str, str]) -> list[str]:
    """Values of all secret-named variables (whatever their prefix), and the credentials that the values of
    the others hold (a URL's ``user:password``), longest first, for scrubbing."""
    values = {v for k, v in environ.items() if is_secret_name(k) and len(v) >= MIN_SCRUB_LENGTH}
    values |= {c for k, v in environ.items() if not is_secret_name(k) for c in credential_strings(v)
               if len(c) >= MIN_SCRUB_LENGTH}
    return sorted(values, key=len, reverse=True)


def _withhold(key: Any, value: Any) -> bool:
    if value is None:
        return False  # "not set" is no secret, and a reader needs to see it
    if is_secret_key(str(key)):
        return True
    return not isinstance(value, Mapping) and holds_secret(value)


def redact_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` with every secret value replaced by ``REDACTED``, at any depth: the value of a secret-named
    key, and a value holding a credential under any key (a list holding one is withheld whole).

    A secret-named key holding a mapping or a list (``credentials: {user, token}``) is redacted whole.
    ``None`` stays ``None``: "not set" is no secret, and a reader needs to see it.
    """
    out: dict[str, Any] = {}
    for key, value in config.items():
        if _withhold(key, value):
            out[key] = REDACTED
        elif isinstance(value, Mapping):
            out[key] = redact_config(value)
        else:
            out[key] = value
    return out


def withheld_paths(config: Mapping[str, Any], prefix: str = "") -> list[str]:
    """The dotted keys whose value :func:`redact_config` withholds: what a resume must be given again."""
    paths = []
    for key, value in config.items():
        dotted = f"{prefix}{key}"
        if _withhold(key, value):
            paths.append(dotted)
        elif isinstance(value, Mapping):
            paths += withheld_paths(value, f"{dotted}.")
    return paths


def secret_config_values(config: Mapping[str, Any]) -> list[str]:
    """For scrubbing free text: the string values under secret-named keys of ``config`` (any depth), and the
    values holding a credential under any key together with the credentials themselves; longest first."""
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

    def walk(node: Any, named: bool) -> None:
        if isinstance(node, Mapping):
            for key, value in node.items():
                walk(value, named or is_secret_key(str(key)))
        elif isinstance(node, (list, tuple)):
            for item in node:
                walk(item, named)
        elif isinstance(node, str):
            strings = credential_strings(node)
            if named or strings:
                collect(node)
            found.extend(s for s in strings if len(s) >= MIN_SCRUB_LENGTH)

    walk(config, False)
    return sorted(set(found), key=len, reverse=True)


def redact_argv(argv: Sequence[str], secrets: Sequence[str] = ()) -> list[str]:
    """``argv`` with secret values redacted: of secret-named flags (``--api-key X``, ``--hf-token=X``), of
    secret-named ``key.sub=value`` overrides and sweeps (``extra.api_key=sk-...``), and every occurrence of
    a string in ``secrets`` (values of secret environment variables and config keys), and every credential
    in any argument (a token shape, a URL's ``user:password``: :func:`scrub_credentials`)."""
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
            out.append(scrub_credentials(redact_text(arg, sorted(secrets, key=len, reverse=True))))
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
