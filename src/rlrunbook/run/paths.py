"""Where runs live: the log root and a fresh directory per run.

The root comes from the command line, else ``RLRUNBOOK_LOG_ROOT``, else the older
``TINKER_DEBATE_LOG_ROOT`` (kept so old shell setups such as ``/dev/shm/logs`` still work),
else ``./logs``. A run never writes into an existing directory: two runs started in the same
second get ``..._name``, ``..._name-2``, ``..._name-3``.
"""

from __future__ import annotations

import errno
import os
import tempfile
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path

from rlrunbook.errors import ConfigError
from rlrunbook.run.redaction import credential_kind
from rlrunbook.run.schema import METADATA_FILE

LOG_ROOT_ENV_VARS = ("RLRUNBOOK_LOG_ROOT", "TINKER_DEBATE_LOG_ROOT")
DEFAULT_LOG_ROOT = "logs"
TIMESTAMP_FORMAT = "%Y%m%d-%H%M%S"
# Enough for any burst of runs started in one second; past it something is looping.
_MAX_SUFFIX = 1000
_SUFFIX_ROOM = len(f"-{_MAX_SUFFIX}")
_DEFAULT_NAME_MAX = 255  # bytes per path component on ext4, xfs, btrfs, tmpfs


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
    if not value.isprintable():
        # A newline or carriage return in a directory name breaks every line-based tool that lists runs.
        raise ConfigError(f"run {kind} {value!r} contains a newline or another control character: it becomes "
                          "part of a directory name; use letters, digits, '-', '_'")
    separators = {"/", "\\", os.sep} | ({os.altsep} if os.altsep else set())
    bad = sorted(c for c in separators | {"\0"} if c in value)
    if bad or value in {".", ".."}:
        raise ConfigError(
            f"run {kind} {value!r} contains a path separator or is a relative path "
            f"({bad or value}): it becomes part of one directory name; use letters, digits, '-', '_'"
        )
    # Each part after a '-', '_' or '.' is read as a word start too: in a name, 'run-sk-proj-...' is a key
    # after a separator, where in a file '-' continues a token (the scan's own rule, see run.secret_scan).
    starts = [0] + [i + 1 for i, c in enumerate(value) if c in "-_."]
    credential = next((kind for kind in map(credential_kind, (value[i:] for i in starts)) if kind), None)
    if credential is not None:  # the value is not repeated: it is the secret
        raise ConfigError(
            f"run {kind} holds what looks like a credential ({credential}): it would become part of the run "
            f"directory's name, which every listing, log and archive shows. Use a name without it.")
    return value


_WHAT = {"--log-root": "log root"}


def _existing_ancestor(path: Path, flag: str = "--log-root") -> Path:
    """``path`` or its nearest ancestor that exists (as anything); ``ConfigError`` if one is not a directory."""
    path = Path(os.path.abspath(path))
    for candidate in (path, *path.parents):
        if candidate.exists():
            if not candidate.is_dir():
                where = "is" if candidate == path else f"lies under {candidate}, which is"
                raise ConfigError(f"{_WHAT.get(flag, flag + ' folder')} {str(path)!r} {where} a file, not a "
                                  f"directory. Pass {flag} a path whose folders are directories (missing ones "
                                  "are created).")
            return candidate
    return Path(path.anchor)


def check_log_root(root: str | os.PathLike[str], flag: str = "--log-root") -> None:
    """``ConfigError`` naming the cause and the fix unless run directories can be created under ``root``.

    Checked before anything loads (so a bad ``--log-root`` costs no model load and leaves no directory):
    neither ``root`` nor an ancestor may be a file, and the nearest existing one must let this process
    create a directory, tried for real with a probe directory that is removed at once (``os.access``
    answers yes to root on a read-only directory, and knows nothing of read-only mounts).
    """
    existing = _existing_ancestor(Path(root), flag)
    try:
        probe = tempfile.mkdtemp(prefix=".rlrunbook-probe-", dir=existing)
    except OSError as error:
        why = {errno.EACCES: "permission denied", errno.EPERM: "permission denied",
               errno.EROFS: "read-only file system", errno.ENOSPC: "no space left"}.get(error.errno, error.strerror)
        target = "" if existing == Path(os.path.abspath(root)) else f" (its nearest existing folder {existing})"
        also = " (or set RLRUNBOOK_LOG_ROOT)" if flag == "--log-root" else ""
        raise ConfigError(f"{_WHAT.get(flag, flag + ' folder')} {str(root)!r}{target} is not writable: {why}. "
                          f"Pass {flag} a place you can write to{also}.") from None
    os.rmdir(probe)


def name_max(root: str | os.PathLike[str]) -> int:
    """The longest file name (bytes) the file system of ``root`` (or its nearest existing ancestor) allows."""
    try:
        return os.pathconf(_existing_ancestor(Path(root)), "PC_NAME_MAX")
    except (OSError, ValueError, AttributeError, ConfigError):
        return _DEFAULT_NAME_MAX


def check_run_directory(path: Path) -> None:
    """``ConfigError`` unless the directory ``path`` is a run directory, one holding ``run_metadata.json``
    (the commands that act on a run, such as ``package``, would otherwise treat any folder as one)."""
    if not (path / METADATA_FILE).is_file():
        raise ConfigError(f"{str(path)!r} is not a run directory: it holds no {METADATA_FILE}. Pass the folder a "
                          "run wrote, logs/<timestamp>_<mode>_<env>_<name> (train prints it as 'run directory: "
                          "...').")


def check_run_dir_name(root: str | os.PathLike[str], mode: str, env: str, name: str) -> None:
    """``ConfigError`` unless ``<timestamp>_<mode>_<env>_<name>`` (with room for a ``-1000`` suffix) fits in
    one file name on the file system of ``root``: the fix names the longest ``--name`` that does."""
    for kind, value in (("mode", mode), ("env", env), ("name", name)):
        _check_component(kind, value)
    fixed = len(f"{datetime.now().strftime(TIMESTAMP_FORMAT)}_{mode}_{env}_".encode()) + _SUFFIX_ROOM
    limit = name_max(root)
    size = len(name.encode())
    if fixed + size > limit:
        raise ConfigError(
            f"--name of {len(name)} characters ({size} bytes) is too long: the run directory's name "
            f"<timestamp>_{mode}_{env}_<name> would take {fixed + size} bytes, over this file system's limit "
            f"of {limit} per name. Use a --name of at most {max(0, limit - fixed)} bytes.")


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
    check_run_dir_name(root, mode, env, name)
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError:
        check_log_root(root)  # names the cause (a file in the way, no permission); re-raise if it finds none
        raise
    stamp = (now or datetime.now()).strftime(TIMESTAMP_FORMAT)
    base = f"{stamp}_{mode}_{env}_{name}"
    for attempt in range(1, _MAX_SUFFIX + 1):
        candidate = root / (base if attempt == 1 else f"{base}-{attempt}")
        try:
            candidate.mkdir()
        except FileExistsError:
            continue
        except OSError:
            check_log_root(root)
            raise
        return candidate
    raise ConfigError(
        f"{root / base} and {_MAX_SUFFIX - 1} suffixed variants already exist: "
        "clean up the log root or pick another --name"
    )
